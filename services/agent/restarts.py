"""When a runner that exited is started again, and when it is given up: a crash of its own
counts towards the breaker (`CRASH_LIMIT` in `CRASH_WINDOW_S`), a rank that only gave up on
its peers waits a little longer each time and never trips it, and an error that would
recur on every start is not retried. Pure: each exit comes in with its time."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

__all__ = ["CRASH_LIMIT", "CRASH_WINDOW_S", "VICTIM_BACKOFF_MAX_S", "Restart", "Restarts"]

CRASH_LIMIT = 3
CRASH_WINDOW_S = 60.0
VICTIM_BACKOFF_MAX_S = 30.0
"""Longest wait before restarting a runner that gave up on its peers again and again."""


@dataclass(frozen=True, slots=True)
class Restart:
    """What to do of one exit: start again after `delay` seconds, or not (None)."""

    delay: float | None
    why_not: str | None = None
    """Why it is not started again, in words that follow the exit's cause."""


class Restarts:
    """One runner's exits and the breaker they feed."""

    def __init__(self) -> None:
        self._crashes: deque[float] = deque()
        self._victim_exits = 0

    def ready(self) -> None:
        """The runner is ready again: its next wait for its peers starts short."""
        self._victim_exits = 0

    def exited(self, at: float, *, victim: bool, permanent: bool) -> Restart:
        """An exit at `at` (monotonic seconds): a `victim` only gave up on its peers (its
        collective timed out, or its ring lost a peer); a `permanent` error recurs on every
        start."""
        if permanent:
            return Restart(None, "not restarted: the same error would recur on every start")
        if victim:  # no crash of its own: it waits for its peers, a little longer each time
            delay = min(2.0**self._victim_exits, VICTIM_BACKOFF_MAX_S)
            self._victim_exits += 1
        else:
            delay = 1.0
            self._crashes.append(at)
        while self._crashes and self._crashes[0] < at - CRASH_WINDOW_S:
            self._crashes.popleft()
        if len(self._crashes) >= CRASH_LIMIT:
            return Restart(None, f"gave up after {CRASH_LIMIT} crashes in {CRASH_WINDOW_S:g}s")
        return Restart(delay)
