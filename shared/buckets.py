"""A KV bucket followed as its entries: the latest of every key, then every change, never
one lost (a stream follower underneath), with the server's own markers read as deletes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
from nats.js.kv import KV_DEL, KV_MARKER_REASON, KV_OP, KV_PURGE, KeyValue

from rankscope.shared.replay import Follower, follow, stored_ns
from rankscope.shared.subjects import kv_key

__all__ = ["follow_bucket"]

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
    prefix = kv_key(bucket, "")

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
                created=stored_ns(msg.reply),  # ns since the epoch
                operation=operation,
            )
        )

    return await follow(js, f"{prefix}>", on_msg, deliver_policy=DeliverPolicy.LAST_PER_SUBJECT)
