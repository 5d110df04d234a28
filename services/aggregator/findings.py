"""The I/O around the judging core (`core.py`): a `Tick` fed every round with the time and
the state of NATS, evidence asked of the agents as an incident opens and fed back, each
finding published in order (kept while NATS is out), logged once and handed to the
alerts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext

from rankscope.services.aggregator.alerts import Alerter
from rankscope.services.aggregator.core import (
    Capture,
    Core,
    EvidenceArrived,
    Outage,
    Pause,
    Publish,
    Resume,
    TakeUp,
    Tick,
)
from rankscope.services.aggregator.diagnosis import Incident
from rankscope.shared.connection import Reachability
from rankscope.shared.jetstream import Layout
from rankscope.shared.replay import follow
from rankscope.shared.storage import Storage
from rankscope.shared.timestamps import from_micros
from rankscope.shared.wire import (
    EvidenceRequest,
    Finding,
    FindingKind,
    NodeEvidence,
    WireError,
    decode,
    encode,
)

__all__ = ["Findings", "bus_outage"]

log = logging.getLogger(__name__)

ROUND_S = 0.25
"""How often the instances that changed are judged."""
EVIDENCE_WAIT_S = 5.0
"""Longest the aggregator waits for an agent's evidence of a new finding."""
UNPUBLISHED_FINDINGS = 10_000
"""Findings kept for the diagnosis stream while NATS is out; the oldest go first."""
RESTORE_INCIDENTS_S = 10.0
"""How long taking up the open incidents may take at start."""

_OUTAGES = {FindingKind.NATS_UNREACHABLE, FindingKind.JETSTREAM_STORAGE}


