"""The rank-table service's I/O: follow specs, nodes and runner status; place; publish
placement events, rank tables and spec status.

State is rebuilt from the placement stream and the buckets on start, so a restart keeps
every placement that is still alive. One reconcile runs at a time; every input only marks
the world dirty, so bursts of changes coalesce into one pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
from nats.js.kv import KeyValue

from rankscope.services.ranktable.catalog import SHAPE_RETRY_S, Catalog
from rankscope.services.ranktable.hub import TableHub
from rankscope.services.ranktable.models import ModelShapes
from rankscope.services.ranktable.nodes import LiveNodes
from rankscope.services.ranktable.placement import MAX_RUNNERS_PER_NODE, Plan, plan
from rankscope.services.ranktable.recorded import RecordedJobs, RecordLimits, release_due
from rankscope.services.ranktable.state import (
    PlacementState,
    Readiness,
    apply_placement,
    apply_status,
    misplaced,
)
from rankscope.services.ranktable.tables import rank_table
from rankscope.shared.buckets import follow_bucket
from rankscope.shared.connection import unless_stopped
from rankscope.shared.deadletter import DeadLetters
from rankscope.shared.headers import VERSION_HEADER
from rankscope.shared.inputs import BadInputError, parse_telemetry
from rankscope.shared.jetstream import Layout, publish_acked
from rankscope.shared.model_shape import ModelShape
from rankscope.shared.replay import Follower, follow
from rankscope.shared.specs import MAX_REPLICAS
from rankscope.shared.subjects import token, untoken
from rankscope.shared.timestamps import now, to_epoch
from rankscope.shared.wire import (
    InstanceCreated,
    InstanceReleased,
    PlacementEvent,
    RankTable,
    RankTableStream,
    RecordedRank,
    Registered,
    RunnerMetrics,
    RunnerSpecStatus,
    RunnerStatusChanged,
    WireError,
    decode,
    encode,
)

__all__ = ["RankTableService"]

log = logging.getLogger(__name__)


class RankTableService:
    """Places Runner specs onto live nodes and keeps every job's rank table current.

    Args:
        js: JetStream context.
        layout: streams and buckets of this installation.
        hub: where in-process subscribers (gRPC) follow rank tables.
        port_base: first ring port handed out per node.
        max_replicas: the most instances one spec may ask for.
        max_runners_per_node: the most runners placed on one node, every spec together.
        clock: monotonic seconds, for node expiry.
        shapes: where the shapes of models given by path are asked (the nodes); without
            it, such specs wait.
        connected: whether NATS is reachable. While it is not, or while every node (of two
            or more) is silent at once, silence proves nothing: no node expires, and every
            node gets a whole TTL once heartbeats are back.
        nc: the connection recorded ranks register over (`rankscope record`); without
            it, none can.
        record_limits: what recorded jobs may take (ranks per node, deadlines).
        wall_clock: seconds since the epoch, for recorded jobs' deadlines.
    """

    def __init__(
        self,
        *,
        js: JetStreamContext,
        layout: Layout,
        hub: TableHub,
        port_base: int,
        max_replicas: int = MAX_REPLICAS,
        max_runners_per_node: int = MAX_RUNNERS_PER_NODE,
        clock: Callable[[], float] = time.monotonic,
        shapes: ModelShapes | None = None,
        connected: Callable[[], bool] = lambda: True,
        nc: Client | None = None,
        record_limits: RecordLimits | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._js = js
        self._nc = nc
        self._recorded = RecordedJobs(limits=record_limits or RecordLimits())
        self._wall_clock = wall_clock
        self._wakeup: asyncio.TimerHandle | None = None
        self._placing = asyncio.Lock()
        """Held while placement events are decided and published (reconcile, a rank's
        registration): each decides on the state the last one left."""
        self._shapes = shapes
        self._layout = layout
        self._hub = hub
        self._port_base = port_base
        self._max_runners_per_node = max_runners_per_node
        self._clock = clock
        self._dirty = asyncio.Event()
        self.dead_letters = DeadLetters(
            js=js, subject=layout.subjects.deadletter("ranktable"), service="ranktable"
        )
        self._catalog = Catalog(max_replicas=max_replicas, shapes=shapes, clock=clock)
        self._nodes = LiveNodes(
            bucket=layout.nodes_bucket.bucket,
            ttl=layout.node_ttl_s,
            dead_letters=self.dead_letters,
            changed=self._dirty.set,
            connected=connected,
            clock=clock,
        )
        self._state = PlacementState()
        self._readiness = Readiness()
        self._tables: dict[str, tuple[int, RankTable]] = {}
        self._statuses: dict[str, RunnerSpecStatus] = {}
        self._status_kv: KeyValue | None = None
        self.ready = asyncio.Event()

    @property
    def placements(self) -> dict[str, InstanceCreated]:
        """Live instances by id."""
        return dict(self._state.instances)

    async def run(self, stop: asyncio.Event) -> None:
        """Rebuild, then place and publish on every change until `stop` is set (a stop
        while it rebuilds ends it there)."""
        subjects = self._layout.subjects
        if not await unless_stopped(self._rebuild(), stop):
            return
        status = await follow(
            self._js,
            subjects.runner_status_all(),
            self._on_status,
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
        )
        nodes_kv = await self._js.key_value(self._layout.nodes_bucket.bucket)
        self._status_kv = await self._js.key_value(self._layout.runner_status_bucket.bucket)
        followers = (
            status,
            await follow_bucket(
                self._js, self._layout.runners_bucket.bucket, self._on(self._catalog.on_spec)
            ),
            await follow_bucket(
                self._js, self._layout.nodes_bucket.bucket, self._on(self._nodes.on_node)
            ),
        )
        async with asyncio.TaskGroup() as tasks:
            expiry = tasks.create_task(self._nodes.expire_forever(nodes_kv, stop))
            for follower in followers:
                await follower.caught_up.wait()
            self._dirty.set()  # the first pass makes it ready, on an empty installation too
            reconciler = tasks.create_task(self._reconcile_forever(stop))
            registrations = None
            if self._nc is not None:
                registrations = await self._nc.subscribe(
                    subjects.record_register_all(), cb=self._on_register
                )
            await stop.wait()
            if registrations is not None:
                await registrations.unsubscribe()
            reconciler.cancel()
            expiry.cancel()
        for follower in followers:
            await follower.stop()

    async def _on_register(self, msg: Msg) -> None:
        """A recorded rank asks who it is; its job is announced once its world is whole."""
        answer = await self._registered(msg)
        if answer is None:
            return  # not answered: the rank asks again
        if answer.refused is not None:
            self.dead_letters.reject(msg.subject, msg.data, "registration_refused", answer.refused)
        if msg.reply:
            with contextlib.suppress(NatsError):
                await msg.respond(encode(answer))

    async def _registered(self, msg: Msg) -> Registered | None:
        """The answer to a registration; None when its job could not be announced now
        (NATS away): a rank that hears nothing asks again, one refused gives up."""
        node = untoken(msg.subject.rsplit(".", 1)[-1])
        try:
            rank = decode(msg.data, RecordedRank)
        except WireError as exc:
            return Registered(refused=f"not a valid registration: {str(exc)[:200]}")
        if rank.nodeId != node:
            return Registered(
                refused=f"a rank on node {rank.nodeId!r} registered on node {node!r}'s subject"
            )
        try:
            async with self._placing:
                decision = self._recorded.register(
                    rank, self._state.instances, self._state.attempts, self._wall_clock()
                )
                for event in decision.publish:
                    await self._publish_placement(event, msg_id=self._msg_id(event))
        except (TimeoutError, NatsError, OSError) as exc:
            log.warning("job %s not announced now, its rank will ask again: %s", rank.jobId, exc)
            return None
        self._dirty.set()  # its rank table, the deadline of its gathering
        return Registered(
            runner=decision.runner, announced=decision.announced, refused=decision.refused
        )

    async def _rebuild(self) -> None:
        await self._replay_placements()
        await self._replay_tables()

    async def _replay_placements(self) -> None:
        async def handle(msg: Msg) -> None:
            event: PlacementEvent | None = self.dead_letters.decoded(
                msg, PlacementEvent, "placement_undecodable"
            )
            if event is not None:
                sequence = msg.metadata.sequence.stream
                stream = msg.metadata.stream
                self._state = apply_placement(self._state, event, sequence, stream)

        subjects = self._layout.subjects
        for subject in (subjects.placement_all(), subjects.recorded_all()):  # the older first
            await self._drain(follow(self._js, subject, handle))
        for instance in self._state.instances.values():
            if self._shapes and instance.modelPath and instance.modelBytes:
                layers = instance.assignments[0].nLayers
                self._shapes.learn(instance.modelPath, ModelShape(layers, instance.modelBytes))

    async def _replay_tables(self) -> None:
        async def handle(msg: Msg) -> None:
            try:
                wire = decode(msg.data, RankTableStream)
                table = decode(wire.rankTable, RankTable)
                version = int((msg.headers or {}).get(VERSION_HEADER, "0"))
            except (WireError, ValueError) as exc:
                self.dead_letters.reject(msg.subject, msg.data, "ranktable_undecodable", exc)
                return
            self._tables[wire.jobId] = (version, table)
            self._hub.publish(wire.jobId, version, wire)

        await self._drain(
            follow(
                self._js,
                self._layout.subjects.ranktable_all(),
                handle,
                deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
            )
        )

    @staticmethod
    async def _drain(starting: Awaitable[Follower]) -> None:
        follower = await starting
        try:
            await follower.caught_up.wait()
        finally:
            await follower.stop()

    async def _on_status(self, msg: Msg) -> None:
        try:
            event = parse_telemetry(msg.data, msg.subject, self._layout.subjects)
        except BadInputError as exc:  # undecodable, or a node speaking for another's runner
            self.dead_letters.reject(msg.subject, msg.data, exc.kind, exc)
            return
        if isinstance(event, RunnerStatusChanged):
            if (why := misplaced(self._state, event.runner)) is not None:
                self.dead_letters.reject(msg.subject, msg.data, "telemetry_identity", why)
                return
            self._readiness = apply_status(self._readiness, event)
            self._dirty.set()

    def _on(
        self, apply: Callable[[KeyValue.Entry], None]
    ) -> Callable[[KeyValue.Entry], Awaitable[None]]:
        """`apply` an entry of a bucket, then mark the world dirty."""

        async def handle(entry: KeyValue.Entry) -> None:
            apply(entry)
            self._dirty.set()

        return handle

    def _placed_nodes(self) -> set[str]:
        return {a.nodeId for i in self._state.instances.values() for a in i.assignments}

    async def _reconcile_forever(self, stop: asyncio.Event) -> None:
        await self._nodes.back(self._placed_nodes, stop)
        while not stop.is_set():
            await self._dirty.wait()
            self._dirty.clear()
            try:
                async with self._placing:
                    await self.reconcile()
            except (TimeoutError, NatsError, OSError) as exc:
                log.warning("reconcile failed, retrying: %s", exc)
                await asyncio.sleep(0.5)
                self._dirty.set()
            self.ready.set()

    async def reconcile(self) -> Plan:
        """Place, release, then publish every changed rank table and spec status."""
        if await self._catalog.shape_waiting(sorted(self._nodes.views)):
            asyncio.get_running_loop().call_later(SHAPE_RETRY_S, self._dirty.set)
        placed = {i: p for i, p in self._state.instances.items() if p.recorded is None}
        specs = self._catalog.placeable()
        decided = plan(
            specs,
            self._nodes.views,
            placed,
            self._state.attempts,
            port_base=self._port_base,
            max_runners_per_node=self._max_runners_per_node,
        )
        for release in decided.releases:
            instance = self._state.instances[release.instance_id]
            await self._publish_placement(
                InstanceReleased(
                    at=now(),
                    instanceId=release.instance_id,
                    cause=release.cause,
                    reason=release.reason,
                ),
                msg_id=f"{release.instance_id}:released:{instance.attempt}",
            )
            log.info("released %s: %s", release.instance_id, release.reason)
        await self._release_ended()
        for new in decided.placements:
            await self._publish_placement(
                InstanceCreated(
                    at=now(),
                    instanceId=new.instance_id,
                    runnerSpecId=new.spec.runner_id,
                    modelId=new.spec.model_id,
                    modelPath=new.spec.model_path,
                    modelBytes=new.spec.shape.model_bytes,
                    attempt=new.attempt,
                    specDigest=new.spec.digest,
                    assignments=list(new.assignments),
                ),
                msg_id=f"{new.instance_id}:created:{new.attempt}",
            )
            layers = ", ".join(f"{a.nodeId}[{a.startLayer},{a.endLayer})" for a in new.assignments)
            log.info("placed %s: %s", new.instance_id, layers)
        await self._publish_tables()
        await self._publish_statuses(decided, {s.runner_id: s.revision for s in specs})
        return decided

    def _msg_id(self, event: InstanceCreated | InstanceReleased) -> str:
        """The dedupe id of a placement event: the instance's attempt is in it, so a retry
        is one event and the next placement another."""
        if isinstance(event, InstanceCreated):
            return f"{event.instanceId}:created:{event.attempt}"
        return f"{event.instanceId}:released:{self._state.instances[event.instanceId].attempt}"

    async def _release_ended(self) -> None:
        """Release the recorded jobs whose every rank has ended, or that a rank never
        reported to, and forget gathering ranks that stopped asking; wake up again when
        the next one may go."""
        moment = self._wall_clock()
        wake = [self._recorded.expire(moment)]
        for instance in list(self._state.instances.values()):
            due = release_due(instance, self._readiness.status, self._recorded.limits)
            if due is None:
                continue
            if due.at > moment:
                wake.append(due.at)
                continue
            event = InstanceReleased(
                at=now(), instanceId=instance.instanceId, cause=due.cause, reason=due.reason
            )
            await self._publish_placement(event, msg_id=self._msg_id(event))
            log.info("released %s: %s", instance.instanceId, event.reason)
        if self._wakeup is not None:
            self._wakeup.cancel()
        if times := [t for t in wake if t is not None]:
            delay = max(min(times) - moment, 0.0) + 0.01
            self._wakeup = asyncio.get_running_loop().call_later(delay, self._dirty.set)

    async def _publish_placement(
        self, event: InstanceCreated | InstanceReleased, msg_id: str
    ) -> None:
        concerned = (
            self._state.instances.get(event.instanceId)
            if isinstance(event, InstanceReleased)
            else event
        )  # a recorded job's events go to its own stream
        recorded = concerned is not None and concerned.recorded is not None
        subjects = self._layout.subjects
        subject = (subjects.recorded if recorded else subjects.placement)(event.instanceId)
        ack = await publish_acked(self._js, subject, encode(event), msg_id=msg_id)
        self._state = apply_placement(self._state, event, ack.seq, ack.stream)

    def _jobs(self) -> set[str]:
        """Jobs that have a rank table: every replica of a spec, and what is placed."""
        wanted = {s.instance_id(r) for s in self._catalog.placeable() for r in range(s.replicas)}
        return wanted | set(self._state.instances)

    async def _publish_tables(self) -> None:
        jobs = self._jobs()
        gone = set(self._tables) - jobs  # its spec deleted, its instance released
        for job_id in sorted(jobs | gone):
            table = rank_table(self._state.instances.get(job_id), self._readiness.is_ready)
            version, previous = self._tables.get(job_id, (0, None))
            if table == previous:
                continue
            version += 1
            wire = RankTableStream(jobId=job_id, rankTable=encode(table).decode())
            await publish_acked(
                self._js,
                self._layout.subjects.ranktable(job_id),
                encode(wire),
                msg_id=f"{job_id}:{version}",
                headers={VERSION_HEADER: str(version)},
            )
            self._tables[job_id] = (version, table)
            self._hub.publish(job_id, version, wire)
            log.info("rank table %s v%d %s", job_id, version, table.status.value)
        for job_id in sorted(gone):  # followers saw its last, empty table: now it goes
            await self._js.purge_stream(
                self._layout.ranktable_stream.name, subject=self._layout.subjects.ranktable(job_id)
            )
            del self._tables[job_id]
            self._hub.forget(job_id)
            log.info("rank table %s removed: no spec wants it, nothing is placed", job_id)

    def _metrics(self, spec_id: str) -> RunnerMetrics:
        instances = [i for i in self._state.instances.values() if i.runnerSpecId == spec_id]
        runners = [a.runnerId for i in instances for a in i.assignments]
        ready = [r for r in runners if self._readiness.is_ready(r)]
        moment = time.time()
        running = sum(
            moment - to_epoch(self._readiness.ready_since[r])
            for r in ready
            if r in self._readiness.ready_since
        )
        return RunnerMetrics(
            pods_total=len(runners),
            pods_running=len(ready),
            total_pods_running_time_s=max(int(running), 0),
            pods_preempted_total=self._state.preempted_pods.get(spec_id, 0),
        )

    def _instances_of(self, spec_id: str) -> list[str]:
        return sorted(i for i, p in self._state.instances.items() if p.runnerSpecId == spec_id)

    async def _publish_statuses(self, decided: Plan, judged: dict[str, int]) -> None:
        statuses = self._catalog.statuses(
            decided.refusals, self._instances_of, self._metrics, judged
        )
        for spec_id, status in statuses.items():
            if self._statuses.get(spec_id) != status and self._status_kv is not None:
                stamped = msgspec.structs.replace(status, updated_at=now())
                await self._status_kv.put(token(spec_id), encode(stamped))
                self._statuses[spec_id] = status
        for spec_id in set(self._statuses) - set(self._catalog.records):  # deleted specs
            if self._status_kv is not None:
                await self._status_kv.delete(token(spec_id))
            del self._statuses[spec_id]
