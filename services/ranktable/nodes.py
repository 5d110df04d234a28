"""The live nodes as the rank-table service sees them: heartbeats from the nodes bucket,
each node given up once the bucket no longer holds its heartbeat past the TTL, and never
while silence proves nothing (NATS out, or every node quiet at once)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection

from nats.errors import Error as NatsError
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from rankscope.services.ranktable.placement import NodeView
from rankscope.shared.deadletter import DeadLetters
from rankscope.shared.heartbeat import heard
from rankscope.shared.subjects import token

__all__ = ["LiveNodes"]

log = logging.getLogger(__name__)


class LiveNodes:
    """Nodes by id, as their heartbeats describe them.

    Args:
        bucket: the nodes bucket's name.
        ttl: seconds a heartbeat holds.
        dead_letters: where undecodable heartbeats go.
        changed: called when a node is given up.
        connected: whether NATS is reachable.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        *,
        bucket: str,
        ttl: float,
        dead_letters: DeadLetters,
        changed: Callable[[], None],
        connected: Callable[[], bool],
        clock: Callable[[], float],
    ) -> None:
        self._bucket = bucket
        self._ttl = ttl
        self._dead_letters = dead_letters
        self._changed = changed
        self._connected = connected
        self._clock = clock
        self.views: dict[str, NodeView] = {}
        self._deadlines: dict[str, float] = {}

    def on_node(self, entry: KeyValue.Entry) -> None:
        """Take in a node's heartbeat (or its entry's deletion)."""
        if (node := heard(entry, self._bucket, self._dead_letters)) is None:
            return
        node_id, info = node
        if info is None:
            self._forget(node_id, "left")
            return
        self.views[node_id] = NodeView.of(info)
        self._deadlines[node_id] = self._clock() + self._ttl

    def _forget(self, node_id: str, how: str) -> None:
        if self.views.pop(node_id, None) is not None:
            log.warning("node %s", how, extra={"nodeId": node_id})
        self._deadlines.pop(node_id, None)

    async def _still_there(self, kv: KeyValue, node_id: str, recheck: float) -> bool:
        """Whether the server still holds the node's heartbeat. The bucket's TTL is the
        authority: a watcher can lag (just after NATS came back, its consumer is rebuilt)."""
        try:
            entry = await kv.get(token(node_id))
        except KeyNotFoundError:
            return False
        except (NatsError, TimeoutError):
            return True  # cannot tell now; ask again at the next round
        self.on_node(entry)
        self._deadlines[node_id] = self._clock() + recheck
        return True

    def _bus_silent(self, overdue: list[str]) -> str | None:
        """Why silence proves nothing about the nodes now, if it does not: NATS does not
        answer, or every node (of two or more) went quiet at once, as when the server is
        paused or the nodes' side of NATS is cut off."""
        if not self._connected():
            return "NATS unreachable"
        if len(self._deadlines) > 1 and len(overdue) == len(self._deadlines):
            return f"no heartbeat from any of {len(overdue)} nodes"
        return None

    async def expire_forever(self, kv: KeyValue, stop: asyncio.Event) -> None:
        """Give up the nodes whose heartbeat the bucket no longer holds, a quarter TTL
        at a time."""
        period, ttl, outage = self._ttl / 4, self._ttl, False
        while not stop.is_set():
            moment = self._clock()
            overdue = [n for n, deadline in self._deadlines.items() if deadline <= moment]
            silent = self._bus_silent(overdue)
            if silent is not None:
                if not outage:
                    log.warning("%s: an outage, not lost nodes; nothing is re-placed", silent)
                outage = True
            elif outage:
                outage = False
                log.info("heartbeats are back: every node has %gs to be heard again", ttl)
                self._deadlines = {node_id: moment + ttl for node_id in self._deadlines}
            else:
                for node_id in overdue:
                    if not await self._still_there(kv, node_id, period):
                        self._forget(node_id, "lost: no heartbeat within the TTL")
                        self._changed()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), period)

    async def back(self, placed: Callable[[], Collection[str]], stop: asyncio.Event) -> None:
        """After a restart, give the nodes of live instances (`placed`) one TTL to be
        heard before deciding anything: agents restarted along with this service have not
        sent their first heartbeat yet, and their instances are theirs to keep."""
        deadline = self._clock() + self._ttl
        while not stop.is_set() and self._clock() < deadline:
            if set(placed()) <= set(self.views):
                return
            await asyncio.sleep(0.1)
        if missing := sorted(set(placed()) - set(self.views)):
            log.warning("not heard within the TTL since start: %s", ", ".join(missing))
