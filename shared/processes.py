"""Child processes that never outlive the process that started them, and what the
operating system says a process is doing, the same on Linux and macOS.

On Linux the kernel ties a child to its parent (`PR_SET_PDEATHSIG`); everywhere, a child
also watches its parent itself (`watch_parent`), which is all macOS has, or has a shell
of its own watch for it (`kill_when_orphaned`) where its own threads may be held up. Setting
`RANKSCOPE_PORTABLE_PROCESSES=1` leaves the Linux-only tie out, so tests on Linux run
the path macOS takes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from rankscope.shared.wire import ProcessState

__all__ = [
    "DUMPABLE",
    "LIFELINE_ENV",
    "PORTABLE_ENV",
    "STACK_BYTES",
    "die_with_parent",
    "dump_stacks",
    "kill_when_orphaned",
    "process_state",
    "signal_name",
    "stop_watching",
    "watch_parent",
    "watch_parent_from_env",
]

PORTABLE_ENV = "RANKSCOPE_PORTABLE_PROCESSES"
LIFELINE_ENV = "RANKSCOPE_LIFELINE_PID"
"""The pid of the process a service started by `rankscope up` must not outlive."""
WATCH_EVERY_S = 0.25
"""How often a child checks that its parent is still there."""


def _portable() -> bool:
    return sys.platform != "linux" or os.environ.get(PORTABLE_ENV) == "1"


def _set_pdeathsig(signum: int) -> None:
    # PR_SET_PDEATHSIG: the kernel sends `signum` when the starting thread exits.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signum)


def die_with_parent(signum: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` that ties a child's life to its parent's (Linux), or None where the
    kernel offers no such tie (the child then watches with `watch_parent`): the kernel
    sends the child `signum` when the parent dies. SIGKILL for a child that may be blocked
    where no signal handler runs (a collective).

    Start such children from the main thread: the tie is to the starting thread.
    """
    return None if _portable() else functools.partial(_set_pdeathsig, signum)


def watch_parent(parent: int, signum: int, every: float = WATCH_EVERY_S) -> threading.Thread:
    """Send this process `signum` once `parent` is no longer its parent (it died, and the
    process was handed to init or launchd), from a daemon thread that checks every
    `every` seconds (it runs while the main thread waits in C, a collective included).

    Returns:
        The watching thread, started.
    """

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every)
        os.kill(os.getpid(), signum)

    thread = threading.Thread(target=watch, name="lifeline", daemon=True)
    thread.start()
    return thread


_ORPHANED = (
    'while kill -0 "$1" 2>/dev/null && kill -0 "$2" 2>/dev/null; do sleep "$3"; done; '
    'kill -0 "$1" 2>/dev/null || kill -KILL "$2" 2>/dev/null'
)
"""Until `$1` (the parent) or `$2` (the child) has ended, every `$3` seconds; then SIGKILL
the child if the parent is the one gone."""


_WATCHERS: list[subprocess.Popen[bytes]] = []
"""The shells `kill_when_orphaned` started, held for this process's life."""


def kill_when_orphaned(parent: int, every: float = WATCH_EVERY_S) -> None:
    """SIGKILL this process once `parent` has ended, from a shell of its own that ends
    with it. Unlike `watch_parent`'s thread it acts while no thread of this process can
    run: MLX holds the interpreter's lock while its ring connects, for as long as a peer
    is missing. (`parent`, once dead, counts as ended when its own parent reaps it.)"""
    watcher = subprocess.Popen(
        ["/bin/sh", "-c", _ORPHANED, "rankscope-lifeline", str(parent), str(os.getpid()),
         f"{every:g}"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    _WATCHERS.append(watcher)


def stop_watching() -> None:
    """End the shells `kill_when_orphaned` started, as this process exits on its own (one
    whose process was killed ends at its next check)."""
    for watcher in _WATCHERS:
        watcher.kill()


def watch_parent_from_env(signum: int = signal.SIGTERM) -> None:
    """Watch the process `RANKSCOPE_LIFELINE_PID` names, when it is set (a service that
    `rankscope up` started): at once if it is no longer this process's parent."""
    with contextlib.suppress(ValueError):
        watch_parent(int(os.environ.pop(LIFELINE_ENV, "")), signum)


def signal_name(returncode: int) -> str | None:
    """`SIGKILL` for a return code of -9; None for a normal exit."""
    if returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


_STATES = {
    psutil.STATUS_RUNNING: ProcessState.RUNNING,
    psutil.STATUS_SLEEPING: ProcessState.SLEEPING,
    psutil.STATUS_IDLE: ProcessState.SLEEPING,
    psutil.STATUS_WAITING: ProcessState.SLEEPING,
    psutil.STATUS_WAKING: ProcessState.RUNNING,
    psutil.STATUS_DISK_SLEEP: ProcessState.DISK_WAIT,
    psutil.STATUS_STOPPED: ProcessState.STOPPED,
    psutil.STATUS_TRACING_STOP: ProcessState.STOPPED,
    psutil.STATUS_ZOMBIE: ProcessState.ZOMBIE,
    psutil.STATUS_DEAD: ProcessState.GONE,
}


def process_state(pid: int | None) -> ProcessState:
    """What the operating system says process `pid` is doing."""
    if pid is None:
        return ProcessState.GONE
    try:
        status = psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return ProcessState.GONE
    except psutil.Error:
        return ProcessState.UNKNOWN
    return _STATES.get(status, ProcessState.UNKNOWN)


DUMPABLE = frozenset({ProcessState.RUNNING, ProcessState.SLEEPING, ProcessState.DISK_WAIT})
"""States in which a process runs its signal handlers, so can write its stacks."""
STACK_WAIT_S = 1.0
"""Longest a capture waits for a process to write its stacks."""
STACK_BYTES = 32 << 10
"""The most of a stack dump kept (the main thread comes first, each thread's innermost
frame first)."""


async def dump_stacks(pid: int, path: Path, sig: int, *, first: str) -> str | None:
    """Ask process `pid` for its threads' stacks with `sig` (its `faulthandler` appends
    them to `path`) and read them once it stops writing, the thread that holds `first`
    first (None when it wrote nothing in time)."""
    await asyncio.to_thread(path.write_bytes, b"")
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return None
    deadline, size = time.monotonic() + STACK_WAIT_S, -1
    while time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        now_size = (await asyncio.to_thread(path.stat)).st_size
        if now_size and now_size == size:
            break
        size = now_size
    text = (await asyncio.to_thread(path.read_bytes)).decode(errors="replace")
    threads = sorted(text.strip().split("\n\n"), key=lambda t: first not in t)
    return "\n\n".join(threads)[:STACK_BYTES] or None
