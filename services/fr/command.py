"""`rankscope fr analyze`: a PyTorch job's Flight Recorder dumps judged, in words or JSON."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgspec

from rankscope.services.fr.dumps import HostileDumpError, read_dumps
from rankscope.services.fr.verdict import judge
from rankscope.services.fr.words import verdict_words

__all__ = ["add_fr_command"]


def _analyze(args: argparse.Namespace, _settings: object) -> int:
    dumps, unread = read_dumps(Path(p) for p in args.paths)
    for problem in unread:
        print(f"rankscope fr: {problem}", file=sys.stderr)
    if not dumps:
        print("rankscope fr: no Flight Recorder dump read", file=sys.stderr)
        return 1
    verdict = judge(dumps, unread)
    if args.json:
        sys.stdout.buffer.write(msgspec.json.encode(verdict) + b"\n")
    else:
        print(verdict_words(verdict))
    return 1 if any(isinstance(p, HostileDumpError) for p in unread) else 0


def add_fr_command(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """The `fr` subcommand and its actions."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "fr",
        help="read a PyTorch job's Flight Recorder dumps (no torch needed)",
        description=(
            "PyTorch's Flight Recorder writes one dump per rank when a collective times out "
            "(TORCH_FR_DUMP_TEMP_FILE + rank), pickle or JSON. rankscope reads them without "
            "torch and without running anything a pickle asks for."
        ),
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    analyze = actions.add_parser(
        "analyze",
        help="name the ranks a job waits on, from every rank's dump",
        description=(
            "For each process group, the first collective not every member entered and the "
            "members missing from it; members that disagree on one (operation, shapes, "
            "types); then the culprits, the ranks every wait ends at. Exit status 1 when a "
            "file was refused as hostile or no dump could be read."
        ),
    )
    analyze.add_argument(
        "paths", nargs="+", metavar="PATH", help="dump files, or folders of one dump per rank"
    )
    analyze.add_argument(
        "--json", action="store_true", help="the verdict as data (`culprits`: rank numbers)"
    )
    analyze.set_defaults(handler=_analyze)
    return parser
