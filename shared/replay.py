"""Follow a stream (or a KV bucket) with an ordered consumer and know when the backlog
is applied.

This is how views are rebuilt: replay from the start (or the last message per subject),
report caught up when nothing is pending, and keep following live messages after that.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.kv import KV_DEL, KV_MARKER_REASON, KV_OP, KV_PURGE, KeyValue

__all__ = ["Follower", "follow", "follow_bucket"]


YIELD_EVERY = 64
"""Messages handled back to back before other tasks (queries) get a turn: a subscription
drains its whole pending queue without suspending otherwise."""


class Follower:
    """A live ordered consumer; `caught_up` is set once the backlog has been handled."""

    def __init__(self, handle: Callable[[Msg], Awaitable[None]]) -> None:
        self.caught_up = asyncio.Event()
        self._handle = handle
        self._subscription: JetStreamContext.PushSubscription | None = None
        self._handled = 0

    async def _on_msg(self, msg: Msg) -> None:
        await self._handle(msg)
        # parsing the metadata costs more than most handlers: only until caught up
        if not self.caught_up.is_set() and msg.metadata.num_pending == 0:
            self.caught_up.set()
        self._handled += 1
        if self._handled % YIELD_EVERY == 0:
            await asyncio.sleep(0)

    async def stop(self) -> None:
        """Stop following."""
        if self._subscription is not None:
            await self._subscription.unsubscribe()
            self._subscription = None


async def follow(
    js: JetStreamContext,
    subject: str,
    handle: Callable[[Msg], Awaitable[None]],
    *,
    deliver_policy: DeliverPolicy = DeliverPolicy.ALL,
    also: Sequence[str] = (),
) -> Follower:
    """Start an ordered consumer on `subject` (and the subjects `also`, of the same
    stream, interleaved in stream order) calling `handle` for each message in order.

    `handle` must not raise for bad payloads: it is the place to count and skip them.
    Await `follower.caught_up` before trusting state built from the backlog.
    """
    follower = Follower(handle)
    follower._subscription = await js.subscribe(
        subject,
        cb=follower._on_msg,
        ordered_consumer=True,
        deliver_policy=deliver_policy,
        config=ConsumerConfig(filter_subjects=[subject, *also]) if also else None,
    )
    info = await follower._subscription.consumer_info()
    if info.num_pending == 0 and not (info.delivered and info.delivered.stream_seq):
        follower.caught_up.set()
    return follower


_MARKERS = {"MaxAge": KV_PURGE, "Purge": KV_PURGE, "Remove": KV_DEL}
"""What the server's own markers (a key's TTL ran out, ...) mean as a KV operation."""


async def follow_bucket(
    js: JetStreamContext, bucket: str, handle: Callable[[KeyValue.Entry], Awaitable[None]]
) -> Follower:
    """Follow every key of KV `bucket`: its latest entry per key, then every change, with
    `caught_up` set once the latest entries are handled.

    nats-py's own watcher is not used: it signals the end of the initial entries by
    comparing the server's pending count with what the client has read off the socket, so
    it can signal it before an entry the server has already sent arrives, and a service
    would start from an empty bucket (a restarted rank-table service released instances
    whose spec had not arrived yet).
    """
    prefix = f"$KV.{bucket}."

    async def on_msg(msg: Msg) -> None:
        headers = msg.headers or {}
        reason = headers.get(KV_MARKER_REASON)
        if reason is not None and reason not in _MARKERS:
            return  # a marker of a kind this version does not know: no entry
        operation = headers.get(KV_OP) or (_MARKERS[reason] if reason else None)
        await handle(
            KeyValue.Entry(
                bucket=bucket,
                key=msg.subject[len(prefix) :],
                value=msg.data,
                revision=msg.metadata.sequence.stream,
                delta=None,
                created=None,
                operation=operation,
            )
        )

    return await follow(js, f"{prefix}>", on_msg, deliver_policy=DeliverPolicy.LAST_PER_SUBJECT)
