"""The node agent's core: follow placements for this node, run a supervisor per local
rank, feed them their instance's tasks, and answer live diagnostics requests."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from rankscope.services.agent.runner.config import RunnerConfig, Timeouts
from rankscope.services.agent.runner.entry import unsupported
from rankscope.services.agent.supervisor import RunnerSupervisor
from rankscope.shared.deadletter import DeadLetters
from rankscope.shared.host import hostname
from rankscope.shared.jetstream import Layout
from rankscope.shared.logs import structured
from rankscope.shared.model_shape import UnreadableModelError, read_shape
from rankscope.shared.nats_auth import agent_user
from rankscope.shared.replay import Follower, follow
from rankscope.shared.subjects import token
from rankscope.shared.telemetry import TelemetryPublisher
from rankscope.shared.timestamps import now
from rankscope.shared.wire import (
    EvidenceRequest,
    InstanceCreated,
    InstanceReleased,
    ModelShapeAnswer,
    ModelShapeRequest,
    NodeDiagnostics,
    NodeEvidence,
    NodeInfo,
    PhaseEntries,
    PlacementEvent,
    QueryError,
    RunnerRef,
    RunnerTelemetry,
    TaskCreated,
    TaskEvent,
    TaskKind,
    TaskStatus,
    TaskStatusChanged,
    TokenChunk,
    WireError,
    decode,
    encode,
)

__all__ = ["Agent"]

log = logging.getLogger(__name__)


class Agent:
    """Everything one node runs.

    Args:
        nc: NATS connection (core publishes and request/reply).
        js: JetStream context.
        layout: streams and buckets.
        node: describes this node (its id, name and address).
        publisher: telemetry publisher shared by the runners.
        timeouts: deadlines handed to every runner.
    """

    def __init__(
        self,
        *,
        nc: Client,
        js: JetStreamContext,
        layout: Layout,
        node: Callable[[], NodeInfo],
        publisher: TelemetryPublisher,
        timeouts: Timeouts | None = None,
    ) -> None:
        self._nc = nc
        self._js = js
        self._layout = layout
        self._node = node
        self._node_id = node().nodeId
        self._publisher = publisher
        self._timeouts = timeouts or Timeouts()
        self.supervisors: dict[str, RunnerSupervisor] = {}
        self._releasing: set[asyncio.Future[list[None]]] = set()
        """Releases under way: their runners are out of `supervisors`, not yet ended."""
        self._placed: dict[str, InstanceCreated] = {}
        self._task_followers: dict[str, Follower] = {}
        self._final_tasks: set[str] = set()
        self._started_tasks: set[str] = set()
        """Tasks some rank started: one read again after a restart was interrupted by it."""
        self._held: dict[str, list[tuple[int, TaskCreated]]] = {}
        """Tasks of each instance read while its task stream is replayed: only once it is
        read to the end is it known which of them finished meanwhile."""
        self._replays: set[asyncio.Task[None]] = set()
        self._outputs: set[asyncio.Task[None]] = set()
        self._replayed: dict[str, PlacementEvent] | None = {}
        """The latest placement event of each instance while the stream is replayed (None
        once caught up): what is released by then never starts a runner."""
        self._placing = asyncio.Lock()
        self._submitting = asyncio.Lock()
        """Held per agent while tasks go to ranks: in stream order, each read whole first."""
        self._stacks = Path(tempfile.mkdtemp(prefix="rankscope-stacks-"))
        """Where runners write their stacks when asked (removed at shutdown)."""
        self.dead_letters = DeadLetters(
            js=js,
            subject=layout.subjects.deadletter(agent_user(self._node_id)),
            service=f"agent {self._node_id}",
        )

    async def on_placement(self, msg: Msg) -> None:
        """Start, keep or stop local runners to match the latest placement of an instance;
        while the stream is replayed, only note it (see `catch_up`)."""
        event: PlacementEvent | None = self.dead_letters.decoded(
            msg, PlacementEvent, "placement_undecodable"
        )
        if event is None:
            return
        if self._replayed is not None:
            self._replayed[event.instanceId] = event
            return
        async with self._placing:
            await self._apply(event)

    async def catch_up(self) -> None:
        """Act on the placement as it stands once the stream is replayed: runners for the
        instances still placed here, none for those released meanwhile."""
        async with self._placing:
            replayed, self._replayed = self._replayed or {}, None
            for event in replayed.values():
                if isinstance(event, InstanceCreated):
                    await self._apply(event)

    async def _apply(self, event: PlacementEvent) -> None:
        if isinstance(event, InstanceReleased):
            await self._release_instance(event.instanceId, keep=set())
            return
        local = [a for a in event.assignments if a.nodeId == self._node_id]
        if event.recorded is not None:
            local = []  # a recorded job's ranks run themselves
        await self._release_instance(event.instanceId, keep={a.runnerId for a in local})
        if not local:
            return
        self._placed[event.instanceId] = event
        for assignment in local:
            if assignment.runnerId in self.supervisors:
                continue
            ref = RunnerRef(
                runnerId=assignment.runnerId,
                nodeId=self._node_id,
                instanceId=event.instanceId,
                modelId=event.modelId,
                deviceRank=assignment.deviceRank,
                worldSize=assignment.worldSize,
            )
            config = RunnerConfig(
                runner=ref,
                assignment=assignment,
                assignments=tuple(event.assignments),
                model_path=event.modelPath or "",
                timeouts=self._timeouts,
                stack_path=str(self._stacks / f"{token(assignment.runnerId)}.stacks"),
            )
            supervisor = RunnerSupervisor(
                config=config,
                subjects=self._layout.subjects,
                publisher=self._publisher,
                first_seq=await self._resume_seq(ref),
                on_output=self._output,
                on_task=functools.partial(self._task_status, ref),
            )
            self.supervisors[assignment.runnerId] = supervisor
            supervisor.start()
        if event.instanceId not in self._task_followers:
            subjects = self._layout.subjects
            self._held[event.instanceId] = []
            follower = await follow(
                self._js,
                subjects.tasks(event.instanceId),
                self._on_task,
                also=[subjects.task_statuses(event.instanceId)],
                deletes=False,  # an agent may delete no consumer, its own neither
            )
            self._task_followers[event.instanceId] = follower
            waiting = asyncio.create_task(self._release_held(event.instanceId, follower))
            self._replays.add(waiting)
            waiting.add_done_callback(self._replays.discard)

    async def _resume_seq(self, ref: RunnerRef) -> int:
        """One past the highest `seq` this runner already has in the stream."""
        last = -1
        for kind in ("phase", "memory", "status"):
            subject = self._layout.subjects.runner(ref.nodeId, ref.instanceId, ref.deviceRank, kind)
            stored = await self._last_stored(subject)
            if stored is None:
                continue
            try:
                event: RunnerTelemetry = decode(stored, RunnerTelemetry)
            except WireError:
                continue
            if event.runner.runnerId != ref.runnerId:
                continue
            seqs = (
                [e.seq for e in event.entries] if isinstance(event, PhaseEntries) else [event.seq]
            )
            last = max(last, *seqs)
        return last + 1

    async def _last_stored(self, subject: str) -> bytes | None:
        """The last telemetry stored under `subject`, if any; asks again while NATS cannot
        answer, as a runner started without it would reuse `seq`s (dropped as duplicates)."""
        delay = 0.5
        while True:
            try:
                raw = await self._js.get_last_msg(
                    self._layout.runner_stream.name, subject, direct=True
                )
            except NotFoundError:
                return None
            except (NatsError, TimeoutError) as exc:
                log.warning("cannot read %s (%s); asking again in %gs", subject, exc, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 5.0)
            else:
                return raw.data

    async def _release_instance(self, instance_id: str, keep: set[str]) -> None:
        released = [
            self.supervisors.pop(runner_id)
            for runner_id, supervisor in list(self.supervisors.items())
            if supervisor.config.runner.instanceId == instance_id and runner_id not in keep
        ]
        releasing = asyncio.gather(*(supervisor.release() for supervisor in released))
        self._releasing.add(releasing)
        releasing.add_done_callback(self._releasing.discard)
        await releasing
        if not keep:
            self._placed.pop(instance_id, None)
            self._held.pop(instance_id, None)
            follower = self._task_followers.pop(instance_id, None)
            if follower is not None:
                await follower.stop()

    async def _on_task(self, msg: Msg) -> None:
        event: TaskEvent | None = self.dead_letters.decoded(msg, TaskEvent, "task_undecodable")
        if event is None:
            return
        if isinstance(event, TaskStatusChanged):
            if event.taskStatus.is_final:
                self._final_tasks.add(event.taskId)
            elif event.taskStatus is TaskStatus.RUNNING:
                self._started_tasks.add(event.taskId)
            return
        follower = self._task_followers.get(event.instanceId)
        held = self._held.get(event.instanceId)
        if held is not None and (follower is None or not follower.caught_up.is_set()):
            held.append((msg.metadata.sequence.stream, event))
            return
        async with self._submitting:
            await self._submit_held(event.instanceId)
            await self._submit(msg.metadata.sequence.stream, event, replayed=False)

    async def _release_held(self, instance_id: str, follower: Follower) -> None:
        """Submit what the replay of an instance's tasks held once it is read to the end."""
        await follower.caught_up.wait()
        if self._task_followers.get(instance_id) is follower:
            async with self._submitting:
                await self._submit_held(instance_id)

    async def _submit_held(self, instance_id: str) -> None:
        held = self._held.pop(instance_id, None)
        for seq, event in held or ():
            await self._submit(seq, event, replayed=True)

    async def _submit(self, seq: int, event: TaskCreated, *, replayed: bool) -> None:
        """Hand a task to this node's ranks of its instance, unless it is done already, for
        an earlier placement, past its deadline or its request unreadable (said so as this
        rank's status once)."""
        placed = self._placed.get(event.instanceId)
        if placed is None or event.at < placed.at or event.taskId in self._final_tasks:
            return
        if replayed and event.taskId in self._started_tasks:
            why = TaskStatus.FAILED, "a restart interrupted it; it is not run twice"
        elif event.expired(time.time()):
            why = TaskStatus.TIMED_OUT, "its deadline passed before this rank could start it"
        elif (whole := await self._whole(event)) is None:
            why = TaskStatus.FAILED, "its request could not be read from NATS"
        else:
            for supervisor in self._local(event.instanceId):
                supervisor.submit(seq, whole)
            return
        log.info("task %s of %s not started: %s", event.taskId, event.instanceId, why[1])
        self._final_tasks.add(event.taskId)
        for supervisor in self._local(event.instanceId):
            self._task_status(supervisor.config.runner, event.taskId, *why, False)

    def _local(self, instance_id: str) -> list[RunnerSupervisor]:
        return [s for s in self.supervisors.values() if s.config.runner.instanceId == instance_id]

    async def _whole(self, event: TaskCreated) -> TaskCreated | None:
        """`event` with its request: a generation's as this node's copy holds it (the tasks
        stream carries none); None when that copy is missing, not this task's, or unread
        by the task's deadline while NATS cannot answer."""
        if event.taskKind is not TaskKind.TEXT_GENERATION or event.request is not None:
            return event
        stream = self._layout.inputs_stream.name
        subject = self._layout.subjects.task_input(self._node_id, event.instanceId, event.taskId)
        delay = 0.1
        while True:
            try:
                raw = await self._js.get_last_msg(stream, subject, direct=True)
                whole = decode(raw.data or b"", TaskCreated)
            except NotFoundError:
                log.warning("task %s has no request for this node on %s", event.taskId, subject)
                return None
            except WireError as exc:
                log.warning("the request of task %s is unreadable: %s", event.taskId, exc)
                return None
            except (NatsError, TimeoutError) as exc:
                if event.expired(time.time() + delay):
                    return None
                log.warning("cannot read task %s (%s); asking again", event.taskId, exc)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 2.0)
                continue
            same = (whole.taskId, whole.instanceId) == (event.taskId, event.instanceId)
            return whole if same and whole.request is not None else None

    def _output(self, chunk: TokenChunk) -> None:
        # Core NATS, in order: tasks start in the order they are created.
        subject = self._layout.subjects.output(chunk.commandId, self._node_id)
        task = asyncio.get_running_loop().create_task(self._nc.publish(subject, encode(chunk)))
        self._outputs.add(task)
        task.add_done_callback(self._outputs.discard)

    def _task_status(
        self, ref: RunnerRef, task_id: str, status: TaskStatus, detail: str | None, refused: bool
    ) -> None:
        event = TaskStatusChanged(
            at=now(),
            taskId=task_id,
            instanceId=ref.instanceId,
            taskStatus=status,
            runnerId=ref.runnerId,
            detail=detail,
            refused=refused,
        )
        subject = self._layout.subjects.task_status(ref.instanceId, self._node_id)
        msg_id = f"{task_id}:{ref.runnerId}:{status.value}"
        self._publisher.message(subject, encode(event), msg_id)

    async def answer(self, msg: Msg) -> None:
        """Reply to a live diagnostics request with every supervisor's state."""
        node = self._node()
        reply = NodeDiagnostics(
            nodeId=node.nodeId,
            friendlyName=node.friendlyName,
            address=node.address,
            generatedAt=now(),
            runners=[s.live() for s in self.supervisors.values()],
            hostname=hostname(),
            cwd=os.getcwd(),
            agentVersion=node.agentVersion,
            structuredLogging=structured(),
            pythonUnbuffered=bool(os.environ.get("PYTHONUNBUFFERED")),
        )
        await msg.respond(encode(reply))

    async def evidence(self, msg: Msg) -> None:
        """Reply to an evidence request with what its runners (those here) look like now."""
        try:
            wanted = decode(msg.data or b"{}", EvidenceRequest)
        except WireError as exc:
            await msg.respond(encode(QueryError(status=422, error=str(exc))))
            return
        here = [
            self.supervisors[r] for r in dict.fromkeys(wanted.runnerIds) if r in self.supervisors
        ]
        captured = await asyncio.gather(*(s.capture() for s in here))
        await msg.respond(encode(NodeEvidence(nodeId=self._node_id, runners=list(captured))))

    async def model(self, msg: Msg) -> None:
        """Reply to a model-shape request with the layers and weight bytes of the model at
        the path given, as this node reads it, or why it cannot, and whether its mlx-lm can
        run it split."""
        try:
            asked = decode(msg.data or b"{}", ModelShapeRequest)
        except WireError as exc:
            await msg.respond(encode(QueryError(status=422, error=str(exc))))
            return
        answer = ModelShapeAnswer(nodeId=self._node_id, modelPath=asked.modelPath)
        path = Path(asked.modelPath)
        try:
            shape = await asyncio.to_thread(read_shape, path)
        except UnreadableModelError as exc:
            answer = msgspec.structs.replace(answer, error=f"{asked.modelPath!r}: {exc}")
        else:
            answer = msgspec.structs.replace(
                answer,
                nLayers=shape.n_layers,
                modelBytes=shape.model_bytes,
                kvSharedLayers=shape.kv_shared_layers,
                unsupported=await asyncio.to_thread(unsupported, path),
            )
        await msg.respond(encode(answer))

    async def shutdown(self) -> None:
        """Release every runner and stop following tasks."""
        for waiting in list(self._replays):
            waiting.cancel()
        instances = {s.config.runner.instanceId for s in self.supervisors.values()}
        await asyncio.gather(*(self._release_instance(i, keep=set()) for i in instances))
        await asyncio.gather(*self._releasing)  # those begun before, by a release placed
        for follower in self._task_followers.values():
            await follower.stop()
        self._task_followers.clear()
        shutil.rmtree(self._stacks, ignore_errors=True)
