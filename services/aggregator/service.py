"""The aggregator's I/O: replay and follow the streams, answer queries, probe nodes, and
publish findings as they appear and clear."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from importlib.metadata import version
from typing import Any

import msgspec
from nats.aio.client import NO_RESPONDERS_STATUS as NO_RESPONDERS
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import Header
from nats.js.kv import KeyValue
from nats.micro import add_service
from nats.micro.request import Request, ServiceError
from nats.micro.service import Service

from services.aggregator.alerts import Alerter
from services.aggregator.diagnosis import Incident, Thresholds, diagnose
from services.aggregator.parking import PARK_S, Parked, Parking
from services.aggregator.snapshot import Position, SnapshotFile, restore
from services.aggregator.views import ClusterState
from shared.connection import Reachability, slow_consumer_drops
from shared.deadletter import DeadLetters
from shared.inputs import (
    BadInputError,
    parse_placement,
    parse_task,
    parse_telemetry,
)
from shared.jetstream import Layout
from shared.partitions import Partition
from shared.replay import Follower, follow, follow_bucket, stored_ns
from shared.storage import Storage
from shared.subjects import AGGREGATOR_SERVICE, kv_key, token, untoken
from shared.timestamps import now, to_epoch
from shared.wire import (
    Diagnosis,
    EvidenceRequest,
    Finding,
    FindingKind,
    InstanceCreated,
    NodeDiagnostics,
    NodeEvidence,
    NodeInfo,
    PlacementQuery,
    RunnerEvidence,
    TimelineQuery,
    UnreachableNode,
    WireError,
    decode,
    encode,
)

__all__ = ["AggregatorService"]

log = logging.getLogger(__name__)

SERVICE_VERSION = version("rankscope")

VIEWS = ("timeline", "placement", "diagnosis", "instances", "history", "health")
"""The views it answers, one service endpoint each on `subjects.query(view)`; instances
share the requests (the service's queue group), any one answering."""

ANSWER_REUSE_S = 0.5
"""How long an unchanged view's answer may be served again (its `secondsInPhase` ages)."""

HEAP_FREEZE_S = 30.0
"""How often what the views hold is moved out of the cycle collector's reach (`gc.freeze`):
with a million stored entries a full collection otherwise stalls queries for 50-70 ms."""

ANSWER_CACHE_BYTES = 128 << 20
"""Bytes of timeline answers kept for reuse; the oldest go first."""

HEAVY_ENTRIES = 5_000
"""Timelines of more entries than this are built in a lane of their own, a slice at a
time, so a small query never waits behind them for more than one slice."""

SWEEP_S = 1.0
"""How often the diagnosis judges every instance; in between, the ones that changed."""
SLICE_ENTRIES = 2_000
"""Entries built between two turns of the other queries."""

SNAPSHOT_WORK_SHARE = 50
"""Snapshots are taken at most once per this many times the CPU seconds the last one took."""


UNPLACED = "telemetry_unplaced"
"""The kind of bad input of a runner that no placement made."""

RESTORE_INCIDENTS_S = 10.0
"""How long taking up the open incidents may take at start."""

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

EVIDENCE_WAIT_S = 5.0
"""Longest the aggregator waits for an agent's evidence of a new finding."""
UNPUBLISHED_FINDINGS = 10_000
"""Findings kept for the diagnosis stream while NATS is out; the oldest go first."""
JUDGE_SLICE = 100
"""Instances judged between two turns of the queries (about a millisecond of work)."""
PROBE_SLICE = 500
"""Nodes asked, or whose answers are taken in, between two turns of the queries (a few ms
of work)."""
FOLLOW_RELEASED_S = 300.0
"""How long a partition still follows a released instance's telemetry (its last words)."""
CLOCK_TOLERANCE_S = 2.0
"""How far a node's clock may be from the NATS server's before the aggregator says so."""


class AggregatorService:
    """Keeps `state` current and answers `rankscope.query.<view>`.

    Args:
        nc: NATS connection.
        js: JetStream context.
        layout: streams, buckets and subjects.
        state: the views to fold events into.
        node_id: this aggregator's node id (`localNodeId` of the timeline).
        thresholds: when a rank counts as stuck.
        probe_interval: seconds between live diagnostics requests to every node.
        probe_timeout: overall deadline of one round of those requests.
        snapshots: where the folded state is kept between restarts (None: replay in full).
        snapshot_interval: seconds between snapshots, taken when something changed.
        partition: the instances it folds and answers for (all by default).
        clock: monotonic seconds.
    """

    def __init__(
        self,
        *,
        nc: Client,
        js: JetStreamContext,
        layout: Layout,
        state: ClusterState,
        node_id: str,
        thresholds: Thresholds | None = None,
        probe_interval: float = 2.0,
        probe_timeout: float = 1.0,
        snapshots: SnapshotFile | None = None,
        snapshot_interval: float = 30.0,
        partition: Partition | None = None,
        alerter: Alerter | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._nc = nc
        self._alerter = alerter
        self._js = js
        self._layout = layout
        self.partition = partition or Partition()
        self.state = state
        self._node_id = node_id
        self._thresholds = thresholds or Thresholds()
        self._probe_interval = probe_interval
        self._probe_timeout = probe_timeout
        self._clock = clock
        self._snapshots = snapshots
        self._snapshot_interval = snapshot_interval
        self._snapshot_version = -1
        self._snapshot_cpu_s = 0.0
        self._streams: dict[str, str] = {}
        self.ready = asyncio.Event()
        self.dead_letters = DeadLetters(
            js=js, subject=layout.subjects.deadletter("aggregator"), service="aggregator"
        )
        self.reach = Reachability(nc, timeout=probe_timeout, clock=clock)
        self.storage = Storage(
            js,
            layout.subjects.canary("aggregator"),
            timeout=probe_timeout,
            streams=layout.stream_names,
            clock=clock,
        )
        self._placed_at: dict[str, float] = {}
        self._wanted: set[str] = set()
        """Its instances placed, whose tasks and telemetry it wants to follow."""
        self._followed: set[str] = set()
        """Its instances whose tasks and telemetry it follows."""
        self._released: dict[str, float] = {}
        """When each of its instances was released (followed a while longer)."""
        self._more = asyncio.Event()
        self._placed_elsewhere: dict[str, set[str]] = {}
        """The nodes of each instance of another partition."""
        self._heartbeats: dict[str, float] = {}
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
        self._incidents: dict[str, Incident] = {}
        self._swept = -math.inf
        """When the diagnosis last judged every instance."""
        self._evidence: dict[tuple[str, str], dict[str, RunnerEvidence]] = {}
        """What the agents captured of each open incident's ranks, by (instance, since)."""
        self._capturing: set[asyncio.Task[None]] = set()
        self._unpublished: deque[Finding] = deque(maxlen=UNPUBLISHED_FINDINGS)
        """Findings not yet in the diagnosis stream (NATS was out), oldest first."""
        self._parking = Parking()
        """Telemetry of runners no placement read so far names, waiting for one."""
        self._announced: set[tuple[str, str]] = set()
        """Open findings already logged (an update of one is published, not logged)."""
        self._answers: dict[bytes, tuple[int, float, bytes]] = {}
        self._answer_bytes = 0
        self._heavy_lane = asyncio.Semaphore(1)
        self._heavy: set[asyncio.Task[None]] = set()
        self._followers: list[Follower] = []
        self._folding: dict[str, Follower] = {}
        """The followers a snapshot covers, by stream name."""

    def _reject(self, msg: Msg, error: BadInputError) -> None:
        self.dead_letters.reject(msg.subject, msg.data, error.kind, error)

    def _foreign(self, msg: Msg) -> bool:
        """Whether the message is of an instance of another partition (not decoded)."""
        return not self.partition.owns_subject(msg.subject, self._layout.subjects)

    async def _on_telemetry(self, msg: Msg) -> None:
        if self._foreign(msg):
            return
        try:
            event = parse_telemetry(msg.data, msg.subject, self._layout.subjects)
        except BadInputError as exc:
            self._reject(msg, exc)
            return
        stored = stored_ns(msg.reply)
        self._apply_telemetry(Parked(msg.subject, msg.data, event, stored, self._clock()))

    def _apply_telemetry(self, item: Parked) -> None:
        """Apply a message, park it while no placement read so far names its runner, or
        refuse it."""
        try:
            self.state.apply_telemetry(item.event, item.data, item.stored_ns)
        except BadInputError as exc:
            if exc.kind != UNPLACED:
                self.dead_letters.reject(item.subject, item.data, exc.kind, exc)
                return
            for late in self._parking.park(item):
                self.dead_letters.reject(late.subject, late.data, UNPLACED, "parked too long")

    def _unpark(self, now: float) -> None:
        """Refuse what no placement claimed in time."""
        for item in self._parking.expired(now):
            why = f"runner {item.event.runner.runnerId!r} is in no placement ({PARK_S:g}s)"
            self.dead_letters.reject(item.subject, item.data, UNPLACED, why)

    async def _on_placement(self, msg: Msg) -> None:
        foreign = self._foreign(msg)
        try:
            event = parse_placement(msg.data)
        except BadInputError as exc:
            if not foreign:  # its own partition says so, once
                self._reject(msg, exc)
            return
        if foreign:  # only where it runs: its nodes are probed by its own partition
            if isinstance(event, InstanceCreated):
                self._placed_elsewhere[event.instanceId] = {a.nodeId for a in event.assignments}
            else:
                self._placed_elsewhere.pop(event.instanceId, None)
            return
        if not self.partition.whole:
            if isinstance(event, InstanceCreated):
                self._wanted.add(event.instanceId)
                self._released.pop(event.instanceId, None)
            else:
                self._released[event.instanceId] = self._clock()
            self._more.set()
        self.state.apply_placement(event, stored_ns(msg.reply))
        self._placed_at[event.instanceId] = self._clock()
        if isinstance(event, InstanceCreated):  # its runners' first messages, read before it
            for assignment in event.assignments:
                for item in self._parking.take(assignment.runnerId):
                    self._apply_telemetry(item)

    async def _on_task(self, msg: Msg) -> None:
        if self._foreign(msg):
            return
        try:
            self.state.apply_task(parse_task(msg.data))
        except BadInputError as exc:
            self._reject(msg, exc)

    async def run(self, stop: asyncio.Event) -> None:
        """Rebuild from the streams, then follow them until `stop` is set."""
        after = await self._restore()
        await self._follow_streams(after)
        widening = (
            [] if self.partition.whole else [asyncio.create_task(self._follow_more_forever(stop))]
        )
        self._followers = followers = [
            *self._folding.values(),
            await follow_bucket(self._js, self._layout.nodes_bucket.bucket, self._on_node),
        ]
        for follower in followers:
            await follower.caught_up.wait()
        await self._restore_incidents(stop)
        queries = await self._serve_queries()
        self.ready.set()
        log.info(
            "aggregator of partition %s caught up: %d entries from %d runners",
            self.partition,
            self.state.store.size,
            len(self.state.runners),
        )
        loops = [
            *widening,
            asyncio.create_task(self._diagnose_forever(stop)),
            asyncio.create_task(self._probe_forever(stop)),
            asyncio.create_task(self._freeze_heap_forever(stop)),
            asyncio.create_task(self._snapshot_forever(stop)),
            *([asyncio.create_task(self._alerter.run(stop))] if self._alerter else []),
        ]
        await stop.wait()
        busy = [*loops, *self._heavy, *self._capturing]
        for task in busy:
            task.cancel()
        await asyncio.gather(*busy, return_exceptions=True)
        await self.snapshot()  # a restart right after this replays nothing
        await queries.stop()
        for follower in followers:
            await follower.stop()

    async def _restore_incidents(self, stop: asyncio.Event) -> None:
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
                if finding.open and finding.instanceId and self.partition.owns(finding.instanceId):
                    found[finding.instanceId] = finding
                else:
                    found.pop(finding.instanceId, None)

        try:
            follower = await follow(
                self._js,
                self._layout.subjects.diagnosis_all(),
                keep,
            )
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
        moment = self._clock()
        for instance_id, finding in found.items():
            self._incidents[instance_id] = Incident(finding=finding, opened=moment)
            self._announced.add((instance_id, finding.since))
        if self._alerter is not None:
            self._alerter.remember(past)
            self._alerter.update(list(found.values()), [])  # its alert fires on, one alert
        if found:
            log.info("took up %d open incidents", len(found))

    async def _follow_streams(self, after: dict[str, int]) -> None:
        """Follow placements, tasks and telemetry from `after` (by stream). Of a partition,
        only its instances' tasks and telemetry: the server filters them by instance, once
        the placements it holds say which instances are its own."""
        layout, subjects = self._layout, self._layout.subjects
        placements = await follow(
            self._js,
            subjects.placement_all(),
            self._on_placement,
            after=after.get(layout.placement_stream.name, 0),
        )
        await placements.caught_up.wait()  # a runner's telemetry counts once it is placed
        if self.partition.whole:
            runner, tasks = [subjects.runner_all()], [subjects.tasks_all()]
        else:
            followed = set(self.state.instances)  # restored from the snapshot
            if not after.get(layout.runner_stream.name):
                followed |= self._wanted  # from the start: nothing to go over again
            self._followed = followed
            runner, tasks = self._filters([None, *sorted(followed)])
        self._folding = {layout.placement_stream.name: placements}
        for name, (filters, handle) in {
            layout.tasks_stream.name: (tasks, self._on_task),
            layout.runner_stream.name: (runner, self._on_telemetry),
        }.items():
            self._folding[name] = await follow(
                self._js, filters[0], handle, also=filters[1:], after=after.get(name, 0)
            )

    def _filters(self, ids: list[str | None]) -> tuple[list[str], list[str]]:
        """The telemetry and task subjects of these instances; None's are subjects no
        message has, which keep a consumer's filter from ever being empty (it would then
        get everything)."""
        subjects = self._layout.subjects
        runner = [subjects.runner_of_instance(i) for i in ids]
        tasks = [subject for i in ids for subject in subjects.tasks_of_instance(i)]
        return runner, tasks

    async def _follow_more_forever(self, stop: asyncio.Event) -> None:
        """Of a partition: follow the tasks and telemetry of its instances placed since it
        started too, from their first message (older ones are gone over again for them);
        stop following those released `FOLLOW_RELEASED_S` ago."""
        subjects = self._layout.subjects
        runner = self._folding[self._layout.runner_stream.name]
        tasks = self._folding[self._layout.tasks_stream.name]
        while not stop.is_set():
            if new := self._wanted - self._followed:
                tokens = {token(i) for i in new}

                def added(subject: str, tokens: set[str] = tokens) -> bool:
                    return subjects.instance_token(subject) in tokens

                runner_subjects, task_subjects = self._filters([*sorted(new)])
                try:
                    await runner.widen(runner_subjects, added)
                    await tasks.widen(task_subjects, added)
                except (NatsError, TimeoutError) as exc:
                    log.warning("cannot follow instances %s yet: %s", sorted(new), exc)
                    await asyncio.sleep(1.0)
                    continue
                self._followed |= new
            moment = self._clock()
            if done := {i for i, at in self._released.items() if moment - at > FOLLOW_RELEASED_S}:
                runner_subjects, task_subjects = self._filters([*sorted(done)])
                runner.narrow(runner_subjects)
                tasks.narrow(task_subjects)
                self._followed -= done
                self._wanted -= done
                for instance_id in done:
                    del self._released[instance_id]
            self._more.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._more.wait(), 1.0)

    async def _serve_queries(self) -> Service:
        """Answer queries from now on: it joins its partition's queue group only once its
        views are built, so a restarted twin never answers in place of a ready one."""
        part = self.partition
        queries = await add_service(
            self._nc,
            name=AGGREGATOR_SERVICE,
            version=SERVICE_VERSION,
            description="Cross-rank views of every runner's flight recorder",
            metadata={"partition": str(part)},
        )
        for view in VIEWS:
            await queries.add_endpoint(
                name=view,
                subject=self._layout.subjects.query(view, part.index, part.count),
                handler=functools.partial(self._answer, view),
            )
        return queries

    # Snapshots

    async def _stream_ids(self) -> dict[str, tuple[str, int]]:
        """(creation time, last sequence) of each stream a snapshot covers."""
        found = {}
        for stream in (
            self._layout.placement_stream,
            self._layout.tasks_stream,
            self._layout.runner_stream,
        ):
            info = await self._js.stream_info(stream.name)
            created = info.created.isoformat() if info.created else ""
            found[stream.name] = (created, info.state.last_seq)
        return found

    async def _restore(self) -> dict[str, int]:
        """Fold in the snapshot kept, when it can be trusted; where each stream's replay
        starts after (nothing: from the start)."""
        current = await self._stream_ids()
        self._streams = {name: created for name, (created, _) in current.items()}
        if self._snapshots is None:
            return {}
        snapshot = await asyncio.to_thread(self._snapshots.read)
        if snapshot is None:
            return {}
        for name, (created, last) in current.items():
            position = snapshot.positions.get(name)
            if position is None or position.created != created or position.seq > last:
                log.warning(
                    "snapshot %s is of another incarnation of stream %s; replaying in full",
                    self._snapshots.path,
                    name,
                )
                return {}
        try:
            restore(self.state, snapshot, moment=self._clock())
        except ValueError as exc:
            log.warning("snapshot %s does not hold together (%s); replaying in full",
                        self._snapshots.path, exc)  # fmt: skip
            return {}
        for instance_id in self.state.instances:
            self._placed_at[instance_id] = self._clock()
        log.info(
            "restored a snapshot of %d entries from %d runners; replaying what came after",
            self.state.store.size,
            len(self.state.runners),
        )
        return {name: position.seq for name, position in snapshot.positions.items()}

    async def _snapshot_forever(self, stop: asyncio.Event) -> None:
        """Snapshot every `snapshot_interval`, or less often when one takes much CPU: the
        copies that write them use under 2% of a core."""
        while not stop.is_set():
            wait = max(self._snapshot_interval, SNAPSHOT_WORK_SHARE * self._snapshot_cpu_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)
            if not stop.is_set():
                await self.snapshot()

    async def snapshot(self) -> None:
        """Keep the folded state and how far into each stream it goes, when it changed."""
        if self._snapshots is None or not self.ready.is_set():
            return
        if self.state.version == self._snapshot_version:
            return
        positions = {
            name: Position(created=self._streams[name], seq=follower.last_seq)
            for name, follower in self._folding.items()
        }
        started, version, size = time.perf_counter(), self.state.version, self.state.store.size
        try:
            paused, self._snapshot_cpu_s = await self._snapshots.keep(self.state, positions)
            megabytes = self._snapshots.path.stat().st_size / 1e6
        except OSError as exc:
            log.warning("snapshot not written to %s: %s", self._snapshots.path, exc)
            return
        written = time.perf_counter() - started
        self._snapshot_version = version
        log.debug("snapshot of %d entries: %.1f MB, written in %.2f s (%.2f s of CPU) by a copy "
                 "of this process; queries paused %.1f ms for the copy", size, megabytes, written,
                 self._snapshot_cpu_s, paused * 1000)  # fmt: skip

    async def _on_node(self, entry: KeyValue.Entry) -> None:
        node_id = untoken(entry.key)
        if entry.operation is not None:
            self.state.set_node(node_id, None)
            self.clock_offsets.pop(node_id, None)
            return
        try:
            info = decode(entry.value or b"", NodeInfo)
        except WireError as exc:
            subject = kv_key(self._layout.nodes_bucket.bucket, entry.key)
            self.dead_letters.reject(subject, entry.value, "node_undecodable", exc)
            return
        self.state.set_node(node_id, info)
        self._heartbeats[node_id] = self._newest_read = self._clock()
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

    @staticmethod
    async def _freeze_heap_forever(stop: asyncio.Event) -> None:
        """Views are long-lived and acyclic: scanning them in every full collection only
        adds pauses, so survivors are frozen after the rebuild and every `HEAP_FREEZE_S`
        (reference counting still frees them when they are evicted)."""
        while not stop.is_set():
            gc.freeze()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), HEAP_FREEZE_S)

    # Findings

    def _outage(self) -> tuple[FindingKind, str, str] | None:
        if not self.reach.reachable:
            return FindingKind.NATS_UNREACHABLE, self.reach.down_since_wall or "", self.reach.why()
        if not self.storage.storing:
            storage = self.storage
            return FindingKind.JETSTREAM_STORAGE, storage.failing_since_wall or "", storage.why()
        return None

    def _judged(
        self, instances: Iterable[InstanceCreated], outage: tuple[FindingKind, str, str] | None
    ) -> dict[str, Incident]:
        return diagnose(
            self.state,
            now=self._clock(),
            wall=now(),
            incidents=self._incidents,
            placed_at=lambda i: self._placed_at.get(i, self._clock()),
            thresholds=self._thresholds,
            outage=outage,
            instances=instances,
        )

    async def evaluate(self) -> tuple[list[Finding], list[Finding]]:
        """Diagnose the instances touched since the last call, and every instance once per
        `SWEEP_S` (thresholds are crossed with time alone), `JUDGE_SLICE` instances at a
        time between turns of the queries; returns (findings opened or changed, findings
        that cleared)."""
        outage = self._outage()
        if outage is not None:
            return self._settle(self._judged(list(self.state.instances.values()), outage))
        instances, touched = self.state.instances, self.state.take_touched()
        found: dict[str, Incident] = {}
        if (moment := self._clock()) >= self._swept + SWEEP_S:
            self._swept, picked = moment, list(instances.values())
        else:
            picked = [instances[i] for i in touched if i in instances]
            found = {i: kept for i, kept in self._incidents.items() if i in instances}
        for start in range(0, len(picked), JUDGE_SLICE):
            if start:
                await asyncio.sleep(0)
            judged = picked[start : start + JUDGE_SLICE]
            for instance in judged:
                found.pop(instance.instanceId, None)
            found |= self._judged(judged, None)
        return self._settle(found)

    def _settle(self, found: dict[str, Incident]) -> tuple[list[Finding], list[Finding]]:
        """Keep what `found` says, capturing evidence of the incidents it opens."""
        before = self._incidents
        opened = [
            i.finding
            for key, i in found.items()
            if key not in before or before[key].finding.since != i.finding.since
        ]
        for finding in opened:
            if finding.evidence:
                self._capture(finding)
        found = {key: self._with_evidence(i) for key, i in found.items()}
        changed = [
            i.finding
            for key, i in found.items()
            if key not in before or _told(before[key].finding) != _told(i.finding)
        ]
        cleared = [
            msgspec.structs.replace(i.finding, open=False, clearedAt=now())
            for key, i in before.items()
            if key not in found or found[key].finding.since != i.finding.since
        ]
        self._incidents = found
        live = {(i.finding.instanceId, i.finding.since) for i in found.values()}
        for gone in set(self._evidence) - live:
            del self._evidence[gone]
        return changed, cleared

    # Evidence

    def _capture(self, finding: Finding) -> None:
        """Ask the agents of every rank of `finding` for their stacks and memory now; they
        join the finding when they arrive."""
        key = (finding.instanceId, finding.since)
        self._evidence[key] = {}
        nodes: dict[str, list[str]] = {}
        for rank in finding.evidence:
            nodes.setdefault(rank.nodeId, []).append(rank.runnerId)
        for node_id, runner_ids in nodes.items():
            task = asyncio.get_running_loop().create_task(self._gather(key, node_id, runner_ids))
            self._capturing.add(task)
            task.add_done_callback(self._capturing.discard)

    async def _gather(self, key: tuple[str, str], node_id: str, runner_ids: list[str]) -> None:
        request = encode(EvidenceRequest(runnerIds=runner_ids))
        try:
            reply = await self._nc.request(
                self._layout.subjects.node_evidence(node_id), request, timeout=EVIDENCE_WAIT_S
            )
            answer = decode(reply.data, NodeEvidence)
        except (NatsError, TimeoutError, WireError) as exc:
            log.warning("no evidence from %s: %s", node_id, exc or type(exc).__name__)
            return
        held = self._evidence.get(key)
        if held is None:
            return  # the incident is over already
        for runner in answer.runners:
            if runner.runnerId in runner_ids:  # a node speaks only for the runners asked of it
                held[runner.runnerId] = runner
        self.state.version += 1

    def _with_evidence(self, incident: Incident) -> Incident:
        held = self._evidence.get((incident.finding.instanceId, incident.finding.since))
        if not held:
            return incident
        ranks = [
            msgspec.structs.replace(
                rank,
                process=captured.process,
                stack=captured.stack,
                mlxMemory=captured.mlxMemory,
                capturedAt=captured.capturedAt,
            )
            if (captured := held.get(rank.runnerId)) is not None
            else rank
            for rank in incident.finding.evidence
        ]
        finding = msgspec.structs.replace(incident.finding, evidence=ranks)
        return Incident(finding=finding, opened=incident.opened)

    async def _diagnose_forever(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self._unpark(self._clock())
            appeared, cleared = await self.evaluate()
            for finding in [*appeared, *cleared]:
                key = (finding.instanceId, finding.since)
                if finding.open and key not in self._announced:
                    self._announced.add(key)
                    log.warning("finding %s open: %s", finding.kind.value, finding.summary)
                elif not finding.open:
                    self._announced.discard(key)
                    log.warning("finding %s cleared: %s", finding.kind.value, finding.summary)
            # each partition sees the installation's own findings (NATS out): one says so
            ours = [f for f in [*cleared, *appeared] if f.instanceId or self.partition.index == 0]
            self._unpublished.extend(ours)
            if self._alerter is not None:
                self._alerter.update([f for f in ours if f.open], [f for f in ours if not f.open])
            while self._unpublished and self.reach.reachable:
                finding = self._unpublished[0]
                try:
                    await self._js.publish(
                        self._layout.subjects.diagnosis(finding.instanceId), encode(finding)
                    )
                except (NatsError, TimeoutError):
                    break  # kept, in order, for the next round
                self._unpublished.popleft()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.25)

    # Unreachable nodes

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
            if await self.reach.check():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(everyone.wait(), self._probe_timeout)
            if not everyone.is_set() and await self.reach.check():
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
                self.state.note_acknowledged(runner.runnerId, runner.acknowledgedSeq)
                listed.add(runner.runnerId)
        return listed

    async def _probe_forever(self, stop: asyncio.Event) -> None:
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
                    sorted(n for n in self._missed_rounds if n not in self.state.unreachable)
                )
            await _stopped(stop, next_round - self._clock())

    def _recheck_due(self) -> float | None:
        """When the heartbeat of the earliest node left silent, and not yet called
        unreachable, will be overdue; None when there is no such node."""
        overdue = self._layout.node_ttl_s * OVERDUE_TTL_SHARE
        return min(
            (
                self._heartbeats[n] + overdue
                for n in self._missed_rounds
                if n not in self.state.unreachable and n in self._heartbeats
            ),
            default=None,
        )

    async def probe(self, only: list[str] | None = None) -> None:
        """Ask every node of interest (or `only` these) at once, under one deadline, and
        record who is silent.

        Only while NATS answers, before and after the round: when the bus itself is out,
        silence says nothing of the nodes, and once it is back every rank starts afresh.
        """
        was_out = not (self.reach.reachable and self.storage.storing)
        if not await self.reach.check() or not await self.storage.check():
            return
        if was_out:
            self._after_outage()
        if only is None:
            # the nodes of its instances, and its share of the nodes no partition places
            # on: every node is probed by one partition at least
            elsewhere = set().union(*self._placed_elsewhere.values())
            spare = {n for n in self._heartbeats if n not in elsewhere and self.partition.owns(n)}
            targets = sorted(self.state.placed_nodes() | spare)
            for gone in (set(self._missed_rounds) | set(self._silent_probes)) - set(targets):
                self._missed_rounds.pop(gone, None)  # no longer asked: no longer suspect
                self._silent_probes.pop(gone, None)
        else:
            targets = only
        asked_ns = time.time_ns()
        answers = await self._ask_nodes(targets)
        if any(not isinstance(a, set) for a in answers) and not await self.reach.check():
            return
        moment = self._clock()
        unreachable = {} if only is None else dict(self.state.unreachable)
        for start in range(0, len(targets), PROBE_SLICE):
            if start:
                await asyncio.sleep(0)
            for node_id, listed in zip(
                targets[start : start + PROBE_SLICE],
                answers[start : start + PROBE_SLICE],
                strict=True,
            ):
                if isinstance(listed, set):
                    self.state.note_listed(listed, self.state.runners.on_node(node_id))
                unreachable.pop(node_id, None)
                if (found := self._silence(node_id, listed, moment, full=only is None)) is not None:
                    unreachable[node_id] = found
        self.state.set_unreachable(unreachable, asked_ns)

    def _silence(
        self, node_id: str, listed: set[str] | str | None, moment: float, *, full: bool
    ) -> UnreachableNode | None:
        """Note what `node_id` answered this round (a full one, or a recheck of silent
        nodes that counts no missed round): why it is unreachable, if it is."""
        node = self.state.nodes.get(node_id)
        if isinstance(listed, set):
            self._silent_probes.pop(node_id, None)
            self._missed_rounds.pop(node_id, None)
            if node is not None:
                return None
        else:
            self._silent_probes.setdefault(node_id, moment)
            self._missed_rounds[node_id] = self._missed_rounds.get(node_id, 0) + full
        ttl = self._layout.node_ttl_s
        beat = self._heartbeats.get(node_id)
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
        beat, stored = self._heartbeats.get(node_id), self._beats_stored.get(node_id)
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
        self._heartbeats = dict.fromkeys(self._heartbeats, moment)
        culprits = {r for i in self._incidents.values() for r in i.finding.culpritRunnerIds}
        self.state.forgive(moment, keep=culprits)

    # Queries

    async def _answer(self, view: str, request: Request) -> None:
        data = request.data or b"{}"
        query = self._heavy_timeline_query(view, data)
        if query is None:
            await request.respond(self._answerable(self._query(view, data)))
            return
        task = asyncio.create_task(self._respond_heavy(request, data, query))
        self._heavy.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._heavy.discard)

    def _heavy_timeline_query(self, view: str, data: bytes) -> TimelineQuery | None:
        if view != "timeline":
            return None
        try:
            query = decode(data, TimelineQuery)
        except WireError:
            return None  # answered as a bad query
        return query if query.limit > HEAVY_ENTRIES else None

    async def _respond_heavy(self, request: Request, data: bytes, query: TimelineQuery) -> None:
        async with self._heavy_lane:
            cached = self._cached(data)
            if cached is None:
                version = self.state.version
                cached = await self._timeline_in_slices(query)
                self._remember(data, version, cached)
        try:
            await request.respond(self._answerable(cached))
        except ServiceError as error:  # answered after the handler returned: by hand
            await request.respond_error(error.code, error.description)

    async def _timeline_in_slices(self, query: TimelineQuery) -> bytes:
        """The timeline's JSON, its entries encoded a slice at a time between turns of the
        other queries and of ingest (the plan holds what it needs of evicted entries)."""
        plan = self.state.timeline_plan(query, local_node_id=query.localNodeId or self._node_id)
        before, after = encode(plan.head).split(b'"timeline":[]', 1)
        pieces = [before, b'"timeline":[']
        for start in range(0, plan.size, SLICE_ENTRIES):
            if start:
                pieces.append(b",")
            pieces.append(encode(plan.entries(start, start + SLICE_ENTRIES))[1:-1])
            await asyncio.sleep(0)
        pieces += [b"]", after]
        return b"".join(pieces)  # one copy of tens of MB, not three

    def _answerable(self, body: bytes) -> bytes:
        if len(body) > self._nc.max_payload:
            raise _failed(
                413,
                f"the answer is {len(body):,} bytes, over the NATS "
                f"limit of {self._nc.max_payload:,}; narrow the query",
            )
        return body

    def _query(self, view: str, data: bytes) -> bytes:
        if view == "health":
            return encode(self.health())
        try:
            if view == "timeline":
                return self._timeline(data)
            if view == "placement":
                asked = decode(data, PlacementQuery)
                wanted = asked.runnerId
                found = self.state.placement(local_node_id=asked.localNodeId or self._node_id)
                if wanted is None:
                    return encode(found)
                for item in found:
                    if item.runnerId == wanted:
                        return encode(item)
                raise _failed(404, f"no placed runner {wanted!r}")
            if view == "diagnosis":
                return encode(
                    Diagnosis(
                        generatedAt=now(), findings=[i.finding for i in self._incidents.values()]
                    )
                )
            if view == "instances":
                return encode(self.state.instance_states())
            if view == "history":
                return encode(self.state.history())
        except WireError as exc:
            raise _failed(422, f"bad {view} query: {exc}") from None
        raise _failed(
            404,
            f"no view {view!r}; try timeline, placement, diagnosis, instances, history or health",
        )

    def _timeline(self, data: bytes) -> bytes:
        """Identical timeline queries within `ANSWER_REUSE_S` of each other, with nothing
        applied in between, share one answer: a roomful of browsers costs one build."""
        answer = self._cached(data)
        if answer is None:
            query = decode(data, TimelineQuery)
            local = query.localNodeId or self._node_id
            answer = encode(self.state.timeline(query, local_node_id=local))
            self._remember(data, self.state.version, answer)
        return answer

    def _cached(self, query: bytes) -> bytes | None:
        cached = self._answers.get(query)
        if (
            cached
            and cached[0] == self.state.version
            and self._clock() - cached[1] < ANSWER_REUSE_S
        ):
            return cached[2]
        return None

    def _remember(self, query: bytes, version: int, answer: bytes) -> None:
        """Keep `answer` for reuse within `ANSWER_CACHE_BYTES`, dropping the oldest."""
        if len(answer) > ANSWER_CACHE_BYTES // 2:
            return
        if (old := self._answers.pop(query, None)) is not None:
            self._answer_bytes -= len(old[2])
        while self._answers and self._answer_bytes + len(answer) > ANSWER_CACHE_BYTES:
            self._answer_bytes -= len(self._answers.pop(next(iter(self._answers)))[2])
        self._answers[query] = (version, self._clock(), answer)
        self._answer_bytes += len(answer)

    def health(self) -> dict[str, Any]:
        """Readiness and counters, for /readyz and /metrics."""
        return {
            "ready": self.ready.is_set() and self.reach.reachable and self.storage.storing,
            "partition": str(self.partition),
            "storageProblem": self.storage.why(),
            "natsReachable": self.reach.reachable,
            "natsOutages": self.reach.outages,
            "entries": self.state.store.size,
            "evictedEntries": self.state.store.evicted,
            "runners": len(self.state.runners),
            "duplicates": self.state.duplicates,
            "badMessages": dict(self.dead_letters.counts),
            "missingSeqs": {
                r: v.seqs.missing for r, v in self.state.runners.items() if v.seqs.missing
            },
            "openFindings": len(self._incidents),
            "queuedTasks": self.state.queued(),
            "slowConsumerDrops": slow_consumer_drops(),
            "followerRestarts": sum(f.restarts for f in self._followers),
            "clockOffsets": {n: round(o, 3) for n, o in self.clock_offsets.items()},
        }


async def _stopped(stop: asyncio.Event, seconds: float) -> bool:
    """Wait up to `seconds` for `stop`; whether it is set."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), max(0.0, seconds))
    return stop.is_set()


def _told(finding: Finding) -> tuple[object, ...]:
    """What an operator is told by a finding, but for its wording (which ages each second)."""
    return (
        finding.since,
        finding.kind,
        finding.culpritRunnerIds,
        finding.waitingRanks,
        [(e.gaveUp, e.exitReason, e.processAlive, e.capturedAt) for e in finding.evidence],
    )


def _failed(status: int, error: str) -> ServiceError:
    """A query the aggregator cannot answer, as a service error whose code is HTTP's."""
    return ServiceError(code=str(status), description=error)
