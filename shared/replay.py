"""Follow a stream without ever losing a message, and know when the
backlog is applied.

This is how views are rebuilt: replay from the start (or the last message per subject),
report caught up once everything the stream held at the start is handled, and keep
following live messages after that.

A follower pulls: it asks the server for `batch` messages at a time and asks for more only
when those are handled, so a slow handler slows the server down instead of filling the
client's queue (a push consumer's flow control is answered when a message is read off the
socket, not when it is handled, and the client then drops what its queue cannot hold). It
checks every delivery's consumer sequence and, on a gap, a stalled pull or a lost
consumer, starts a new consumer just after the last handled stream sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import cast

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

__all__ = ["Follower", "follow", "stored_ns"]

log = logging.getLogger(__name__)

BATCH = 512
"""Messages asked for in one pull: enough to hide the round trip, few enough to hold."""

YIELD_AFTER_S = 0.002
"""How long messages are handled back to back before other tasks (queries) get a turn:
long enough that a runner's messages in a row are settled together (see `Follower`),
short beside a query's answer."""

HEARTBEAT_S = 2.0
"""The server's idle heartbeat while a pull waits for messages."""

STALL_HEARTBEATS = 5
"""Heartbeats missed in a row after which the consumer counts as lost and is replaced."""

PULL_EXPIRES_S = 30.0
"""How long one pull waits on the server for messages before it is renewed."""

_STATUS = "Status"
_HEARTBEAT, _NO_MESSAGES, _EXPIRED = "100", "404", "408"


class _RestartError(Exception):
    """The consumer cannot go on; a new one starts after the last handled message."""


class _RefilteredError(Exception):
    """Subjects were added or removed: a new consumer follows what is left."""


@dataclass(slots=True)
class _Rewind:
    """Subjects added while following, whose messages up to `until` (handled before they
    were followed) are delivered again: `done`, the last sequence gone over for them."""

    added: Callable[[str], bool]
    done: int
    until: int


@dataclass(slots=True)
class _Taken:
    """The reply subject of the delivery a follower took last, and when it was stored:
    what the handler it goes to is about to ask `stored_ns` (read once, not twice)."""

    reply: str = ""
    stored_ns: int | None = None


_taken = _Taken()


def _positions(reply: str) -> tuple[int, int, int]:
    """(stream seq, consumer seq, pending) from a JetStream delivery's reply subject:
    `$JS.ACK[.<domain>.<hash>].<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>[.<token>]`."""
    tokens = reply.split(".")
    base = 4 if len(tokens) == 9 else 6
    at = tokens[base + 3]
    _taken.reply, _taken.stored_ns = reply, int(at) if at.isdigit() else None
    return int(tokens[base + 1]), int(tokens[base + 2]), int(tokens[base + 4])


