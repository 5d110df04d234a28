"""`rankscope fr analyze` and `load`: a PyTorch job's Flight Recorder dumps judged, in words
or JSON, or put into a running rankscope as a job with its incident."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import httpx
import msgspec

from rankscope.services.fr.dumps import Dump, DumpError, HostileDumpError, read_dumps
from rankscope.services.fr.timeline import ENTRIES_PER_RANK, as_load
from rankscope.services.fr.verdict import judge
from rankscope.services.fr.words import verdict_words
from rankscope.shared.specs import id_problem
from rankscope.shared.timestamps import now
from rankscope.shared.wire.fr import FrLoad

__all__ = ["add_fr_command"]


LOAD_BYTES = 1_000_000
"""The most a load sends (the gateway takes request bodies of up to 1 MiB)."""


def _read(paths: list[str]) -> tuple[list[Dump], list[DumpError]] | None:
    """The dumps under `paths`, each file not read said on stderr; None when none was."""
    dumps, unread = read_dumps(Path(p) for p in paths)
    for problem in unread:
        print(f"rankscope fr: {problem}", file=sys.stderr)
    if not dumps:
        print("rankscope fr: no Flight Recorder dump read", file=sys.stderr)
        return None
    return dumps, unread


def _analyze(args: argparse.Namespace, _settings: object) -> int:
    if (read := _read(args.paths)) is None:
        return 1
    dumps, unread = read
    verdict = judge(dumps, unread)
    if args.json:
        sys.stdout.buffer.write(msgspec.json.encode(verdict) + b"\n")
    else:
        print(verdict_words(verdict))
    return 1 if any(isinstance(p, HostileDumpError) for p in unread) else 0


def _fitted(job: str, dumps: list[Dump], unread: list[DumpError], files: str) -> FrLoad | None:
    """The load, each rank's lane cut to the newest records that fit in `LOAD_BYTES`."""
    verdict, moment = judge(dumps, unread), now()
    kept = ENTRIES_PER_RANK
    while True:
        load = as_load(job, dumps, verdict, loaded_at=moment, files=files, kept=kept)
        if len(msgspec.json.encode(load)) <= LOAD_BYTES:
            return load
        if kept == 1:
            return None
        kept //= 2


def _post(url: str | None, load: FrLoad) -> str | None:
    """Send `load` to the gateway at `url` (`RANKSCOPE_URL`, its API token from
    `RANKSCOPE_API_TOKEN`); why it was not taken, or None."""
    base = (url or os.environ.get("RANKSCOPE_URL") or "http://127.0.0.1:8000").rstrip("/")
    token = os.environ.get("RANKSCOPE_API_TOKEN")
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        answer = httpx.post(
            f"{base}/v1/fr/loads", content=msgspec.json.encode(load), headers=headers, timeout=60
        )
    except httpx.HTTPError as error:
        return f"cannot reach {base}: {error or type(error).__name__}"
    if answer.is_error:
        try:
            detail = json.loads(answer.content or b"{}").get("detail", answer.reason_phrase)
        except (ValueError, AttributeError):
            detail = f"{answer.reason_phrase} (not rankscope's gateway at {base}?)"
        return f"{answer.status_code}: {detail}"
    return None


def _job(text: str) -> str:
    if (problem := id_problem(text)) is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def _load(args: argparse.Namespace, _settings: object) -> int:
    if (read := _read(args.paths)) is None:
        return 1
    dumps, unread = read
    if any(isinstance(p, HostileDumpError) for p in unread):
        print("rankscope fr: nothing loaded: a file was refused as hostile", file=sys.stderr)
        return 1
    load = _fitted(args.job, dumps, unread, ", ".join(args.paths))
    if load is None:
        print(f"rankscope fr: {len(dumps)} ranks' verdict alone is over {LOAD_BYTES} bytes",
              file=sys.stderr)  # fmt: skip
        return 1
    if (refused := _post(args.url, load)) is not None:
        print(f"rankscope fr: {refused}", file=sys.stderr)
        return 1
    kept = max(len(r.entries) for r in load.ranks)
    print(f"loaded {len(dumps)} ranks as job {args.job} (the newest {kept} records of each)")
    print(load.verdict.summary)
    print(f"see: rankscope timeline --instance {args.job}; rankscope diagnose --history")
    return 0


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
    load = actions.add_parser(
        "load",
        help="put the dumps into the running rankscope as a job, the verdict as its incident",
        description=(
            "Judge the dumps here, then show their ranks as instance JOB (timeline, web "
            "page) and the verdict as an incident of it (history, bundle, alerts, seen "
            "before). Loading the same dumps again makes no second incident."
        ),
    )
    load.add_argument(
        "paths", nargs="+", metavar="PATH", help="dump files, or folders of one dump per rank"
    )
    load.add_argument("--job", required=True, type=_job, help="the instance to show it as")
    load.add_argument("--url", help="gateway URL [RANKSCOPE_URL, http://127.0.0.1:8000]")
    load.set_defaults(handler=_load)
    return parser
