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
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from services.ranktable.hub import TableHub
from services.ranktable.models import ModelShapes
from services.ranktable.placement import MAX_RUNNERS_PER_NODE, NodeView, Plan, plan
from services.ranktable.state import (
    PlacementState,
    Readiness,
    apply_placement,
    apply_status,
    misplaced,
)
from services.ranktable.tables import rank_table
from shared.deadletter import DeadLetters
from shared.headers import VERSION_HEADER
from shared.inputs import BadInputError, parse_telemetry
from shared.jetstream import Layout, publish_acked
from shared.model_shape import ModelShape, Unsupported
from shared.replay import Follower, follow, follow_bucket
from shared.specs import MAX_REPLICAS, PlacementSpec, SpecError, validate
from shared.subjects import kv_key, token, untoken
from shared.timestamps import now, to_epoch
from shared.wire import (
    InstanceCreated,
    InstanceReleased,
    NodeInfo,
    PlacementEvent,
    RankTable,
    RankTableStream,
    Runner,
    RunnerMetrics,
    RunnerSpecStatus,
    RunnerStatusChanged,
    WireError,
    decode,
    encode,
)

__all__ = ["RankTableService"]

log = logging.getLogger(__name__)

SHAPE_RETRY_S = 5.0
"""Seconds between asking the nodes again for a model's shape none could tell."""


