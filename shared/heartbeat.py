"""Keep one node's entry alive in the `rankscope_nodes` bucket, and read the entries.

The bucket's TTL removes the entry when the beats stop; a clean stop deletes it at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from nats.errors import Error as NatsError
from nats.js.kv import KeyValue

from rankscope.shared.deadletter import DeadLetters
from rankscope.shared.subjects import kv_key, token, untoken
from rankscope.shared.wire import NodeInfo, WireError, decode, encode

__all__ = ["Heartbeat", "heard"]

log = logging.getLogger(__name__)


def heard(
    entry: KeyValue.Entry, bucket: str, dead_letters: DeadLetters
) -> tuple[str, NodeInfo | None] | None:
    """The node an entry of the nodes `bucket` is of, with its heartbeat (None: the entry
    was deleted or expired); None for a heartbeat that does not decode, dead-lettered."""
    node_id = untoken(entry.key)
    if entry.operation is not None:
        return node_id, None
    try:
        return node_id, decode(entry.value or b"", NodeInfo)
    except WireError as exc:
        dead_letters.reject(kv_key(bucket, entry.key), entry.value, "node_undecodable", exc)
        return None


class Heartbeat:
    """Writes `describe()` under the node's key every `interval` seconds.

    Args:
        kv: the nodes bucket.
        describe: returns the node's current entry (memory is read fresh each beat).
        interval: seconds between beats; a third of the bucket's TTL survives two losses.
        connected: whether NATS is there to take the entry's deletion on a clean stop (a
            deletion waits for JetStream's answer; with NATS gone the TTL removes it).
    """

    def __init__(
        self,
        *,
        kv: KeyValue,
        describe: Callable[[], NodeInfo],
        interval: float,
        connected: Callable[[], bool] = lambda: True,
    ) -> None:
        self._kv = kv
        self._describe = describe
        self._interval = interval
        self._connected = connected

    async def beat(self) -> NodeInfo:
        """Write the entry once and return it."""
        node = self._describe()
        await self._kv.put(token(node.nodeId), encode(node))
        return node

    async def run(self, stop: asyncio.Event) -> None:
        """Beat until `stop` is set, then delete the entry. A failed beat (NATS down) is
        logged and retried at the next interval."""
        node_id = self._describe().nodeId
        while not stop.is_set():
            try:
                await self.beat()
            except (TimeoutError, NatsError, OSError) as exc:
                log.warning("heartbeat not written: %s", exc, extra={"nodeId": node_id})
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self._interval)
        if not self._connected():
            log.info("NATS out: the entry expires with its TTL", extra={"nodeId": node_id})
            return
        with contextlib.suppress(NatsError, OSError, asyncio.TimeoutError):
            await self._kv.delete(token(node_id))
