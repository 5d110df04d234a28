"""Child processes that never outlive the process that started them."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from shared.wire import ProcessState

__all__ = ["die_with_parent", "process_state", "signal_name"]


def _set_pdeathsig(signum: int) -> None:
    # PR_SET_PDEATHSIG: the kernel sends `signum` when the starting thread exits.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signum)


def die_with_parent(signum: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` that ties a child's life to its parent's (Linux), or None elsewhere:
    the kernel sends the child `signum` when the parent dies. SIGKILL for a child that may
    be blocked where no signal handler runs (a collective).

    Start such children from the main thread: the tie is to the starting thread.
    """
    return functools.partial(_set_pdeathsig, signum) if sys.platform == "linux" else None


def signal_name(returncode: int) -> str | None:
    """`SIGKILL` for a return code of -9; None for a normal exit."""
    if returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


_PROC = Path("/proc/self/stat").exists()

_STATES = {
    "R": ProcessState.RUNNING,
    "S": ProcessState.SLEEPING,
    "I": ProcessState.SLEEPING,
    "D": ProcessState.DISK_WAIT,
    "T": ProcessState.STOPPED,
    "t": ProcessState.STOPPED,
    "Z": ProcessState.ZOMBIE,
    "X": ProcessState.GONE,
}


def process_state(pid: int | None) -> ProcessState:
    """What the kernel says process `pid` is doing (Linux's /proc; elsewhere only whether
    it exists)."""
    if pid is None:
        return ProcessState.GONE
    if not _PROC:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return ProcessState.GONE
        except PermissionError:
            pass
        return ProcessState.UNKNOWN
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ProcessState.GONE
    return _STATES.get(stat.rsplit(")", 1)[1].split()[0], ProcessState.UNKNOWN)