class Follower:
    """Pulls a stream's messages through `handle`, in stream order, each exactly once;
    `caught_up` is set once what the stream held at the start is handled.

    Args:
        js: JetStream context.
        stream: the stream followed.
        subjects: filter subjects (interleaved in stream order).
        handle: called once per message, in order, plain or async (a plain one costs no
            coroutine a message); it should not raise (an exception is logged and the
            message skipped).
        settle: called before the follower lets other tasks run (and so before
            `caught_up` wakes anyone): what `handle` left to do once for many messages
            must be done by then.
        deliver_policy: where the first consumer starts.
        start_time: with `DeliverPolicy.BY_START_TIME`, the first message's earliest time.
        batch: messages asked for per pull.
        heartbeat: seconds between the server's idle heartbeats.
    """

    def __init__(
        self,
        *,
        js: JetStreamContext,
        stream: str,
        subjects: Sequence[str],
        handle: Callable[[Msg], Awaitable[None] | None],
        settle: Callable[[], None] = lambda: None,
        deliver_policy: DeliverPolicy = DeliverPolicy.ALL,
        start_time: datetime | None = None,
        batch: int = BATCH,
        heartbeat: float = HEARTBEAT_S,
        deletes: bool = True,
    ) -> None:
        self.caught_up = asyncio.Event()
        self._deletes = deletes
        """Whether it removes a consumer it is done with (else the server does, once it
        has been idle a while: for roles that may delete no consumer)."""
        self.handled = 0
        """Messages handled so far."""
        self.restarts = 0
        """Consumers replaced after a gap, a stall or a lost consumer."""
        self.last_seq = 0
        """Stream sequence of the last handled message."""
        self._js = js
        self._nc = js._nc
        self._stream = stream
        self._subjects = list(subjects)
        self._handle = handle
        self._settle = settle
        self._deliver_policy = deliver_policy
        self._start_time = start_time
        self._batch = batch
        self._heartbeat = heartbeat
        self._target = 0
        self._delivered = 0
        self._requested = 0
        self._consumer = ""
        self._inbox = ""
        self._subscription: Subscription | None = None
        self._arrived: asyncio.Queue[Msg | None] | None = None
        """The subscription's own queue of deliveries (None: a nudge)."""
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._refiltered = False
        self._rewinds: list[_Rewind] = []
        self._turn = 0.0
        """When other tasks last had a turn (`time.perf_counter`)."""

    async def start(self) -> None:
        """Create the first consumer (errors reach the caller) and start pulling."""
        await self._open()
        self._task = asyncio.create_task(self._run(), name=f"follow {self._stream}")

    async def widen(self, subjects: Sequence[str], added: Callable[[str], bool]) -> None:
        """Follow `subjects` too, from their first stored message on: what of theirs lies
        before the last handled message is handled next, in stream order, then what comes
        after it; `added(subject)` tells their messages from the others'.

        Raises:
            NatsError, TimeoutError: the stream could not say where they start.
        """
        fresh = [s for s in subjects if s not in self._subjects]
        if not fresh:
            return
        starts = []
        for subject in fresh:
            with contextlib.suppress(NotFoundError):
                found = await self._js.get_msg(self._stream, seq=1, subject=subject, next=True)
                starts.append(found.seq or 0)
        self._subjects += fresh
        first = min(starts, default=0)
        if first and first <= self.last_seq:
            self._rewinds.append(_Rewind(added=added, done=first - 1, until=self.last_seq))
        self._refiltered = True
        self._nudge()

    def narrow(self, subjects: Sequence[str]) -> None:
        """Stop following `subjects` from the next message on.

        Raises:
            ValueError: none would be left.
        """
        kept = [s for s in self._subjects if s not in subjects]
        if not kept:
            raise ValueError("a follower needs a subject left: without one it gets everything")
        if kept != self._subjects:
            self._subjects = kept
            self._refiltered = True
            self._nudge()

    async def stop(self) -> None:
        """Stop following and remove the consumer."""
        self._stopping = True
        task, self._task = self._task, None
        while task is not None and not task.done():
            task.cancel()  # again, should a library have swallowed the first cancellation
            await asyncio.wait({task}, timeout=1.0)
        await self._close()

    async def _open(self) -> None:
        """A new consumer starting after the last handled message, and its inbox."""
        policy, start = self._deliver_policy, None
        if self.last_seq:
            start = min((r.done + 1 for r in self._rewinds), default=self.last_seq + 1)
            policy = DeliverPolicy.BY_START_SEQUENCE
        inbox = self._nc.new_inbox()
        # the client holds what the pulls asked for (at most 2.5 batches when an expired
        # pull did not say what it owed) and a few statuses, never more; no callback:
        # deliveries are taken off the subscription's queue as they are handled, not
        # handed on by a task and a coroutine each
        self._subscription = await self._nc.subscribe(
            inbox, pending_msgs_limit=3 * self._batch + 64, pending_bytes_limit=0
        )
        self._arrived = cast("asyncio.Queue[Msg | None]", self._subscription._pending_queue)
        config = ConsumerConfig(
            name=self._nc._nuid.next().decode(),
            deliver_policy=policy,
            opt_start_seq=start,
            opt_start_time=self._start_time if policy is DeliverPolicy.BY_START_TIME else None,
            ack_policy=AckPolicy.NONE,
            mem_storage=True,
            num_replicas=1,
            inactive_threshold=max(60.0, PULL_EXPIRES_S * 2),
            filter_subjects=self._subjects if len(self._subjects) > 1 else None,
            filter_subject=self._subjects[0] if len(self._subjects) == 1 else None,
        )
        info = await self._js.add_consumer(self._stream, config)
        self._consumer = info.name or ""
        self._inbox = inbox
        self._delivered = 0
        self._requested = 0
        self._target = info.num_pending or 0
        if not self._target:
            self.caught_up.set()

    async def _close(self) -> None:
        if self._subscription is not None:
            with contextlib.suppress(NatsError, TimeoutError):
                await self._subscription.unsubscribe()
            self._subscription = None
        if self._consumer and self._deletes:
            with contextlib.suppress(NatsError, TimeoutError):
                await self._js.delete_consumer(self._stream, self._consumer)
        self._consumer = ""

    def _nudge(self) -> None:
        """Wake the consumer should it wait for deliveries (its subjects changed)."""
        if self._arrived is not None:
            with contextlib.suppress(asyncio.QueueFull):  # full: it is not waiting
                self._arrived.put_nowait(None)

    async def _pull(self) -> None:
        """Ask for another batch; the server ends a pull after `batch` messages, or with a
        status saying how many it still owed when it expires."""
        request = {
            "batch": self._batch,
            "expires": int(PULL_EXPIRES_S * 1e9),
            "idle_heartbeat": int(self._heartbeat * 1e9),
        }
        self._requested += self._batch
        await self._nc.publish(
            f"$JS.API.CONSUMER.MSG.NEXT.{self._stream}.{self._consumer}",
            json.dumps(request).encode(),
            reply=self._inbox,
        )

    async def _run(self) -> None:
        while not self._stopping:
            try:
                if self._subscription is None:
                    await self._open()
                await self._consume()
            except _RefilteredError:
                self._refiltered = False
                await self._close()
                continue
            except _RestartError as why:
                log.warning(
                    "following %s: %s; resuming after seq %d", self._stream, why, self.last_seq
                )
            except (NatsError, TimeoutError) as exc:
                log.warning("following %s: %s; retrying", self._stream, exc or type(exc).__name__)
                await asyncio.sleep(self._heartbeat / 2)
            self.restarts += 1
            await self._close()

    async def _consume(self) -> None:
        """Keep between half a batch and a batch and a half asked for, so the next batch is
        on its way while this one is handled."""
        self._requested = 0
        arrived = self._arrived
        assert arrived is not None, "a consumer follows after `_open`"
        queued: deque[Msg | None] = arrived._queue  # type: ignore[attr-defined]
        try:
            await self._pull()
            while True:
                if self._refiltered:
                    raise _RefilteredError
                if not queued:
                    self._settled()
                    try:
                        # not `wait_for`: on Python 3.11 it can swallow a cancellation that
                        # arrives as the wait ends, and `stop` would wait forever
                        async with asyncio.timeout(self._heartbeat * STALL_HEARTBEATS):
                            msg = await arrived.get()
                    except TimeoutError:
                        raise _RestartError("no heartbeat from the server") from None
                else:  # what `get_nowait` does, less its calls: no one waits to put
                    msg = queued.popleft()
                if msg is None:
                    continue
                status = msg.headers.get(_STATUS) if msg.headers else None
                if status is None:
                    if (left := self._take(msg)) is not None:
                        await left
                    self._requested -= 1
                    if time.perf_counter() - self._turn >= YIELD_AFTER_S:
                        self._settled()
                        await asyncio.sleep(0)
                        self._turn = time.perf_counter()
                elif status in (_EXPIRED, _NO_MESSAGES):
                    owed = (msg.headers or {}).get("Nats-Pending-Messages")
                    self._requested = max(self._requested - int(owed), 0) if owed else 0
                elif status != _HEARTBEAT:
                    description = msg.headers.get("Description", "") if msg.headers else ""
                    raise _RestartError(f"pull answered {status} {description}".strip())
                if self._requested <= self._batch // 2:
                    self._settled()
                    await self._pull()
        finally:
            self._settled()

    def _settled(self) -> None:
        """`settle`, before other tasks run."""
        try:
            self._settle()
        except Exception:
            log.exception("settling %s after seq %d failed", self._stream, self.last_seq)

    def _take(self, msg: Msg) -> Awaitable[None] | None:
        """Handle one delivery, or restart on a gap in the consumer's sequence; what is
        left to await of an async `handle` (a plain one leaves nothing: no coroutine a
        message)."""
        stream_seq, consumer_seq, pending = _positions(msg.reply)
        if consumer_seq != self._delivered + 1:
            raise _RestartError(f"delivery {consumer_seq} after {self._delivered}")
        self._delivered = consumer_seq
        if stream_seq <= self.last_seq:
            return self._again(msg, stream_seq)
        self._rewinds.clear()
        handling = self._call(msg, stream_seq)
        if handling is not None:
            return self._then(handling, msg, stream_seq, consumer_seq, pending)
        self._handled(stream_seq, consumer_seq, pending)
        return None

    async def _then(
        self, handling: Awaitable[None], msg: Msg, stream_seq: int, consumer_seq: int, pending: int
    ) -> None:
        await self._finish(handling, msg, stream_seq)
        self._handled(stream_seq, consumer_seq, pending)

    def _handled(self, stream_seq: int, consumer_seq: int, pending: int) -> None:
        self.last_seq = stream_seq
        self.handled += 1
        if not self.caught_up.is_set() and (consumer_seq >= self._target or pending == 0):
            self.caught_up.set()

    async def _again(self, msg: Msg, stream_seq: int) -> None:
        """A message handled before: handled now only if it is of subjects added since
        and not yet gone over for them."""
        due = [r for r in self._rewinds if r.done < stream_seq <= r.until]
        if any(r.added(msg.subject) for r in due):
            handling = self._call(msg, stream_seq)
            if handling is not None:
                await self._finish(handling, msg, stream_seq)
            self.handled += 1
        for rewind in due:
            rewind.done = stream_seq
        self._rewinds = [r for r in self._rewinds if r.done < r.until]

    def _call(self, msg: Msg, stream_seq: int) -> Awaitable[None] | None:
        try:
            return self._handle(msg)
        except Exception:
            _skipped(msg, stream_seq)
            return None

    @staticmethod
    async def _finish(handling: Awaitable[None], msg: Msg, stream_seq: int) -> None:
        try:
            await handling
        except Exception:
            _skipped(msg, stream_seq)


