"""Ship runner telemetry to JetStream: batched, asynchronous, bounded, and retried as is.

Entries of one runner are batched (flush at `max_batch` entries or `flush_after` seconds,
whichever first). A batch is encoded once, with `Nats-Msg-Id: <runnerId>:<first>-<last>`,
and resent unchanged until JetStream acknowledges it, so a retry is deduplicated. While
NATS is away nothing is sent (the client's own outbound buffer would only fill with
copies) and everything waits in a bounded buffer; past the bound the oldest is dropped and
counted, and the aggregator sees the gap in `seq`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from nats.aio.client import Client
from nats.errors import Error as NatsError

from rankscope.shared.acks import AckInbox
from rankscope.shared.wire import FlightEntry, PhaseEntries, RunnerRef, encode

__all__ = ["TelemetryPublisher"]

log = logging.getLogger(__name__)

_IDLE_POLL_S = 0.5
"""Seconds between looks at the queue when nothing wakes the publisher."""
_AWAY_POLL_S = 0.1
"""Seconds between looks at the connection while NATS is away."""


@dataclass(slots=True)
class _Outgoing:
    subject: str
    payload: bytes
    msg_id: str
    entries: int
    runner_id: str | None = None
    """The runner whose telemetry this is (None for other messages), and"""
    last_seq: int = -1
    """the newest of its seqs it carries."""


@dataclass(slots=True)
class _OpenBatch:
    runner: RunnerRef
    subject: str
    opened: float
    entries: list[FlightEntry] = field(default_factory=list)


class TelemetryPublisher:
    """One per agent, shared by its runners.

    Args:
        nc: the connection.
        max_batch: entries per batch at most.
        flush_after: seconds an open batch may wait for more entries.
        max_buffered: entries kept while unacknowledged; beyond, the oldest are dropped.
        max_in_flight: publishes awaiting their ack at once.
        ack_timeout: seconds to wait for an ack before sending the same message again.
    """

    def __init__(
        self,
        *,
        nc: Client,
        max_batch: int = 64,
        flush_after: float = 0.05,
        max_buffered: int = 100_000,
        max_in_flight: int = 256,
        ack_timeout: float = 2.0,
    ) -> None:
        self._nc = nc
        self._acks = AckInbox(nc, patience=ack_timeout)
        self._max_batch = max_batch
        self._flush_after = flush_after
        self._max_buffered = max_buffered
        self._open: dict[str, _OpenBatch] = {}
        self._queue: deque[_Outgoing] = deque()
        self._buffered = 0
        self._max_in_flight = max_in_flight
        self._in_flight = 0
        self._wake = asyncio.Event()
        self._settled = asyncio.Event()
        self.published_entries = 0
        self.dropped_entries = 0
        self.retries = 0
        self.acknowledged: dict[str, int] = {}
        """The newest seq JetStream acknowledged, by runner id."""

    def entry(self, runner: RunnerRef, subject: str, entry: FlightEntry) -> None:
        """Add one entry to its runner's open batch."""
        batch = self._open.get(runner.runnerId)
        if batch is None:
            batch = self._open[runner.runnerId] = _OpenBatch(runner, subject, time.monotonic())
            self._wake.set()
        batch.entries.append(entry)
        self._buffered += 1
        if len(batch.entries) >= self._max_batch:
            self._close(runner.runnerId)

    def message(self, subject: str, payload: bytes, msg_id: str) -> None:
        """Queue one ready-made message that is not telemetry (a task status)."""
        self._buffered += 1
        self._enqueue(_Outgoing(subject, payload, msg_id, 1))

    def telemetry(self, subject: str, payload: bytes, runner_id: str, seq: int) -> None:
        """Queue one ready-made telemetry message of a runner (a memory sample or status
        change), deduplicated by its seq, behind the runner's open batch: its entries are
        older, and go first."""
        if runner_id in self._open:
            self._close(runner_id)
        self._buffered += 1
        self._enqueue(_Outgoing(subject, payload, f"{runner_id}:{seq}", 1, runner_id, seq))

    def _close(self, runner_id: str) -> None:
        batch = self._open.pop(runner_id)
        first, last = batch.entries[0].seq, batch.entries[-1].seq
        payload = encode(PhaseEntries(runner=batch.runner, entries=batch.entries))
        msg_id = f"{runner_id}:{first}-{last}"
        self._enqueue(
            _Outgoing(batch.subject, payload, msg_id, len(batch.entries), runner_id, last)
        )

    def _enqueue(self, outgoing: _Outgoing) -> None:
        self._queue.append(outgoing)
        while self._buffered > self._max_buffered and self._queue:
            dropped = self._queue.popleft()
            self._buffered -= dropped.entries
            self.dropped_entries += dropped.entries
            log.warning("telemetry buffer full: dropped %s", dropped.msg_id)
        self._wake.set()

    def _flush_aged(self, everything: bool = False) -> float | None:
        """Close batches that waited long enough; returns when the next one is due.

        `_open` keeps opening order (a closed batch leaves, a new one goes last), so only
        the batches due and the first one not yet due are looked at."""
        moment = time.monotonic()
        ready = []
        for runner_id, batch in self._open.items():
            if not everything and batch.opened + self._flush_after > moment:
                break
            ready.append(runner_id)
        for runner_id in ready:
            self._close(runner_id)
        if not self._open:
            return None
        first = next(iter(self._open.values()))
        return max(first.opened + self._flush_after - moment, 0.0)

    async def _send(self, outgoing: _Outgoing) -> None:
        try:
            await self._acks.publish(
                outgoing.subject, outgoing.payload, {"Nats-Msg-Id": outgoing.msg_id}
            )
        except (NatsError, OSError, TimeoutError) as exc:
            self.retries += 1
            log.debug("publish of %s not acknowledged (%s); retrying", outgoing.msg_id, exc)
            self._queue.appendleft(outgoing)
            await asyncio.sleep(0.1)
        else:
            self._buffered -= outgoing.entries
            self.published_entries += outgoing.entries
            runner_id = outgoing.runner_id
            if runner_id is not None and outgoing.last_seq > self.acknowledged.get(runner_id, -1):
                self.acknowledged[runner_id] = outgoing.last_seq
            if not self._buffered:
                self._settled.set()
        finally:
            self._in_flight -= 1
            self._wake.set()

    @property
    def pending(self) -> int:
        """Entries not yet acknowledged (open, queued or in flight)."""
        return self._buffered

    def _pump(self, tasks: set[asyncio.Task[None]]) -> float:
        """Send what the in-flight bound allows (nothing while NATS is away); returns the
        seconds after which to look again at the latest."""
        if not self._nc.is_connected:
            return _AWAY_POLL_S
        while self._queue and self._in_flight < self._max_in_flight:
            self._in_flight += 1
            task = asyncio.create_task(self._send(self._queue.popleft()))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        return _IDLE_POLL_S

    async def _woken(self, within: float) -> None:
        self._wake.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), within)

    async def run(self, stop: asyncio.Event, *, drain_for: float = 5.0) -> None:
        """Publish until `stop` is set; then, for up to `drain_for` seconds, send what is
        left (everything still unsent then is counted as dropped)."""
        tasks: set[asyncio.Task[None]] = set()
        while not stop.is_set():
            due = self._flush_aged()
            again = self._pump(tasks)
            await self._woken(again if due is None else min(due, again))
        self._flush_aged(everything=True)
        deadline = time.monotonic() + drain_for
        while (self._queue or tasks) and time.monotonic() < deadline:
            again = self._pump(tasks)
            await self._woken(min(again, deadline - time.monotonic()))
        for task in tasks:
            task.cancel()
        self.dropped_entries += sum(o.entries for o in self._queue)

    async def settled(self) -> None:
        """Wait until every entry given so far is acknowledged."""
        while self._buffered:
            self._settled.clear()
            await self._settled.wait()
