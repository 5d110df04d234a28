"""`rankscope record [--job ID] [--node ID] -- COMMAND [ARGS...]`: run COMMAND with every
Python process it starts recording once it joins an `mlx.core.distributed` group or starts
a `torch.distributed` process group.

COMMAND's output, input and exit status pass through unchanged: recording happens in the
ranks (`hook`) and in a watcher process beside each (`watcher`), never in the way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from rankscope.services.record.signals import Relay
from rankscope.services.record.torch_hook import FR_BUFFER, FR_ENTRIES
from rankscope.shared.host import hostname
from rankscope.shared.recording import REAPER, STOP_FILE, Handoff, rank_marker, reaper_marker
from rankscope.shared.settings import Settings, to_environ

__all__ = ["LAUNCHED_RANK", "add_record_command", "record"]

SITE = Path(__file__).parent / "site"
"""The directory put first on `PYTHONPATH`: its `sitecustomize` switches recording on."""
LAUNCHED_RANK = ("MLX_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
"""Variables a launcher sets for each rank it starts: `rankscope record` runs as one rank,
and its ranks must agree on a job id among themselves."""
_EXIT_READ_S = 1.5


def _node(given: str | None, settings: Settings) -> str:
    """`--node`, else the node id this machine's agent uses, else the host name."""
    if given:
        return given
    if settings.node_id:
        return settings.node_id
    with contextlib.suppress(OSError):
        return (Path(settings.data_dir) / "node-id").read_text().strip() or hostname()
    return hostname()


def _environment(args: argparse.Namespace, settings: Settings, exits: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(to_environ(settings))
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = f"{SITE}{os.pathsep}{path}" if path else str(SITE)
    env["RANKSCOPE_RECORD"] = "1"
    env[Handoff.PYTHON] = sys.executable
    env[Handoff.NODE] = _node(args.node, settings)
    env[Handoff.HOST] = settings.node_address
    env[Handoff.EXITS] = exits
    if not any(name in env for name in FR_BUFFER):  # torch's Flight Recorder, sized once
        env[FR_BUFFER[0]] = str(FR_ENTRIES)
    if args.job:
        env[Handoff.JOB] = args.job
    elif not any(name in os.environ for name in LAUNCHED_RANK):
        # around a launcher: every rank it starts inherits this one id
        env[Handoff.JOB] = f"job-{secrets.token_hex(4)}"
    return env


def record(args: argparse.Namespace, settings: Settings) -> int:
    """Run the command recorded; returns its exit status (or ends by its signal)."""
    command = list(args.program)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print(
            "rankscope record: no command given (rankscope record -- COMMAND ...)", file=sys.stderr
        )
        return 2
    exits = tempfile.mkdtemp(prefix="rankscope-record-")
    (Path(exits) / reaper_marker(os.getpid())).touch()  # it writes how its child ended
    try:
        try:
            relay = Relay(
                command,
                _environment(args, settings, exits),
                kill_after=settings.record_kill_after,
                stopping=_stop_asked(Path(exits)),
            )
        except OSError as exc:
            print(f"rankscope record: cannot run {command[0]!r}: {exc}", file=sys.stderr)
            return 127
        returncode = relay.wait()
        _tell_watcher(Path(exits), relay.child.pid, returncode)
    finally:
        shutil.rmtree(exits, ignore_errors=True)
    if returncode < 0:  # end as it ended: by the same signal, to this thread (no other)
        signal.signal(-returncode, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {-returncode})
        signal.pthread_kill(threading.get_ident(), -returncode)
    return returncode


def _stop_asked(exits: Path) -> Callable[[signal.Signals], None]:
    """What tells the ranks' watchers that the user asked the job to stop (`STOP_FILE`,
    written before any rank hears of it), so their ends are a stop, not a fault."""

    def write(sig: signal.Signals) -> None:
        with contextlib.suppress(OSError):
            (exits / f"{STOP_FILE}.tmp").write_text(json.dumps({"signal": sig.name}))
            (exits / f"{STOP_FILE}.tmp").rename(exits / STOP_FILE)

    return write


def _tell_watcher(exits: Path, pid: int, returncode: int) -> None:
    """Say how a rank this command started ended, for its watcher (it cannot learn it:
    it is not the rank's parent), then wait briefly until every watcher under it has
    read how its rank ended (a launcher under it wrote theirs)."""
    marker = exits / rank_marker(pid)
    if marker.exists():
        (exits / f"{pid}.tmp").write_text(json.dumps({"returncode": returncode}))
        (exits / f"{pid}.tmp").rename(exits / str(pid))
        marker.unlink()
    deadline = time.monotonic() + _EXIT_READ_S
    while any(_unread(p) for p in exits.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.02)


def _unread(path: Path) -> bool:
    """Whether `path` of the exits folder is for a watcher to read still: a rank's marker
    or how it ended, not what says who writes them or that the user stopped the job."""
    return path.name != STOP_FILE and not path.name.endswith(REAPER)


def add_record_command(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """The `record` subcommand."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "record",
        help="run an MLX or torch.distributed program with its ranks recorded",
        usage="%(prog)s [-h] [--job ID] [--node ID] [--SETTING VALUE ...] -- COMMAND [ARGS ...]",
        description=(
            "Run COMMAND with every Python process it starts recorded once it joins an "
            "mlx.core.distributed group or starts a torch.distributed process group: a "
            "launcher (rankscope record -- mlx.launch ... train.py, rankscope record -- "
            "torchrun --nproc-per-node 4 train.py) or one rank under any launcher "
            "(mlx.launch ... -- rankscope record -- python train.py). Output and exit "
            "status pass through unchanged."
        ),
    )
    parser.add_argument("--job", help="the job's id (default: one drawn for this launch)")
    parser.add_argument("--node", help="this machine's node id (default: its agent's, else host)")
    parser.add_argument("program", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARGS...]")
    return parser
