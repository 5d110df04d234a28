"""Telemetry of runners that no placement read so far names, held a while.

A placement and its runners' telemetry come on separate streams, followed apart: a
runner's first messages may be read a moment before the placement that made it. They wait
here for it; what no placement claims in time, or what overflows the bound, is refused
(a runner id that no placement made is a forgery or a mistake).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from rankscope.shared.wire import ReceivedTelemetry

__all__ = ["PARK_LIMIT", "PARK_S", "Parked", "Parking"]

PARK_S = 30.0
"""How long telemetry waits for the placement of its runner."""
PARK_LIMIT = 20_000
"""Messages held at most, all runners together; the oldest go first past it."""


@dataclass(frozen=True, slots=True)
class Parked:
    """One message waiting for its runner's placement."""

    subject: str
    data: bytes
    event: ReceivedTelemetry
    stored_ns: int | None
    at: float
    """When it was parked (the aggregator's monotonic clock)."""


class Parking:
    """Messages by runner id, oldest first, within `limit` in all."""

    def __init__(self, limit: int = PARK_LIMIT, hold_s: float = PARK_S) -> None:
        self._held: OrderedDict[str, list[Parked]] = OrderedDict()
        self._count = 0
        self._limit = limit
        self._hold_s = hold_s

    def __len__(self) -> int:
        return self._count

    def park(self, item: Parked) -> list[Parked]:
        """Hold `item`; returns what no longer fits (the oldest runner's messages)."""
        self._held.setdefault(item.event.runner.runnerId, []).append(item)
        self._count += 1
        evicted: list[Parked] = []
        while self._count > self._limit:
            _, oldest = self._held.popitem(last=False)
            self._count -= len(oldest)
            evicted += oldest
        return evicted

    def take(self, runner_id: str) -> list[Parked]:
        """The messages of `runner_id`, in the order they came, no longer held."""
        found = self._held.pop(runner_id, [])
        self._count -= len(found)
        return found

    def expired(self, now: float) -> list[Parked]:
        """The messages of runners whose first message has waited longer than the hold,
        no longer held."""
        gone: list[Parked] = []
        while self._held:
            runner_id, items = next(iter(self._held.items()))
            if now - items[0].at <= self._hold_s:
                break
            gone += self.take(runner_id)
        return gone
