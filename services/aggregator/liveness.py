"""Which nodes are alive: their heartbeats as the nodes bucket holds them, and rounds of
live diagnostics requests; a node silent in both is unreachable, well before the
rank-table service gives it up at the heartbeat TTL."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping

from nats.aio.client import NO_RESPONDERS_STATUS as NO_RESPONDERS
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js.api import Header
from nats.js.kv import KeyValue

from rankscope.services.aggregator.views import ClusterState
from rankscope.shared.connection import Reachability
from rankscope.shared.deadletter import DeadLetters
from rankscope.shared.heartbeat import heard
from rankscope.shared.jetstream import Layout
from rankscope.shared.partitions import Partition
from rankscope.shared.storage import Storage
from rankscope.shared.timestamps import to_epoch
from rankscope.shared.wire import NodeDiagnostics, UnreachableNode, WireError, decode

__all__ = ["NO_AGENT", "Liveness"]

log = logging.getLogger(__name__)

MISSED_ROUNDS = 2
"""Probe rounds in a row a node must leave unanswered to be called unreachable: one late
answer is a busy node. A node where no agent listens at all (NATS says so at once), or
whose heartbeat is overdue too, is unreachable from the first round."""

OVERDUE_TTL_SHARE = 0.5
"""A node's heartbeat is overdue once it is older than this share of the TTL: agents beat
every third of it, so one beat is missed and the next late. Older by this aggregator's
clock, and by NATS's next to the newest heartbeat read from any node, unless none was
read for as long: an aggregator behind in reading heartbeats sees every node's beat late,
not one."""

NO_AGENT = "no agent answers live diagnostics there (NATS: no responders)"

PROBE_SLICE = 500
"""Nodes asked, or whose answers are taken in, between two turns of the queries (a few ms
of work)."""
CLOCK_TOLERANCE_S = 2.0
"""How far a node's clock may be from the NATS server's before the aggregator says so."""


class Liveness:
    """Heartbeats read and probe rounds asked; the verdicts go to `state.unreachable`.

    Args:
        nc: NATS connection.
        layout: subjects, and the heartbeat TTL.
        state: the views (nodes, runners listed by their agents, unreachable nodes).
        partition: the nodes it probes besides those of its instances.
        placed_elsewhere: the nodes of each instance of another partition (not probed).
        reach: whether NATS answers (a round counts only while it does).
        storage: whether JetStream stores.
        dead_letters: where undecodable heartbeats go.
        culprits: the runners open findings blame (kept suspect after an outage of NATS).
        probe_interval: seconds between rounds.
        probe_timeout: deadline of one round.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        *,
        nc: Client,
        layout: Layout,
        state: ClusterState,
        partition: Partition,
        placed_elsewhere: Mapping[str, set[str]],
        reach: Reachability,
        storage: Storage,
        dead_letters: DeadLetters,
        culprits: Callable[[], set[str]],
        probe_interval: float,
        probe_timeout: float,
        clock: Callable[[], float],
    ) -> None:
        self._nc = nc
        self._layout = layout
        self._state = state
        self._partition = partition
        self._placed_elsewhere = placed_elsewhere
        self._reach = reach
        self._storage = storage
        self._dead_letters = dead_letters
        self._culprits = culprits
        self._probe_interval = probe_interval
        self._probe_timeout = probe_timeout
        self._clock = clock
        self.heartbeats: dict[str, float] = {}
        """When this aggregator read each node's last heartbeat, by its clock."""
        self._beats_stored: dict[str, int] = {}
        """When NATS stored each node's last heartbeat read (ns since the epoch)."""
        self._newest_stored = 0
        """When NATS stored the newest heartbeat read from any node (ns since the epoch)."""
        self._newest_read = -math.inf
        """When this aggregator last read a heartbeat of any node, by its clock."""
        self.clock_offsets: dict[str, float] = {}
        """Seconds each node's clock is ahead of the NATS server's (negative: behind)."""
        self._silent_probes: dict[str, float] = {}
        self._missed_rounds: dict[str, int] = {}
        """Probe rounds in a row each node gave no usable answer in."""

    async def on_node(self, entry: KeyValue.Entry) -> None:
        """Take in a node's heartbeat (or its entry's expiry)."""
        if (node := heard(entry, self._layout.nodes_bucket.bucket, self._dead_letters)) is None:
            return
        node_id, info = node
        self._state.set_node(node_id, info)
        if info is None:
            self.clock_offsets.pop(node_id, None)
            return
        self.heartbeats[node_id] = self._newest_read = self._clock()
        if entry.created is not None:  # when NATS stored it, ns
            self._beats_stored[node_id] = entry.created
            self._newest_stored = max(self._newest_stored, entry.created)
            self._clock_offset(node_id, to_epoch(info.lastHeartbeat) - entry.created / 1e9)

    def _clock_offset(self, node_id: str, offset: float) -> None:
        """Note how far `node_id`'s clock is from the NATS server's (its heartbeat's time
        against when the server stored it), saying so when it crosses `CLOCK_TOLERANCE_S`:
        its entries' times then mislead, and the timeline files them by arrival at most."""
        before = self.clock_offsets.get(node_id, 0.0)
        self.clock_offsets[node_id] = offset
        if abs(offset) > CLOCK_TOLERANCE_S >= abs(before):
            log.warning(
                "the clock of node %s is %.1fs %s of the NATS server's",
                node_id, abs(offset), "ahead" if offset > 0 else "behind",
                extra={"nodeId": node_id},
            )  # fmt: skip
        elif abs(before) > CLOCK_TOLERANCE_S >= abs(offset):
            log.info("the clock of node %s agrees with NATS again", node_id)

    async def _ask_nodes(self, targets: list[str]) -> list[set[str] | str | None]:
        """Ask every node of `targets` at once, on one inbox, under one deadline: the
        runners each agent supervises; why a node is silent when NATS says so at once (no
        agent listens there); or None for a node that gave no usable answer in time. One
        subscription and one timer for the round, however many nodes."""
        inbox, everyone = self._nc.new_inbox(), asyncio.Event()
        replies: dict[int, set[str] | str | None] = {}

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
                self._state.note_acknowledged(runner.runnerId, runner.acknowledgedSeq)
                listed.add(runner.runnerId)
        return listed

    async def probe_forever(self, stop: asyncio.Event) -> None:
        """A round every `probe_interval`, and rechecks of silent nodes in between."""
        while not stop.is_set():
            await self.probe()
            next_round = self._clock() + self._probe_interval
            # a node silent in the round is asked again, alone with the others that were,
            # once its heartbeat is overdue too: both signals then name it well before the
            # rank-table service gives it up at the TTL
            last = None
            while (due := self._recheck_due()) not in (None, last) and due < next_round:
                last = due  # a recheck that changed nothing (NATS out) is not repeated
                if await _stopped(stop, due - self._clock()):
                    return
                await self.probe(
                    sorted(n for n in self._missed_rounds if n not in self._state.unreachable)
                )
            await _stopped(stop, next_round - self._clock())

    def _recheck_due(self) -> float | None:
        """When the heartbeat of the earliest node left silent, and not yet called
        unreachable, will be overdue; None when there is no such node."""
        overdue = self._layout.node_ttl_s * OVERDUE_TTL_SHARE
        return min(
            (
                self.heartbeats[n] + overdue
                for n in self._missed_rounds
                if n not in self._state.unreachable and n in self.heartbeats
            ),
            default=None,
        )

    async def probe(self, only: list[str] | None = None) -> None:
        """Ask every node of interest (or `only` these) at once, under one deadline, and
        record who is silent.

        Only while NATS answers, before and after the round: when the bus itself is out,
        silence says nothing of the nodes, and once it is back every rank starts afresh.
        """
        was_out = not (self._reach.reachable and self._storage.storing)
        if not await self._reach.check() or not await self._storage.check():
            return
        if was_out:
            self._after_outage()
        if only is None:
            # the nodes of its instances, and its share of the nodes no partition places
            # on: every node is probed by one partition at least
            elsewhere = set().union(*self._placed_elsewhere.values())
            spare = {n for n in self.heartbeats if n not in elsewhere and self._partition.owns(n)}
            targets = sorted(self._state.placed_nodes() | spare)
            for gone in (set(self._missed_rounds) | set(self._silent_probes)) - set(targets):
                self._missed_rounds.pop(gone, None)  # no longer asked: no longer suspect
                self._silent_probes.pop(gone, None)
        else:
            targets = only
        asked_ns = time.time_ns()
        answers = await self._ask_nodes(targets)
        if any(not isinstance(a, set) for a in answers) and not await self._reach.check():
            return
        moment = self._clock()
        unreachable = {} if only is None else dict(self._state.unreachable)
        for start in range(0, len(targets), PROBE_SLICE):
            if start:
                await asyncio.sleep(0)
            for node_id, listed in zip(
                targets[start : start + PROBE_SLICE],
                answers[start : start + PROBE_SLICE],
                strict=True,
            ):
                if isinstance(listed, set):
                    self._state.note_listed(listed, self._state.runners.on_node(node_id))
                unreachable.pop(node_id, None)
                if (found := self._silence(node_id, listed, moment, full=only is None)) is not None:
                    unreachable[node_id] = found
        self._state.set_unreachable(unreachable, asked_ns)

    def _silence(
        self, node_id: str, listed: set[str] | str | None, moment: float, *, full: bool
    ) -> UnreachableNode | None:
        """Note what `node_id` answered this round (a full one, or a recheck of silent
        nodes that counts no missed round): why it is unreachable, if it is."""
        node = self._state.nodes.get(node_id)
        if isinstance(listed, set):
            self._silent_probes.pop(node_id, None)
            self._missed_rounds.pop(node_id, None)
            if node is not None:
                return None
        else:
            self._silent_probes.setdefault(node_id, moment)
            self._missed_rounds[node_id] = self._missed_rounds.get(node_id, 0) + full
        ttl = self._layout.node_ttl_s
        beat = self.heartbeats.get(node_id)
        asked = f"no answer to live diagnostics within {self._probe_timeout:g}s"
        since = f" (silent for {moment - self._silent_probes.get(node_id, moment):.1f}s)"
        if node is None:
            age = (
                f"for {moment - beat:.1f}s" if beat is not None else "since this aggregator started"
            )
            error = f"no heartbeat {age} (TTL {ttl:g}s); entry expired or never written"
        elif isinstance(listed, str):
            error = listed
        elif listed is None and self._overdue(node_id, moment):
            # two signals agree, well before the rank-table service gives the node up at
            # the TTL and releases its instances (which ends their judging)
            error = f"{asked} and no heartbeat for {moment - (beat or moment):.1f}s{since}"
        elif listed is None and self._missed_rounds[node_id] >= MISSED_ROUNDS:
            error = f"{asked}, {self._missed_rounds[node_id]} rounds in a row{since}"
        else:
            return None
        return UnreachableNode(nodeId=node_id, url=node.address if node else None, error=error)

    def _overdue(self, node_id: str, moment: float) -> bool:
        """Whether `node_id`'s heartbeat is overdue (`OVERDUE_TTL_SHARE`)."""
        limit = self._layout.node_ttl_s * OVERDUE_TTL_SHARE
        beat, stored = self.heartbeats.get(node_id), self._beats_stored.get(node_id)
        if beat is None:
            return True
        if moment - beat <= limit:
            return False
        return (
            stored is None
            or self._newest_stored - stored > limit * 1e9
            or moment - self._newest_read > limit
        )

    def _after_outage(self) -> None:
        self._silent_probes.clear()
        self._missed_rounds.clear()
        moment = self._clock()
        self.heartbeats = dict.fromkeys(self.heartbeats, moment)
        self._state.forgive(moment, keep=self._culprits())


async def _stopped(stop: asyncio.Event, seconds: float) -> bool:
    """Wait up to `seconds` for `stop`; whether it is set."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), max(0.0, seconds))
    return stop.is_set()