class Findings:
    """The open incidents of its instances and what is published of them.

    Args:
        nc: NATS connection (evidence requests).
        js: JetStream context (the diagnosis stream).
        layout: subjects.
        core: the judging core (its views, its incidents).
        reach: whether NATS answers (an outage is the only finding then).
        storage: whether JetStream stores.
        alerter: where findings go as alerts, if anywhere.
        loaded: the incidents of loaded dumps to publish, once each.
        clock: monotonic seconds.
        wall: seconds since the epoch.
    """

    def __init__(
        self,
        *,
        nc: Client,
        js: JetStreamContext,
        layout: Layout,
        core: Core,
        reach: Reachability,
        storage: Storage,
        alerter: Alerter | None,
        loaded: deque[Finding],
        clock: Callable[[], float],
        wall: Callable[[], float],
    ) -> None:
        self._nc = nc
        self._js = js
        self._layout = layout
        self.core = core
        self._state = core.state
        self._partition = core.partition
        self._reach = reach
        self._storage = storage
        self._alerter = alerter
        self._loaded = loaded
        self._known: set[str] = set()
        """Every incident the diagnosis stream held as this aggregator started."""
        self._clock = clock
        self._wall = wall
        self.capturing: set[asyncio.Task[None]] = set()
        self._unpublished: deque[Finding] = deque(maxlen=UNPUBLISHED_FINDINGS)
        """Findings not yet in the diagnosis stream (NATS was out), oldest first."""
        self._announced: set[tuple[str, str]] = set()
        """Open findings already logged (an update of one is published, not logged)."""

    @property
    def incidents(self) -> dict[str, Incident]:
        """The open incident of each instance (`""`: an outage; `Floods.key`: a node
        sending more than is kept)."""
        return self.core.incidents.open

    async def restore(self, stop: asyncio.Event) -> None:
        """Take up the incidents of its instances that were open when the last aggregator
        stopped, as it published them last: a freeze that outlasts a restart stays one
        incident, with its id and `since`, and is closed once, by this aggregator. Its
        alerts learn every past incident, to say how often a fault was seen before."""
        found: dict[str, Finding] = {}
        past: list[Finding] = []

        async def keep(msg: Msg) -> None:
            with contextlib.suppress(WireError):  # only aggregators write there
                finding = decode(msg.data, Finding)
                past.append(finding)
                key = finding.instanceId or self.core.floods.owns(finding)
                if not key:
                    return
                if finding.open and (not finding.instanceId or self._partition.owns(key)):
                    found[key] = finding
                else:
                    found.pop(key, None)

        try:
            follower = await follow(self._js, self._layout.subjects.diagnosis_all(), keep)
            read, halted = (
                asyncio.ensure_future(follower.caught_up.wait()),
                asyncio.ensure_future(stop.wait()),
            )
            try:
                await asyncio.wait(
                    {read, halted}, timeout=RESTORE_INCIDENTS_S, return_when="FIRST_COMPLETED"
                )
            finally:
                read.cancel()
                halted.cancel()
                await follower.stop()
        except (NatsError, TimeoutError) as exc:
            log.warning("open incidents not taken up (%s): they may open again", exc)
            return
        if not follower.caught_up.is_set():
            if not stop.is_set():
                log.warning("open incidents not taken up in %gs: they may open again",
                            RESTORE_INCIDENTS_S)  # fmt: skip
            return
        self._known = {finding.key for finding in past}
        self.core.feed(TakeUp(found, at=self._clock(), wall=self._now()))
        self._announced |= {(f.instanceId, f.since) for f in found.values()}
        if self._alerter is not None:
            self._alerter.remember(past)
            self._alerter.update(list(found.values()), [])  # its alert fires on, one alert
        if found:
            log.info("took up %d open incidents", len(found))

    def _now(self) -> str:
        """Now, by its wall clock (virtual in tests), as a wire timestamp."""
        return from_micros(round(self._wall() * 1e6))

    async def evaluate(self) -> tuple[list[Finding], list[Finding]]:
        """Judge this moment (`core.Core`), a slice of instances at a time between turns of
        the queries; returns (findings opened or changed, findings that cleared), and asks
        for the evidence of those that opened."""
        effects = self.core.feed(
            Tick(self._clock(), self._now(), bus_outage(self._reach, self._storage))
        )
        while effects and isinstance(effects[-1], Pause):
            await asyncio.sleep(0)
            effects = self.core.feed(Resume())
        for effect in effects:
            if isinstance(effect, Capture):
                self._capture(effect.finding)
        published = [e.finding for e in effects if isinstance(e, Publish)]
        return [f for f in published if f.open], [f for f in published if not f.open]

    def _capture(self, finding: Finding) -> None:
        """Ask the agents of every rank of `finding` for their stacks and memory now; they
        join the finding when they arrive."""
        asks: dict[str, tuple[str, list[str]]] = {}
        subjects = self._layout.subjects
        for rank in finding.evidence:
            view = self._state.runners.get(rank.runnerId)
            if view is not None and self._state.recorded(view):  # its watcher answers
                subject = subjects.record_evidence(rank.nodeId, rank.runnerId)
            else:  # its node's agent answers for every rank asked of it there
                subject = subjects.node_evidence(rank.nodeId)
            asks.setdefault(subject, (rank.nodeId, []))[1].append(rank.runnerId)
        for subject, (node_id, runner_ids) in asks.items():
            task = asyncio.get_running_loop().create_task(
                self._gather(finding, subject, node_id, runner_ids)
            )
            self.capturing.add(task)
            task.add_done_callback(self.capturing.discard)

    async def _gather(
        self, finding: Finding, subject: str, node_id: str, runner_ids: list[str]
    ) -> None:
        request = encode(EvidenceRequest(runnerIds=runner_ids))
        try:
            reply = await self._nc.request(subject, request, timeout=EVIDENCE_WAIT_S)
            answer = decode(reply.data, NodeEvidence)
        except (NatsError, TimeoutError, WireError) as exc:
            log.warning("no evidence from %s: %s", node_id, exc or type(exc).__name__)
            return
        self.core.feed(EvidenceArrived(finding, runner_ids, answer.runners))

    def _take_loaded(self) -> list[Finding]:
        """The incidents of dumps loaded since the last round, but those the diagnosis
        stream has already (an aggregator that restarts reads the loads again)."""
        taken = [finding for finding in self._loaded if finding.key not in self._known]
        self._loaded.clear()
        self._known |= {finding.key for finding in taken}  # the same dumps again: not again
        return taken

    async def stop_watching(self) -> None:
        """Say of each open incident of its instances that rankscope stops watching it now:
        whatever follows until an aggregator takes it up again goes unseen."""
        wall = self._now()
        for incident in self.incidents.values():
            finding = incident.finding
            if not finding.instanceId or finding.kind in _OUTAGES:
                continue  # an outage is of rankscope itself
            told = msgspec.structs.replace(finding, unwatchedSince=wall, unwatchedUntil=None)
            try:
                await self._js.publish(
                    self._layout.subjects.diagnosis(finding.instanceId), encode(told)
                )
            except (NatsError, TimeoutError) as exc:
                log.warning("could not say incident %s goes unwatched: %s", finding.incidentId, exc)

    async def publish_forever(self, stop: asyncio.Event) -> None:
        """Judge every `ROUND_S`; log, alert and publish what opened, changed or cleared."""
        while not stop.is_set():
            appeared, cleared = await self.evaluate()
            for finding in [*appeared, *cleared]:
                key = (finding.instanceId, finding.since)
                if finding.open and key not in self._announced:
                    self._announced.add(key)
                    log.warning("finding %s open: %s", finding.kind.value, finding.summary)
                elif not finding.open:
                    self._announced.discard(key)
                    log.warning("finding %s cleared: %s", finding.kind.value, finding.summary)
            # every partition sees an outage of NATS or JetStream: one says so
            ours = [
                f
                for f in [*cleared, *appeared, *self._take_loaded()]
                if f.kind not in _OUTAGES or self._partition.index == 0
            ]
            self._unpublished.extend(ours)
            if self._alerter is not None:
                self._alerter.update([f for f in ours if f.open], [f for f in ours if not f.open])
            while self._unpublished and self._reach.reachable:
                finding = self._unpublished[0]
                try:
                    await self._js.publish(
                        self._layout.subjects.diagnosis(finding.instanceId), encode(finding)
                    )
                except (NatsError, TimeoutError):
                    break  # kept, in order, for the next round
                self._unpublished.popleft()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), ROUND_S)


def bus_outage(reach: Reachability, storage: Storage) -> Outage | None:
    """The outage of NATS or JetStream as their last checks say, or None. JetStream counts
    as not storing only once NATS has answered a ping since: a server paused or wedged
    fails a write before it fails a ping, and it is NATS that is out then."""
    if not reach.reachable:
        return FindingKind.NATS_UNREACHABLE, reach.down_since_wall or "", reach.why()
    failing = storage.failing_since
    if failing is not None and reach.answered_at is not None and reach.answered_at >= failing:
        return FindingKind.JETSTREAM_STORAGE, storage.failing_since_wall or "", storage.why()
    return None
