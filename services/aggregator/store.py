"""Flight-recorder entries of every runner, compact and bounded.

Per runner, entry times sit in an `array('q')` (microseconds, kept sorted) beside the
entries themselves as msgpack bytes, about 150 bytes an entry in all. Retention is
bounded per runner and in total; the oldest entries go first.
"""

from __future__ import annotations

import bisect
import heapq
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

import msgspec

from shared.wire import Attrs, FlightEntry, MlxMemorySnapshot, Phase

__all__ = ["EntryStore", "SeqTracker", "StoredEntry", "micros"]


def micros(at: str) -> int:
    """Microseconds since the epoch of an RFC 3339 timestamp."""
    moment = datetime.fromisoformat(at)
    return int(moment.timestamp()) * 1_000_000 + moment.microsecond


class StoredEntry(msgspec.Struct, array_like=True, frozen=True):
    """An entry as stored: a `FlightEntry` without `seq`, encoded as a msgpack array."""

    at: str
    phase: Phase
    event: str
    detail: str | None
    attrs: Attrs
    taskId: str | None
    commandId: str | None
    mlxMemory: MlxMemorySnapshot | None


_pack = msgspec.msgpack.Encoder()
_unpack = msgspec.msgpack.Decoder(StoredEntry)


@dataclass(slots=True)
class SeqTracker:
    """Which `seq`s of one runner were seen: all below `floor`, plus `above`."""

    floor: int = 0
    above: set[int] = field(default_factory=set)

    def add(self, seq: int) -> bool:
        """Note `seq`; False when it was seen before (a redelivery)."""
        if seq < self.floor or seq in self.above:
            return False
        self.above.add(seq)
        while self.floor in self.above:
            self.above.discard(self.floor)
            self.floor += 1
        return True

    @property
    def missing(self) -> int:
        """Seqs below the highest one seen that never arrived."""
        if not self.above:
            return 0
        return max(self.above) + 1 - self.floor - len(self.above)


@dataclass(slots=True)
class _RunnerLog:
    times: array[int] = field(default_factory=lambda: array("q"))
    payloads: list[bytes] = field(default_factory=list)

    def add(self, at: int, payload: bytes) -> None:
        if not self.times or at >= self.times[-1]:
            self.times.append(at)
            self.payloads.append(payload)
        else:  # a late batch (a retry after an outage): keep time order
            index = bisect.bisect_right(self.times, at)
            self.times.insert(index, at)
            self.payloads.insert(index, payload)

    def drop_oldest(self, count: int) -> None:
        del self.times[:count]
        del self.payloads[:count]


class EntryStore:
    """Entries by runner id, with retention per runner and in total.

    Args:
        per_runner: entries kept per runner at most.
        total: entries kept in all at most; past it the runner with the most entries
            gives up its oldest.
    """

    def __init__(self, *, per_runner: int = 250_000, total: int = 2_000_000) -> None:
        self._per_runner = per_runner
        self._total = total
        self._logs: dict[str, _RunnerLog] = {}
        self.size = 0
        self.evicted = 0

    def add(self, runner_id: str, entry: FlightEntry) -> None:
        """Store one entry (dedupe by `seq` is the caller's)."""
        log = self._logs.setdefault(runner_id, _RunnerLog())
        payload = _pack.encode(
            StoredEntry(
                entry.at,
                entry.phase,
                entry.event,
                entry.detail,
                entry.attrs,
                entry.taskId,
                entry.commandId,
                entry.mlxMemory,
            )
        )
        log.add(micros(entry.at), payload)
        self.size += 1
        if len(log.times) > self._per_runner:
            self._evict(log, len(log.times) - self._per_runner)
        if self.size > self._total:
            largest = max(self._logs.values(), key=lambda candidate: len(candidate.times))
            self._evict(largest, self.size - self._total)

    def _evict(self, log: _RunnerLog, count: int) -> None:
        log.drop_oldest(count)
        self.size -= count
        self.evicted += count

    def count(self, runner_id: str) -> int:
        """Entries kept for one runner."""
        log = self._logs.get(runner_id)
        return len(log.times) if log else 0

    def newest(
        self,
        runner_ids: Iterable[str],
        *,
        since: int | None = None,
        until: int | None = None,
        limit: int,
    ) -> list[tuple[int, str, StoredEntry]]:
        """The newest `limit` entries of these runners within `[since, until]` (µs),
        oldest first, as (time, runner id, entry)."""
        candidates: list[tuple[int, str, bytes]] = []
        for runner_id in runner_ids:
            log = self._logs.get(runner_id)
            if log is None:
                continue
            low = 0 if since is None else bisect.bisect_left(log.times, since)
            high = len(log.times) if until is None else bisect.bisect_right(log.times, until)
            low = max(low, high - limit)
            candidates.extend(
                zip(
                    log.times[low:high],
                    [runner_id] * (high - low),
                    log.payloads[low:high],
                    strict=True,
                )
            )
        chosen = heapq.nlargest(limit, candidates, key=lambda c: c[0])
        chosen.reverse()
        return [(at, runner_id, _unpack.decode(payload)) for at, runner_id, payload in chosen]