async def _no_shapes() -> str:
    return "this rank-table service asks no node"


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
    ) -> None:
        self._js = js
        self._shapes = shapes
        self._pending: dict[str, PlacementSpec] = {}
        """Specs whose model's shape no node has told yet (an older revision runs on)."""
        self._unshaped: dict[str, str] = {}
        self._asked: dict[str, float] = {}
        self._connected = connected
        self._layout = layout
        self._hub = hub
        self._port_base = port_base
        self._max_replicas = max_replicas
        self._max_runners_per_node = max_runners_per_node
        self._clock = clock
        self._specs: dict[str, PlacementSpec] = {}
        self._refused: dict[str, tuple[int, str]] = {}
        self._nodes: dict[str, NodeView] = {}
        self._deadlines: dict[str, float] = {}
        self._state = PlacementState()
        self._readiness = Readiness()
        self._tables: dict[str, tuple[int, RankTable]] = {}
        self._statuses: dict[str, RunnerSpecStatus] = {}
        self._status_kv: KeyValue | None = None
        self._dirty = asyncio.Event()
        self.ready = asyncio.Event()
        self.dead_letters = DeadLetters(
            js=js, subject=layout.subjects.deadletter("ranktable"), service="ranktable"
        )

    @property
    def placements(self) -> dict[str, InstanceCreated]:
        """Live instances by id."""
        return dict(self._state.instances)

    async def run(self, stop: asyncio.Event) -> None:
        """Rebuild, then place and publish on every change until `stop` is set."""
        subjects = self._layout.subjects
        await self._replay_placements()
        await self._replay_tables()
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
                self._js, self._layout.runners_bucket.bucket, self._on(self._on_spec)
            ),
            await follow_bucket(
                self._js, self._layout.nodes_bucket.bucket, self._on(self._on_node)
            ),
        )
        async with asyncio.TaskGroup() as tasks:
            expiry = tasks.create_task(self._expire_nodes(nodes_kv, stop))
            for follower in followers:
                await follower.caught_up.wait()
            reconciler = tasks.create_task(self._reconcile_forever(stop))
            await stop.wait()
            reconciler.cancel()
            expiry.cancel()
        for follower in followers:
            await follower.stop()

    async def _replay_placements(self) -> None:
        async def handle(msg: Msg) -> None:
            event: PlacementEvent | None = self.dead_letters.decoded(
                msg, PlacementEvent, "placement_undecodable"
            )
            if event is not None:
                self._state = apply_placement(self._state, event, msg.metadata.sequence.stream)

        await self._drain(follow(self._js, self._layout.subjects.placement_all(), handle))
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
        await follower.caught_up.wait()
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

    def _on_spec(self, entry: KeyValue.Entry) -> None:
        spec_id = untoken(entry.key)
        self._refused.pop(spec_id, None)
        self._pending.pop(spec_id, None)
        self._unshaped.pop(spec_id, None)
        self._asked.pop(spec_id, None)
        if entry.operation is not None:  # deleted or purged
            self._specs.pop(spec_id, None)
            return
        revision = entry.revision or 0
        try:
            runner = decode(entry.value or b"", Runner)
            if runner.id and runner.id != spec_id:
                raise SpecError(f"id {runner.id!r} does not match its key {spec_id!r}")
            spec = validate(
                msgspec.structs.replace(runner, id=spec_id), revision, self._max_replicas
            )
            known = self._shapes.known(spec.model_path or "") if self._shapes else None
            if spec.model is None and known is not None:
                spec = spec.shaped(known)
        except (WireError, SpecError) as exc:
            self._specs.pop(spec_id, None)
            self._refused[spec_id] = (revision, f"rejected: {exc}")
            log.warning("Runner spec rejected: %s", exc, extra={"runnerId": spec_id})
            return
        if spec.model is None:
            self._pending[spec_id] = spec
        else:
            self._specs[spec_id] = spec

    async def _shape_pending(self) -> None:
        """Ask the live nodes for the shapes of the pending specs' models, each spec at
        most every `SHAPE_RETRY_S`; a spec whose shape is told joins the placeable ones."""
        moment = self._clock()
        due = {
            spec_id: spec
            for spec_id, spec in self._pending.items()
            if self._asked.get(spec_id, -SHAPE_RETRY_S) + SHAPE_RETRY_S <= moment
        }
        if not due:
            return
        nodes = sorted(self._nodes)
        asked = [
            self._shapes.ask(spec.model_path or "", nodes) if self._shapes else _no_shapes()
            for spec in due.values()
        ]
        for (spec_id, spec), found in zip(due.items(), await asyncio.gather(*asked), strict=True):
            self._asked[spec_id] = moment
            if self._pending.get(spec_id) is not spec:
                continue  # changed while the nodes were asked
            if isinstance(found, Unsupported):
                del self._pending[spec_id]
                self._unshaped.pop(spec_id, None)
                self._refused[spec_id] = (spec.revision, f"rejected: {found.reason}")
                log.warning("Runner spec rejected: %s", found.reason, extra={"runnerId": spec_id})
                continue
            if isinstance(found, str):
                self._unshaped[spec_id] = (
                    f"waiting for its model's shape: no node could read metadata.modelPath "
                    f"{spec.model_path!r} ({found})"
                )
                continue
            del self._pending[spec_id]
            self._unshaped.pop(spec_id, None)
            try:
                self._specs[spec_id] = spec.shaped(found)
            except SpecError as exc:
                self._specs.pop(spec_id, None)
                self._refused[spec_id] = (spec.revision, f"rejected: {exc}")
        if self._pending:
            asyncio.get_running_loop().call_later(SHAPE_RETRY_S, self._dirty.set)

    def _on_node(self, entry: KeyValue.Entry) -> None:
        node_id = untoken(entry.key)
        if entry.operation is not None:
            self._forget_node(node_id, "left")
            return
        try:
            info = decode(entry.value or b"", NodeInfo)
        except WireError as exc:
            subject = kv_key(self._layout.nodes_bucket.bucket, entry.key)
            self.dead_letters.reject(subject, entry.value, "node_undecodable", exc)
            return
        self._nodes[node_id] = NodeView.of(info)
        self._deadlines[node_id] = self._clock() + self._layout.node_ttl_s

    def _forget_node(self, node_id: str, how: str) -> None:
        if self._nodes.pop(node_id, None) is not None:
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
        self._on_node(entry)
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

    async def _expire_nodes(self, kv: KeyValue, stop: asyncio.Event) -> None:
        period, ttl, outage = self._layout.node_ttl_s / 4, self._layout.node_ttl_s, False
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
                        self._forget_node(node_id, "lost: no heartbeat within the TTL")
                        self._dirty.set()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), period)

    async def _nodes_back(self, stop: asyncio.Event) -> None:
        """After a restart, give the nodes of live instances one TTL to be heard before
        deciding anything: agents restarted along with this service have not sent their
        first heartbeat yet, and their instances are theirs to keep."""
        deadline = self._clock() + self._layout.node_ttl_s
        while not stop.is_set() and self._clock() < deadline:
            placed = {a.nodeId for i in self._state.instances.values() for a in i.assignments}
            if placed <= set(self._nodes):
                return
            await asyncio.sleep(0.1)
        missing = sorted(
            {a.nodeId for i in self._state.instances.values() for a in i.assignments}
            - set(self._nodes)
        )
        if missing:
            log.warning("not heard within the TTL since start: %s", ", ".join(missing))

    async def _reconcile_forever(self, stop: asyncio.Event) -> None:
        await self._nodes_back(stop)
        while not stop.is_set():
            await self._dirty.wait()
            self._dirty.clear()
            try:
                await self.reconcile()
            except (TimeoutError, NatsError, OSError) as exc:
                log.warning("reconcile failed, retrying: %s", exc)
                await asyncio.sleep(0.5)
                self._dirty.set()
            self.ready.set()

    async def reconcile(self) -> Plan:
        """Place, release, then publish every changed rank table and spec status."""
        await self._shape_pending()
        decided = plan(
            self._specs.values(),
            self._nodes,
            self._state.instances,
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
        await self._publish_statuses(decided)
        return decided

    async def _publish_placement(
        self, event: InstanceCreated | InstanceReleased, msg_id: str
    ) -> None:
        subject = self._layout.subjects.placement(event.instanceId)
        ack = await publish_acked(self._js, subject, encode(event), msg_id=msg_id)
        self._state = apply_placement(self._state, event, ack.seq)

    def _jobs(self) -> set[str]:
        """Jobs that have a rank table: every replica of a spec, and what is placed."""
        wanted = {s.instance_id(r) for s in self._specs.values() for r in range(s.replicas)}
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

    async def _publish_statuses(self, decided: Plan) -> None:
        statuses: dict[str, RunnerSpecStatus] = {}
        for spec_id, (revision, reason) in self._refused.items():
            statuses[spec_id] = RunnerSpecStatus(
                runner_id=spec_id,
                revision=revision,
                accepted=False,
                reason=reason,
                runner_metrics=self._metrics(spec_id),
                updated_at="",
            )
        for spec_id, spec in self._pending.items():
            statuses[spec_id] = RunnerSpecStatus(
                runner_id=spec_id,
                revision=spec.revision,
                accepted=True,
                reason=self._unshaped.get(spec_id, "waiting for its model's shape"),
                instances=sorted(
                    i for i, p in self._state.instances.items() if p.runnerSpecId == spec_id
                ),
                runner_metrics=self._metrics(spec_id),
                updated_at="",
            )
        for spec_id, spec in self._specs.items():
            if spec_id in self._pending:
                continue  # its new revision waits for a shape: said above
            statuses[spec_id] = RunnerSpecStatus(
                runner_id=spec_id,
                revision=spec.revision,
                accepted=True,
                reason=decided.refusals.get(spec_id),
                instances=sorted(
                    i for i, p in self._state.instances.items() if p.runnerSpecId == spec_id
                ),
                runner_metrics=self._metrics(spec_id),
                updated_at="",
            )
        for spec_id, status in statuses.items():
            if self._statuses.get(spec_id) != status and self._status_kv is not None:
                stamped = msgspec.structs.replace(status, updated_at=now())
                await self._status_kv.put(token(spec_id), encode(stamped))
                self._statuses[spec_id] = status
        for spec_id in set(self._statuses) - set(statuses):
            if self._status_kv is not None:
                await self._status_kv.delete(token(spec_id))
            del self._statuses[spec_id]
