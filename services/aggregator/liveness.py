"""Which nodes are alive, the I/O of it: heartbeats read from the nodes bucket and rounds of
live diagnostics requests asked on NATS, fed with the time to the core (`core.Core`, its
`silence.Silence`), whose verdicts go to the views. A node silent in both is unreachable,
well before the rank-table service gives it up at the heartbeat TTL."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from nats.aio.client import NO_RESPONDERS_STATUS as NO_RESPONDERS
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js.api import Header
from nats.js.kv import KeyValue

from rankscope.services.aggregator.core import (
    Answered,
    ClockDrift,
    Core,
    Effect,
    Heartbeat,
    OutageOver,
    Probe,
    Wake,
)
from rankscope.services.aggregator.silence import NO_AGENT, Answer, Ask, ClockNote
from rankscope.shared.connection import Reachability
from rankscope.shared.deadletter import DeadLetters
from rankscope.shared.heartbeat import heard
from rankscope.shared.jetstream import Layout
from rankscope.shared.storage import Storage
from rankscope.shared.wire import NodeDiagnostics, WireError, decode

__all__ = ["Liveness"]

log = logging.getLogger(__name__)

PROBE_SLICE = 500
"""Nodes asked between two turns of the queries (a few ms of work)."""


class Liveness:
    """Heartbeats read and probe rounds asked, fed to the core (`core.Core`), whose
    verdicts go to `state.unreachable`.

    Args:
        nc: NATS connection.
        layout: subjects.
        core: the judging core (its views, its liveness machine).
        reach: whether NATS answers (a round counts only while it does).
        storage: whether JetStream stores.
        dead_letters: where undecodable heartbeats go.
        probe_timeout: deadline of one round.
        clock: monotonic seconds.
        wall: seconds since the epoch.
    """

    def __init__(
        self,
        *,
        nc: Client,
        layout: Layout,
        core: Core,
        reach: Reachability,
        storage: Storage,
        dead_letters: DeadLetters,
        probe_timeout: float,
        clock: Callable[[], float],
        wall: Callable[[], float],
    ) -> None:
        self._nc = nc
        self._layout = layout
        self._core = core
        self._reach = reach
        self._storage = storage
        self._dead_letters = dead_letters
        self._probe_timeout = probe_timeout
        self._clock, self._wall = clock, wall

    @property
    def heartbeats(self) -> dict[str, float]:
        """When this aggregator read each node's last heartbeat, by its clock."""
        return self._core.silence.heartbeats

    @property
    def clock_offsets(self) -> dict[str, float]:
        """Seconds each node's clock is ahead of the NATS server's (negative: behind)."""
        return self._core.silence.clock_offsets

    async def on_node(self, entry: KeyValue.Entry) -> None:
        """Take in a node's heartbeat (or its entry's expiry)."""
        if (node := heard(entry, self._layout.nodes_bucket.bucket, self._dead_letters)) is None:
            return
        node_id, info = node
        self._carry_out(self._core.feed(Heartbeat(node_id, info, entry.created, self._clock())))

    async def probe_forever(self, stop: asyncio.Event) -> None:
        """Ask what the core says is due, when it says it is."""
        while not stop.is_set():
            for effect in self._core.feed(Wake(self._clock())):
                if isinstance(effect, Probe):
                    await self.probe(effect.ask)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, self._core.wake - self._clock()))

    async def probe(self, ask: Ask | None = None) -> None:
        """Ask the nodes of `ask` (a full round now when None) at once, under one deadline,
        and feed the core who answered.

        Only while NATS answers, before and after the round: when the bus itself is out,
        silence says nothing of the nodes, and once it is back every rank starts afresh.
        """
        if ask is None:
            (effect,) = self._core.feed(Wake(self._clock(), full=True))
            assert isinstance(effect, Probe)
            ask = effect.ask
        was_out = not (self._reach.reachable and self._storage.storing)
        if await self._reach.check() and not await self._storage.check():
            await self._reach.check()  # answered now: JetStream is out, not NATS (`bus_outage`)
        if not self._reach.reachable:
            self._storage.forget()  # what JetStream did while NATS was out says nothing of it
            return
        if not self._storage.storing:
            return
        if was_out:
            self._core.feed(OutageOver(self._clock()))
        asked_ns = round(self._wall() * 1e9)
        answers = await self._ask_nodes(ask.nodes)
        if any(not isinstance(a, set) for a in answers) and not await self._reach.check():
            return
        self._core.feed(Answered(ask, answers, self._clock(), asked_ns))

    def _carry_out(self, effects: list[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, ClockDrift):
                _say(effect.note)

    async def _ask_nodes(self, targets: list[str]) -> list[Answer]:
        """Ask every node of `targets` at once, on one inbox, under one deadline: the
        runners each agent supervises; why a node is silent when NATS says so at once (no
        agent listens there); or None for a node that gave no usable answer in time. One
        subscription and one timer for the round, however many nodes."""
        inbox, everyone = self._nc.new_inbox(), asyncio.Event()
        replies: dict[int, Answer] = {}

        async def on_reply(msg: Msg) -> None:  # read as they come, not all in one block
            with contextlib.suppress(ValueError):
                index = int(msg.subject.rpartition(".")[2])
                if 0 <= index < len(targets) and index not in replies:
                    replies[index] = (
                        NO_AGENT
                        if (msg.headers or {}).get(Header.STATUS) == NO_RESPONDERS
                        else self._listed(targets[index], msg.data)
                    )
            if len(replies) == len(targets):
                everyone.set()

        subscription = await self._nc.subscribe(f"{inbox}.*", cb=on_reply)
        try:
            for index, node_id in enumerate(targets):
                subject = self._layout.subjects.node_diagnostics(node_id)
                await self._nc.publish(subject, reply=f"{inbox}.{index}")
                if index % PROBE_SLICE == PROBE_SLICE - 1:
                    await asyncio.sleep(0)  # queries and ingest go on between slices
            # a ping answered: the server has them all, and the deadline starts
            if await self._reach.check():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(everyone.wait(), self._probe_timeout)
            if not everyone.is_set() and await self._reach.check():
                # answers the server sent in time are read, not blamed on a busy aggregator
                while subscription.pending_msgs:  # noqa: ASYNC110 - nats-py's queue, no event
                    await asyncio.sleep(0)
        except NatsError:
            pass  # the bus is out: every node unanswered, as the round then says
        finally:
            with contextlib.suppress(NatsError):
                await subscription.unsubscribe()
        return [replies.get(i) for i in range(len(targets))]

    def _listed(self, node_id: str, reply: bytes) -> set[str] | None:
        """The runners a node's answer lists as its own, or None when it is no answer."""
        try:
            answer = decode(reply, NodeDiagnostics)
        except WireError:
            return None
        listed = set()
        for runner in answer.runners:
            if runner.nodeId == node_id:  # a node speaks only for its own runners
                self._core.state.note_acknowledged(runner.runnerId, runner.acknowledgedSeq)
                listed.add(runner.runnerId)
        return listed


def _say(note: ClockNote) -> None:
    """Log a node's clock crossing the tolerance, either way."""
    if note.agrees:
        log.info("the clock of node %s agrees with NATS again", note.node_id)
    else:
        log.warning(
            "the clock of node %s is %.1fs %s of the NATS server's",
            note.node_id, abs(note.offset), "ahead" if note.offset > 0 else "behind",
            extra={"nodeId": note.node_id},
        )  # fmt: skip
