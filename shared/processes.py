"""Child processes that never outlive the process that started them."""

from __future__ import annotations

import contextlib
import ctypes
import signal
import sys
from collections.abc import Callable

__all__ = ["die_with_parent", "signal_name"]


def _set_pdeathsig() -> None:
    # PR_SET_PDEATHSIG: the kernel sends SIGTERM when the starting thread exits.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def die_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` that ties a child's life to its parent's (Linux), or None elsewhere.

    Start such children from the main thread: the tie is to the starting thread.
    """
    return _set_pdeathsig if sys.platform == "linux" else None


def signal_name(returncode: int) -> str | None:
    """`SIGKILL` for a return code of -9; None for a normal exit."""
    if returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"
