"""Flight-recorder entries of every runner, compact and bounded.

Entries are kept as they arrived: the JSON of each batch is stored once, and each runner
indexes its entries with three arrays (time in microseconds, batch, position), about 14
bytes an entry beside the batch's share. Times stay sorted per runner; a batch is freed
when its last entry is evicted. Retention is bounded per runner and in total, in entries,
and in bytes: past the bytes, the node holding the most gives up its runners' oldest, so
a node that floods trims its own history, never another's.
"""

from __future__ import annotations

import bisect
import itertools
import logging
from array import array
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import msgspec

from rankscope.shared.wire import FlightEntry, PhaseEntries, decode

__all__ = [
    "EntryStore",
    "LogImage",
    "Row",
    "Selection",
    "StoreImage",
]


INDEX_BYTES = 14
"""What an entry's index costs beside its batch (three array slots)."""
BATCH_BYTES = 64
"""What a batch costs beside its JSON (its bytes object, its two dict slots)."""
TRIM_TOLD = 64 << 20
"""A node's history given up past the byte bound is logged at first and every this much."""
logger = logging.getLogger(__name__)


class LogImage(msgspec.Struct, array_like=True):
    """One runner's index in a snapshot."""

    times: bytes
    batches: bytes
    positions: bytes
    evicted: int
    node: str = ""


class StoreImage(msgspec.Struct, array_like=True):
    """The whole store in a snapshot."""

    logs: dict[str, LogImage]
    payloads: dict[int, bytes]
    batches: int
    evicted: int


@dataclass(slots=True)
class _RunnerLog:
    node: str = ""
    times: array[int] = field(default_factory=lambda: array("q"))
    batches: array[int] = field(default_factory=lambda: array("q"))
    positions: array[int] = field(default_factory=lambda: array("H"))
    evicted: int = 0
    bytes: int = 0
    """What its entries and their batches hold (`INDEX_BYTES`, `BATCH_BYTES`)."""

    def insert(self, at: int, batch: int, position: int) -> None:
        """Put a late entry (a retry after an outage) where its time belongs."""
        index = bisect.bisect_right(self.times, at)
        self.times.insert(index, at)
        self.batches.insert(index, batch)
        self.positions.insert(index, position)


