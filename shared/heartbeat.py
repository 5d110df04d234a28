"""Keep one node's entry alive in the `rankscope_nodes` bucket.

The bucket's TTL removes the entry when the beats stop; a clean stop deletes it at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from nats.errors import Error as NatsError
from nats.js.kv import KeyValue

from shared.subjects import token
from shared.wire import NodeInfo, encode

__all__ = ["Heartbeat"]

log = logging.getLogger(__name__)


class Heartbeat:
    """Writes `describe()` under the node's key every `interval` seconds.

    Args:
        kv: the nodes bucket.
        describe: returns the node's current entry (memory is read fresh each beat).
        interval: seconds between beats; a third of the bucket's TTL survives two losses.
    """

    def __init__(self, *, kv: KeyValue, describe: Callable[[], NodeInfo], interval: float) -> None:
        self._kv = kv
        self._describe = describe
        self._interval = interval

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
        with contextlib.suppress(NatsError, OSError, asyncio.TimeoutError):
            await self._kv.delete(token(node_id))
