"""Flight-recorder entries of every runner, compact and bounded.

Entries are kept as they arrived: the JSON of each batch is stored once, and each runner
indexes its entries with three arrays (time in microseconds, batch, position), about 14
bytes an entry beside the batch's share. Times stay sorted per runner; a batch is freed
when its last entry is evicted. Retention is bounded per runner and in total.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from shared.wire import FlightEntry, PhaseEntries, decode

__all__ = ["EntryStore", "SeqTracker", "micros"]

_seconds: dict[str, int] = {}


def micros(at: str) -> int:
    """Microseconds since the epoch of a wire timestamp (fast for the fixed-width form;
    any RFC 3339 form is accepted)."""
    if len(at) == 27 and at[26] == "Z":
        whole = _seconds.get(at[:19])
        if whole is None:
            if len(_seconds) > 4096:
                _seconds.clear()
            whole = _seconds[at[:19]] = int(datetime.fromisoformat(at[:19] + "+00:00").timestamp())
        return whole * 1_000_000 + int(at[20:26])
    moment = datetime.fromisoformat(at)
    return int(moment.timestamp()) * 1_000_000 + moment.microsecond


@dataclass(slots=True)
class SeqTracker:
    """Which `seq`s of one runner were seen: all below `floor`, plus `above`."""

    floor: int = 0
    above: set[int] = field(default_factory=set)

    def add(self, seq: int) -> bool:
        """Note `seq`; False when it was seen before (a redelivery)."""
        if seq == self.floor and not self.above:
            self.floor += 1
            return True
        if seq < self.floor or seq in self.above:
            return False
        self.above.add(seq)
        while self.floor in self.above:
            self.above.discard(self.floor)
            self.floor += 1
        return True

    def fresh(self, entries: Sequence[FlightEntry]) -> list[tuple[int, FlightEntry]]:
        """Note every entry's seq; the (position, entry) pairs not seen before."""
        first = self.floor
        if (
            not self.above
            and entries
            and entries[0].seq == first
            and all(e.seq == first + i for i, e in enumerate(entries))
        ):
            self.floor += len(entries)  # the usual case: the next consecutive batch
            return list(enumerate(entries))
        return [(i, e) for i, e in enumerate(entries) if self.add(e.seq)]

    @property
    def missing(self) -> int:
        """Seqs below the highest one seen that never arrived."""
        if not self.above:
            return 0
        return max(self.above) + 1 - self.floor - len(self.above)


@dataclass(slots=True)
class _RunnerLog:
    times: array[int] = field(default_factory=lambda: array("q"))
    batches: array[int] = field(default_factory=lambda: array("q"))
    positions: array[int] = field(default_factory=lambda: array("H"))

    def insert(self, at: int, batch: int, position: int) -> None:
        """Put a late entry (a retry after an outage) where its time belongs."""
        index = bisect.bisect_right(self.times, at)
        self.times.insert(index, at)
        self.batches.insert(index, batch)
        self.positions.insert(index, position)

    def newest_first(
        self, runner_id: str, low: int, high: int
    ) -> Iterator[tuple[int, str, int, int]]:
        times, batches, positions = self.times, self.batches, self.positions
        for index in range(high - 1, low - 1, -1):
            yield times[index], runner_id, batches[index], positions[index]


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
        self._payloads: dict[int, bytes] = {}
        self._live: dict[int, int] = {}
        self._next_batch = itertools.count()
        self.size = 0
        self.evicted = 0

    def add(self, runner_id: str, payload: bytes, fresh: Iterable[tuple[int, FlightEntry]]) -> None:
        """Store the new entries of one batch: `payload` is the batch's `PhaseEntries` JSON,
        `fresh` the (position, entry) pairs not seen before (dedupe is the caller's)."""
        log = self._logs.get(runner_id)
        if log is None:
            log = self._logs[runner_id] = _RunnerLog()
        batch, count = next(self._next_batch), 0
        times = log.times
        newest = times[-1] if times else -1
        second, base = "", 0
        for position, entry in fresh:  # the hot loop of ingest: kept flat on purpose
            text = entry.at
            if text[:19] == second and len(text) == 27:  # same second as the last entry
                at = base + int(text[20:26])
            else:
                at = micros(text)
                second, base = text[:19], at - at % 1_000_000
            if at >= newest:
                times.append(at)
                log.batches.append(batch)
                log.positions.append(position)
                newest = at
            else:
                log.insert(at, batch, position)
            count += 1
        if not count:
            return
        self._payloads[batch], self._live[batch] = payload, count
        self.size += count
        if len(log.times) > self._per_runner:
            self._evict(log, len(log.times) - self._per_runner)
        if self.size > self._total:
            largest = max(self._logs.values(), key=lambda candidate: len(candidate.times))
            self._evict(largest, self.size - self._total)

    def _evict(self, log: _RunnerLog, count: int) -> None:
        for batch in log.batches[:count]:
            self._live[batch] -= 1
            if not self._live[batch]:
                del self._live[batch], self._payloads[batch]
        del log.times[:count], log.batches[:count], log.positions[:count]
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
    ) -> list[tuple[int, str, FlightEntry]]:
        """The newest `limit` entries of these runners within `[since, until]` (µs),
        oldest first, as (time, runner id, entry)."""
        streams = []
        for runner_id in runner_ids:
            log = self._logs.get(runner_id)
            if log is None:
                continue
            low = 0 if since is None else bisect.bisect_left(log.times, since)
            high = len(log.times) if until is None else bisect.bisect_right(log.times, until)
            streams.append(log.newest_first(runner_id, max(low, high - limit), high))
        chosen = list(
            itertools.islice(heapq.merge(*streams, key=lambda c: c[0], reverse=True), limit)
        )
        chosen.reverse()
        batches: dict[int, PhaseEntries] = {}
        found = []
        for at, runner_id, batch, position in chosen:
            decoded = batches.get(batch)
            if decoded is None:
                decoded = batches[batch] = decode(self._payloads[batch], PhaseEntries)
            found.append((at, runner_id, decoded.entries[position]))
        return found
