"""Fan each job's latest rank table out to any number of in-process subscribers.

Tables are whole, never deltas, so a subscriber that falls behind skips straight to the
newest one instead of queueing stale tables.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from rankscope.shared.wire import RankTableStream

__all__ = ["TableHub"]


class TableHub:
    """Latest table and version per job, and a wake-up for those who follow it."""

    def __init__(self) -> None:
        self._latest: dict[str, tuple[int, RankTableStream]] = {}
        self._changed: dict[str, asyncio.Event] = {}
        self._following: dict[str, int] = {}
        """Followers per job: a job nobody follows keeps no wake-up (waits on ever new
        unknown ids would otherwise hold memory for good)."""

    def latest(self, job_id: str) -> tuple[int, RankTableStream] | None:
        """The newest version and table of a job, if it has one."""
        return self._latest.get(job_id)

    def publish(self, job_id: str, version: int, table: RankTableStream) -> None:
        """Record a job's new table and wake its followers."""
        self._latest[job_id] = (version, table)
        self._changed.pop(job_id, asyncio.Event()).set()

    def forget(self, job_id: str) -> None:
        """Drop a job's table (its spec is gone); its followers wait for it to return."""
        self._latest.pop(job_id, None)

    async def follow(self, job_id: str) -> AsyncIterator[tuple[int, RankTableStream]]:
        """The current table (after waiting for the job if it has none yet), then every
        newer one, for as long as the caller iterates."""
        seen = 0
        self._following[job_id] = self._following.get(job_id, 0) + 1
        try:
            while True:
                current = self._latest.get(job_id)
                if current is not None and current[0] > seen:
                    seen = current[0]
                    yield current
                    continue
                await self._changed.setdefault(job_id, asyncio.Event()).wait()
        finally:
            self._following[job_id] -= 1
            if not self._following[job_id]:
                del self._following[job_id]
                self._changed.pop(job_id, None)