def _skipped(msg: Msg, stream_seq: int) -> None:
    """Log the exception a handler raised for `msg` (it is skipped)."""
    log.exception("handling %s seq %d failed; skipped", msg.subject, stream_seq)


async def follow(
    js: JetStreamContext,
    subject: str,
    handle: Callable[[Msg], Awaitable[None] | None],
    *,
    settle: Callable[[], None] = lambda: None,
    deliver_policy: DeliverPolicy = DeliverPolicy.ALL,
    start_time: datetime | None = None,
    also: Sequence[str] = (),
    after: int = 0,
    batch: int = BATCH,
    heartbeat: float = HEARTBEAT_S,
    deletes: bool = True,
) -> Follower:
    """Follow `subject` (and the subjects `also`, of the same stream, interleaved in stream
    order), calling `handle` for each message in order (and `settle` before other tasks
    run, see `Follower`); from stream sequence `after` + 1
    when given (what a snapshot already holds is not read again), else from the first
    message stored at or after `start_time` when given.

    `handle` must not raise for bad payloads: it is the place to count and skip them.
    Await `follower.caught_up` before trusting state built from the backlog. Without
    `deletes`, consumers it is done with are left to the server to remove once idle.
    """
    follower = Follower(
        js=js,
        stream=await js.find_stream_name_by_subject(subject),
        subjects=[subject, *also],
        handle=handle,
        settle=settle,
        deliver_policy=DeliverPolicy.BY_START_TIME if start_time else deliver_policy,
        start_time=start_time,
        batch=batch,
        heartbeat=heartbeat,
        deletes=deletes,
    )
    follower.last_seq = after
    await follower.start()
    return follower


def stored_ns(reply: str | None) -> int | None:
    """When JetStream stored a message (ns since the epoch), read off the ack subject it
    was delivered with (`$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<time>.…`,
    with a domain and account hash before the stream in the newer form); None for a
    message that did not come from a consumer."""
    if reply is _taken.reply:  # the delivery a follower just took: read as it took it
        return _taken.stored_ns
    if not reply or not reply.startswith("$JS.ACK."):
        return None
    back = _TIME_FROM_END.get(reply.count("."))
    if back is None:
        return None
    at = reply.rsplit(".", back)[1]  # split off no more than the tail that holds it
    return int(at) if at.isdigit() else None


_TIME_FROM_END = {8: 2, 10: 2, 11: 3}
"""Where the time is in an ack subject of so many dots, as the dots after it plus one."""