class EntryStore:
    """Entries by runner id, with retention per runner and in total.

    Args:
        per_runner: entries kept per runner at most.
        total: entries kept in all at most; past it the runner with the most entries
            gives up its oldest.
        max_bytes: bytes kept in all at most; past it the node holding the most gives up
            the oldest of its runner holding the most.
    """

    def __init__(
        self, *, per_runner: int = 250_000, total: int = 2_000_000, max_bytes: int = 512 << 20
    ) -> None:
        self._per_runner = per_runner
        self._total = total
        self._max_bytes = max_bytes
        self._logs: dict[str, _RunnerLog] = {}
        self._payloads: dict[int, bytes] = {}
        self._live: dict[int, int] = {}
        self._batches = 0
        self._node_bytes: dict[str, int] = {}
        self.size = 0
        self.bytes = 0
        """What every entry held costs, in bytes (`INDEX_BYTES`, `BATCH_BYTES`)."""
        self.evicted = 0
        self.trimmed: dict[str, int] = {}
        """Bytes of each node's history given up to stay within `max_bytes`."""

    @property
    def per_runner(self) -> int:
        """Entries kept per runner at most."""
        return self._per_runner

    @property
    def total(self) -> int:
        """Entries kept in all at most."""
        return self._total

    @property
    def max_bytes(self) -> int:
        """Bytes kept in all at most."""
        return self._max_bytes

    def image(self) -> StoreImage:
        """Everything stored, for a snapshot (arrays as their raw bytes)."""
        return StoreImage(
            logs={
                runner_id: LogImage(
                    times=log.times.tobytes(),
                    batches=log.batches.tobytes(),
                    positions=log.positions.tobytes(),
                    evicted=log.evicted,
                    node=log.node,
                )
                for runner_id, log in self._logs.items()
            },
            payloads=self._payloads,
            batches=self._batches,
            evicted=self.evicted,
        )

    @classmethod
    def from_image(
        cls, image: StoreImage, *, per_runner: int, total: int, max_bytes: int = 512 << 20
    ) -> EntryStore:
        """A store holding what `image` held, trimmed to these limits.

        Raises:
            ValueError: the image does not hold together (arrays of different lengths, a
                batch that is not there).
        """
        store = cls(per_runner=per_runner, total=total, max_bytes=max_bytes)
        live: Counter[int] = Counter()
        for runner_id, held in image.logs.items():
            log = _RunnerLog(node=held.node, evicted=held.evicted)
            log.times.frombytes(held.times)
            log.batches.frombytes(held.batches)
            log.positions.frombytes(held.positions)
            if not len(log.times) == len(log.batches) == len(log.positions):
                raise ValueError(f"runner {runner_id!r}: index arrays of different lengths")
            live.update(log.batches)
            store._logs[runner_id] = log
            store.size += len(log.times)
        if not live.keys() <= image.payloads.keys():
            raise ValueError("an entry points at a batch that is not stored")
        store._live = dict(live)
        store._payloads = (
            image.payloads
            if len(live) == len(image.payloads)
            else {batch: image.payloads[batch] for batch in live}
        )
        store._batches, store.evicted = image.batches, image.evicted
        for log in store._logs.values():
            store._count(
                log,
                len(log.times) * INDEX_BYTES
                + sum(len(store._payloads[batch]) + BATCH_BYTES for batch in set(log.batches)),
            )
        for log in store._logs.values():
            if len(log.times) > per_runner:
                store._evict(log, len(log.times) - per_runner)
        store._trim()
        return store

    def add(
        self,
        runner_id: str,
        payload: bytes,
        positions: Sequence[int],
        times: Sequence[int],
        ceiling: int | None = None,
        node: str = "",
    ) -> None:
        """Store the new entries of one batch: `payload` is the batch's `PhaseEntries` JSON,
        `positions` where in it the entries not seen before are (dedupe is the caller's),
        `times` their times (µs since the epoch). An entry is filed at its time, or at
        `ceiling` (µs, when it arrived) if later: a clock running ahead cannot keep its
        entries the newest. The runner is on `node`."""
        count = len(positions)
        if not count:
            return
        log = self._logs.get(runner_id)
        if log is None:
            log = self._logs[runner_id] = _RunnerLog(node)
        batch = self._batches
        self._batches += 1
        filed = log.times
        newest = filed[-1] if filed else -1
        ceiling = (1 << 62) if ceiling is None else ceiling
        if count == 1 and newest <= times[0] <= ceiling:  # the usual entry
            filed.append(times[0])
            log.batches.append(batch)
            log.positions.append(positions[0])
        elif times[0] >= newest and times[-1] <= ceiling and times == sorted(times):
            filed.extend(times)  # the usual batch: after the runner's newest, in order
            log.batches.extend(array("q", (batch,)) * count)
            log.positions.extend(positions)
        else:
            for position, at in zip(positions, times, strict=True):
                at = min(at, ceiling)
                if at >= newest:
                    filed.append(at)
                    log.batches.append(batch)
                    log.positions.append(position)
                    newest = at
                else:
                    log.insert(at, batch, position)
        self._payloads[batch], self._live[batch] = payload, count
        self._filed(log, count, len(payload) + BATCH_BYTES)

    def add_run(
        self,
        runner_id: str,
        payloads: Sequence[tuple[bytes, int]],
        times: Sequence[int],
        ceiling: int,
        node: str = "",
    ) -> bool:
        """Store every entry of several batches of one runner (on `node`) at once
        (`payloads`: each batch's JSON and how many entries it holds, all new; `times`:
        theirs, µs, sorted), if they all come after its newest and by `ceiling`; else store
        nothing and say so."""
        log = self._logs.get(runner_id)
        if log is None:
            log = self._logs[runner_id] = _RunnerLog(node)
        if (log.times and times[0] < log.times[-1]) or times[-1] > ceiling:
            return False
        first = self._batches
        self._batches += len(payloads)
        held = 0
        for batch, (payload, count) in enumerate(payloads, first):
            self._payloads[batch], self._live[batch] = payload, count
            held += len(payload) + BATCH_BYTES
        log.times.extend(times)
        if len(payloads) == len(times):  # a run of lone entries, the usual
            log.batches.extend(range(first, self._batches))
            log.positions.frombytes(bytes(log.positions.itemsize * len(times)))  # zeros
        else:
            for batch, (_, count) in enumerate(payloads, first):
                log.batches.extend(array("q", (batch,)) * count)
                log.positions.extend(range(count))
        self._filed(log, len(times), held)
        return True

    def _filed(self, log: _RunnerLog, count: int, held: int) -> None:
        """Count `count` entries just filed in `log` with their batches' `held` bytes,
        and evict past the limits."""
        self.size += count
        self._count(log, held + count * INDEX_BYTES)
        if len(log.times) > self._per_runner:
            self._evict(log, len(log.times) - self._per_runner)
        self._trim()

    def _count(self, log: _RunnerLog, change: int) -> None:
        """Add `change` bytes to what `log`, its node and the store hold."""
        log.bytes += change
        self.bytes += change
        self._node_bytes[log.node] = self._node_bytes.get(log.node, 0) + change

    def _trim(self) -> None:
        """Past the total, the runner with the most entries gives up its oldest; past the
        bytes, the node holding the most gives up its largest runner's oldest."""
        while self.size > self._total:
            largest = max(self._logs.values(), key=lambda candidate: len(candidate.times))
            self._evict(largest, min(self.size - self._total, len(largest.times)))
        while self.bytes > self._max_bytes:
            node = max(self._node_bytes, key=self._node_bytes.__getitem__)
            log = max(
                (held for held in self._logs.values() if held.node == node),
                key=lambda held: held.bytes,
            )
            if not log.times:
                break  # nothing left to give up: cannot happen while the counts agree
            share = log.bytes / len(log.times)
            count = min(len(log.times), int((self.bytes - self._max_bytes) / share) + 1)
            before = self.trimmed.get(node, 0)
            self.trimmed[node] = before + self._evict(log, count)
            if before == 0 or self.trimmed[node] // TRIM_TOLD > before // TRIM_TOLD:
                logger.warning(
                    "node %s holds %.1f MiB, the most of the aggregator's %.1f MiB "
                    "(RANKSCOPE_RETENTION_BYTES): its oldest entries go first, %.1f MiB so far",
                    node or "(unknown)",
                    self._node_bytes[node] / (1 << 20),
                    self._max_bytes / (1 << 20),
                    self.trimmed[node] / (1 << 20),
                )

    def _evict(self, log: _RunnerLog, count: int) -> int:
        """Evict the `count` oldest entries of `log`; the bytes that freed."""
        freed = count * INDEX_BYTES
        for batch in log.batches[:count]:
            self._live[batch] -= 1
            if not self._live[batch]:
                freed += len(self._payloads.pop(batch)) + BATCH_BYTES
                del self._live[batch]
        del log.times[:count], log.batches[:count], log.positions[:count]
        log.evicted += count
        self.size -= count
        self.evicted += count
        self._count(log, -freed)
        return freed

    def count(self, runner_id: str) -> int:
        """Entries kept for one runner."""
        log = self._logs.get(runner_id)
        return len(log.times) if log else 0

    def retention(self, runner_id: str) -> tuple[int | None, int]:
        """(time of the oldest entry kept in µs, entries evicted) of one runner."""
        log = self._logs.get(runner_id)
        if log is None:
            return None, 0
        return (log.times[0] if log.times else None), log.evicted

    def select(
        self,
        runners: Mapping[str, tuple[str, int]],
        *,
        since: int | None = None,
        until: int | None = None,
        limit: int,
    ) -> Selection:
        """The newest `limit` entries of `runners` within `[since, until]` (µs), in order of
        time and then of each runner's (node, rank) in `runners`; not decoded yet: the
        selection holds its batches' JSON, so it stays readable after the store evicts them.

        The cut-off time is found by bisection over the runners' sorted times, and only
        entries at or after it are gathered and sorted (sorted runs: a merge at C speed).
        """
        spans = []
        for runner_id, order in runners.items():
            log = self._logs.get(runner_id)
            if log is None:
                continue
            low = 0 if since is None else bisect.bisect_left(log.times, since)
            high = len(log.times) if until is None else bisect.bisect_right(log.times, until)
            if low < high:
                spans.append((log, runner_id, order, max(low, high - limit), high))
        if not spans:
            return Selection([], {})

        def newer(moment: int) -> int:
            return sum(high - bisect.bisect_left(log.times, moment, low, high)
                       for log, _, _, low, high in spans)  # fmt: skip

        earliest = min(log.times[low] for log, _, _, low, _ in spans)
        cut = earliest
        if newer(earliest) > limit:  # the oldest moment at which at most `limit` are newer
            older, cut = earliest, max(log.times[high - 1] for log, _, _, _, high in spans) + 1
            while cut - older > 1:
                middle = (older + cut) // 2
                older, cut = (middle, cut) if newer(middle) > limit else (older, middle)
            cut -= 1  # with the entries at the moment just before: ties are cut below
        rows: list[Row] = []
        for log, runner_id, (node, rank), low, high in spans:
            first = bisect.bisect_left(log.times, cut, low, high)
            rows.extend(
                zip(
                    log.times[first:high],
                    itertools.repeat(node),
                    itertools.repeat(rank),
                    itertools.repeat(runner_id),
                    log.batches[first:high],
                    log.positions[first:high],
                    strict=False,  # the repeats are endless
                )
            )
        rows.sort()
        del rows[:-limit]
        payloads = self._payloads
        return Selection(rows, {batch: payloads[batch] for batch in {row[4] for row in rows}})

    def newest(
        self,
        runner_ids: Iterable[str],
        *,
        since: int | None = None,
        until: int | None = None,
        limit: int,
    ) -> list[tuple[int, str, FlightEntry]]:
        """`select`'s entries decoded, as (time, runner id, entry); ties by runner id."""
        order = {runner_id: (runner_id, 0) for runner_id in runner_ids}
        selection = self.select(order, since=since, until=until, limit=limit)
        entries = selection.read(0, len(selection.rows))
        return [(row[0], row[3], entry) for row, entry in zip(selection.rows, entries, strict=True)]


Row = tuple[int, str, int, str, int, int]
"""One chosen entry: (µs, node, rank, runner id, batch, position in the batch)."""


class Selection:
    """Entries picked for an answer, in order, with the JSON of the batches they are in."""

    def __init__(self, rows: list[Row], payloads: dict[int, bytes]) -> None:
        self.rows = rows
        self._payloads = payloads
        self._decoded: dict[int, PhaseEntries] = {}

    def read(self, start: int, stop: int) -> list[FlightEntry]:
        """Entries `[start, stop)`, decoded (each batch once, however often it is read)."""
        found = []
        decoded, payloads = self._decoded, self._payloads
        for row in self.rows[start:stop]:
            batch = decoded.get(row[4])
            if batch is None:
                batch = decoded[row[4]] = decode(payloads[row[4]], PhaseEntries)
            found.append(batch.entries[row[5]])
        return found
