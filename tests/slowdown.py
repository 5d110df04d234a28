"""A rank made slower for real: its process stopped and continued on a duty cycle, so it
computes at `1 / factor` of its pace (SIGSTOP/SIGCONT reach any process, on Linux and
macOS alike; no cgroup needed)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

__all__ = ["PERIOD_S", "slowed"]

PERIOD_S = 0.004
"""One stop and one run: short beside a step (the demo's decode step takes ~4 ms, ~1 ms of
it working), so every step is slowed alike. Stops of 10 ms every 20 ms landed on some
steps' work and on others' wait: a rank slowed 2x worked 1.1-1.3x slower for 20 s at a
time."""


@contextlib.contextmanager
def slowed(pid: int, factor: float) -> Iterator[None]:
    """Process `pid` runs `1 / factor` of the time while the block lasts; continued after
    (also when the block raises)."""
    stopped_for = PERIOD_S * (1 - 1 / factor)
    done = threading.Event()

    def cycle() -> None:
        while not done.is_set():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                time.sleep(stopped_for)
                os.kill(pid, signal.SIGCONT)
            time.sleep(PERIOD_S - stopped_for)

    thread = threading.Thread(target=cycle, name=f"slowing {pid}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
