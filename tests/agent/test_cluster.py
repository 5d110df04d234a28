"""Two agents on loopback run the tiny model at world size 2 against a real nats-server:
readiness, correct text, the flight recorder in order and complete, a killed runner, and
a NATS outage in the middle of a generation."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js.api import DeliverPolicy

from rankscope.services.agent.main import serve_until
from rankscope.shared.connection import connect
from rankscope.shared.jetstream import Layout
from rankscope.shared.nats_server import EmbeddedNats
from rankscope.shared.provision import ensure
from rankscope.shared.settings import Settings
from rankscope.shared.timestamps import format_ts, now
from rankscope.shared.tiny_model import TinyModelSpec, write_tiny_model
from rankscope.shared.wire import (
    EvidenceRequest,
    FlightEntry,
    GenerationRequest,
    InstanceCreated,
    InstanceReleased,
    NodeDiagnostics,
    NodeEvidence,
    Phase,
    PhaseEntries,
    ProcessState,
    QueryError,
    ReleaseCause,
    RunnerAssignment,
    RunnerStatusChanged,
    RunnerStatusKind,
    RunnerTelemetry,
    TaskCreated,
    TaskEvent,
    TaskKind,
    TaskStatus,
    TaskStatusChanged,
    TokenChunk,
    decode,
    encode,
)
from tests.stack_up import free_port

pytestmark = [pytest.mark.slow, pytest.mark.nats, pytest.mark.asyncio(loop_scope="module")]

WAIT = 60.0
LAYERS = 5
PROMPT = "Which node holds layer seven?"
RANKS = ("i-a0-r0", "i-a0-r1")
SPEAKER = "node-b"
"""The node of the last rank, which sends the output."""


@dataclass
class Cluster:
    server: EmbeddedNats
    store: Path
    port: int
    nc: Client
    layout: Layout
    model: Path
    statuses: list[RunnerStatusChanged] = field(default_factory=list)
    entries: dict[str, list[FlightEntry]] = field(default_factory=dict)
    task_statuses: list[TaskStatusChanged] = field(default_factory=list)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def on_phase(self, msg: Msg) -> None:
        batch = decode(msg.data, PhaseEntries)
        async with self.changed:
            self.entries.setdefault(batch.runner.runnerId, []).extend(batch.entries)
            self.changed.notify_all()

    async def on_task(self, msg: Msg) -> None:
        event: TaskEvent = decode(msg.data, TaskEvent)
        if isinstance(event, TaskStatusChanged):
            async with self.changed:
                self.task_statuses.append(event)
                self.changed.notify_all()

    def completed(self, task_id: str) -> bool:
        return all(
            any(
                e.taskId == task_id and e.phase is Phase.COMPLETION for e in self.entries.get(r, [])
            )
            for r in RANKS
        )

    async def on_status(self, msg: Msg) -> None:
        event: RunnerTelemetry = decode(msg.data, RunnerTelemetry)
        if isinstance(event, RunnerStatusChanged):
            async with self.changed:
                self.statuses.append(event)
                self.changed.notify_all()

    async def until(self, check: Callable[[], bool]) -> None:
        try:
            async with self.changed:
                await asyncio.wait_for(self.changed.wait_for(check), WAIT)
        except TimeoutError:
            seen = [
                f"{s.runner.runnerId}:{s.statusKind.value}:{s.detail}" for s in self.statuses[-12:]
            ]
            raise AssertionError(f"not so within {WAIT:.0f} s; last statuses {seen}") from None

    def latest(self, runner_id: str) -> RunnerStatusChanged | None:
        mine = [s for s in self.statuses if s.runner.runnerId == runner_id]
        return max(mine, key=lambda s: s.seq) if mine else None

    def all_ready(self) -> bool:
        latest = [self.latest(r) for r in RANKS]
        return all(s is not None and s.statusKind is RunnerStatusKind.READY for s in latest)

    async def submit(
        self, command_id: str, max_tokens: int, deadline: str | None = None, prompt: str = PROMPT
    ) -> None:
        task = TaskCreated(
            at=now(),
            deadline=deadline,
            taskId=f"task-{command_id}",
            instanceId="i",
            taskKind=TaskKind.TEXT_GENERATION,
            commandId=command_id,
            request=GenerationRequest(prompt=prompt, maxTokens=max_tokens),
        )
        await self.nc.jetstream().publish(self.layout.subjects.tasks("i"), encode(task))

    async def generate(self, command_id: str, max_tokens: int = 20) -> tuple[str, str | None]:
        """Run a generation and collect its text, insisting no chunk went missing."""
        chunks: asyncio.Queue[TokenChunk] = asyncio.Queue()

        async def keep(msg: Msg) -> None:
            await chunks.put(decode(msg.data, TokenChunk))

        sub = await self.nc.subscribe(self.layout.subjects.output(command_id, SPEAKER), cb=keep)
        await self.submit(command_id, max_tokens)
        text, seqs = "", list[int]()
        while True:
            chunk = await asyncio.wait_for(chunks.get(), WAIT)
            text, seqs = text + chunk.text, [*seqs, chunk.seq]
            if chunk.finishReason:
                break
        await sub.unsubscribe()
        assert seqs == list(range(len(seqs)))
        return text, chunk.finishReason

    async def diagnostics(self, node_id: str) -> NodeDiagnostics:
        reply = await self.nc.request(self.layout.subjects.node_diagnostics(node_id), b"", 5)
        return decode(reply.data, NodeDiagnostics)

    async def evidence(self, node_id: str, *runner_ids: str) -> NodeEvidence:
        request = encode(EvidenceRequest(runnerIds=list(runner_ids)))
        reply = await self.nc.request(self.layout.subjects.node_evidence(node_id), request, 5)
        return decode(reply.data, NodeEvidence)

    async def stored(self) -> list[RunnerTelemetry]:
        js = self.nc.jetstream()
        info = await js.stream_info(self.layout.runner_stream.name)
        sub = await js.subscribe(
            self.layout.subjects.runner_all(),
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.ALL,
        )
        found: list[RunnerTelemetry] = []
        for _ in range(info.state.messages):
            found.append(decode((await sub.next_msg(timeout=5)).data, RunnerTelemetry))
        await sub.unsubscribe()
        return found


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cluster]:
    root = tmp_path_factory.mktemp("cluster")
    model = write_tiny_model(root / "model", TinyModelSpec(layers=LAYERS, hidden=64))
    port, store = free_port(), root / "nats"
    server = EmbeddedNats(store_dir=store, port=port).start()
    layout = Layout()
    nc = await connect(Settings(nats_url=server.url), "cluster-test")
    await ensure(nc.jetstream(), layout)
    built = Cluster(server=server, store=store, port=port, nc=nc, layout=layout, model=model)
    await nc.subscribe(f"{layout.subjects.prefix}.runner.*.*.*.status", cb=built.on_status)
    await nc.subscribe(f"{layout.subjects.prefix}.runner.*.*.*.phase", cb=built.on_phase)
    await nc.subscribe(layout.subjects.tasks_all(), cb=built.on_task)
    stops = [asyncio.Event(), asyncio.Event()]
    agents = [
        asyncio.create_task(
            serve_until(
                Settings(
                    nats_url=server.url, node_id=node, data_dir=root / node, collective_timeout=5.0
                ),
                stop,
            )
        )
        for node, stop in zip(("node-a", "node-b"), stops, strict=True)
    ]
    ports = (free_port(), free_port())
    assignments = [
        RunnerAssignment(
            runnerId=RANKS[0],
            nodeId="node-a",
            deviceRank=0,
            worldSize=2,
            startLayer=0,
            endLayer=2,
            nLayers=LAYERS,
            host="127.0.0.1",
            port=ports[0],
        ),
        RunnerAssignment(
            runnerId=RANKS[1],
            nodeId="node-b",
            deviceRank=1,
            worldSize=2,
            startLayer=2,
            endLayer=LAYERS,
            nLayers=LAYERS,
            host="127.0.0.1",
            port=ports[1],
        ),
    ]
    placed = InstanceCreated(
        at=now(),
        instanceId="i",
        runnerSpecId="spec",
        modelId="tiny",
        modelPath=str(model),
        assignments=assignments,
    )
    await nc.jetstream().publish(layout.subjects.placement("i"), encode(placed))
    await built.until(built.all_ready)
    yield built
    for stop in stops:
        stop.set()
    await asyncio.gather(*agents)
    await nc.close()
    built.server.stop()


async def test_both_ranks_load_only_their_shard(cluster: Cluster) -> None:
    a, b = await cluster.diagnostics("node-a"), await cluster.diagnostics("node-b")
    ((ra,), (rb,)) = a.runners, b.runners
    assert (ra.deviceRank, ra.startLayer, ra.endLayer) == (0, 0, 2)
    assert (rb.deviceRank, rb.startLayer, rb.endLayer) == (1, 2, LAYERS)
    assert ra.processAlive
    assert rb.processAlive
    assert ra.statusKind == rb.statusKind == "RunnerReady"
    loaded = {r.runnerId: e.attrs for r in (ra, rb) for e in r.entries if e.event == "loaded"}
    full = (cluster.model / "model.safetensors").stat().st_size
    assert loaded[RANKS[0]]["layers"] == 2
    assert loaded[RANKS[1]]["layers"] == 3
    for attrs in loaded.values():
        assert 0 < attrs["parameterBytes"] < full  # type: ignore[operator]


async def test_generation_matches_single_process_mlx_lm(cluster: Cluster) -> None:
    import mlx_lm

    text, finish = await cluster.generate("cmd-same")
    loaded = mlx_lm.load(str(cluster.model))
    expected = mlx_lm.generate(loaded[0], loaded[1], prompt=PROMPT, max_tokens=20)
    assert text == expected
    assert finish == "length"


LIFECYCLE = [Phase.CREATED, Phase.CONNECT_GROUP, Phase.LOAD_MODEL, Phase.WARMUP, Phase.IDLE]
TASK = [
    Phase.TASK_SUBMISSION,
    Phase.TASK_AGREEMENT,
    Phase.PROMPT_BUILD,
    Phase.KV_CACHE_LOOKUP,
    Phase.PREFILL_PIPELINE,
    Phase.DECODE_WAIT_FIRST_TOKEN,
    Phase.DECODE_STREAM,
    Phase.PARSER,
    Phase.COMPLETION,
]


def _in_order(phases: list[Phase], order: list[Phase]) -> bool:
    firsts = [phases.index(p) for p in order]
    return firsts == sorted(firsts)


async def test_every_rank_records_every_phase_in_order_with_steps(cluster: Cluster) -> None:
    await cluster.generate("cmd-order", max_tokens=6)
    await cluster.until(lambda: cluster.completed("task-cmd-order"))
    steps = {}
    for runner_id in RANKS:
        entries = sorted(cluster.entries[runner_id], key=lambda e: e.seq)
        ready = next(i for i, e in enumerate(entries) if e.event == "runner_ready")
        assert _in_order([e.phase for e in entries[: ready + 1]], LIFECYCLE)
        task = [e for e in entries if e.taskId == "task-cmd-order"]
        assert _in_order([e.phase for e in task], TASK), f"{runner_id}: {task}"
        steps[runner_id] = [e.attrs["step"] for e in task if e.phase is Phase.DECODE_STREAM]
        assert steps[runner_id] == sorted(steps[runner_id])
    assert steps[RANKS[0]] == steps[RANKS[1]]  # the ranks move in lockstep


async def test_each_rank_reports_its_task_status(cluster: Cluster) -> None:
    await cluster.generate("cmd-status", max_tokens=3)

    def reported() -> set[tuple[str | None, TaskStatus]]:
        return {
            (e.runnerId, e.taskStatus)
            for e in cluster.task_statuses
            if e.taskId == "task-cmd-status"
        }

    wanted = {(r, s) for r in RANKS for s in (TaskStatus.RUNNING, TaskStatus.COMPLETE)}
    await cluster.until(lambda: wanted <= reported())


async def test_a_task_past_its_deadline_is_timed_out_by_each_rank_and_never_run(
    cluster: Cluster,
) -> None:
    await cluster.submit("cmd-late", 3, deadline=format_ts(datetime.now(UTC) - timedelta(1)))
    await cluster.generate("cmd-after")  # served next, in order, as if the late one were not

    def reported() -> set[tuple[str | None, TaskStatus]]:
        return {
            (e.runnerId, e.taskStatus) for e in cluster.task_statuses if e.taskId == "task-cmd-late"
        }

    await cluster.until(lambda: {(r, TaskStatus.TIMED_OUT) for r in RANKS} <= reported())
    assert reported() == {(r, TaskStatus.TIMED_OUT) for r in RANKS}
    assert not any(e.commandId == "cmd-late" for r in RANKS for e in cluster.entries[r])


async def test_a_prompt_past_the_model_s_context_is_refused_by_every_rank_at_once(
    cluster: Cluster,
) -> None:
    long = " ".join(f"{n}-{n * 7 % 13}" for n in range(6000))  # far past 4,096 tokens
    await cluster.submit("cmd-long", 4, prompt=long)

    def refused() -> list[TaskStatusChanged]:
        return [s for s in cluster.task_statuses if s.taskId == "task-cmd-long" and s.refused]

    await cluster.until(lambda: len(refused()) == len(RANKS))
    assert all("the model's context is 4,096" in (s.detail or "") for s in refused())
    text, _ = await cluster.generate("cmd-after-long", max_tokens=3)  # and it serves on
    assert text


def _seqs(stored: list[RunnerTelemetry], runner_id: str) -> list[int]:
    seqs: list[int] = []
    for message in stored:
        if message.runner.runnerId != runner_id:
            continue
        seqs += (
            [e.seq for e in message.entries] if isinstance(message, PhaseEntries) else [message.seq]
        )
    return sorted(seqs)


def _complete(stored: list[RunnerTelemetry], task_id: str) -> bool:
    """Both ranks finished `task_id` and each rank's seqs run from 0 without a gap."""
    for runner_id in RANKS:
        seqs = _seqs(stored, runner_id)
        finished = any(
            e.taskId == task_id and e.phase is Phase.COMPLETION
            for m in stored
            if isinstance(m, PhaseEntries) and m.runner.runnerId == runner_id
            for e in m.entries
        )
        if not finished or seqs != list(range(len(seqs))):
            return False
    return True


async def test_a_nats_outage_during_generation_loses_no_entry(cluster: Cluster) -> None:
    await cluster.submit("cmd-outage", max_tokens=200)
    await cluster.until(
        lambda: any(
            e.taskId == "task-cmd-outage" and e.phase is Phase.DECODE_STREAM
            for e in cluster.entries.get(RANKS[1], [])
        )
    )
    cluster.server.stop()
    await asyncio.sleep(5)  # the outage
    cluster.server = EmbeddedNats(store_dir=cluster.store, port=cluster.port).start()
    # Our own subscriptions may miss what the agents publish right after they reconnect,
    # so the stream itself is the witness: poll it until the generation is in, in full.
    stored: list[RunnerTelemetry] = []
    for _ in range(150):
        with contextlib.suppress(NatsError, TimeoutError):  # we may still be reconnecting
            stored = await cluster.stored()
            if _complete(stored, "task-cmd-outage"):
                break
        await asyncio.sleep(0.2)
    for runner_id in RANKS:
        seqs = _seqs(stored, runner_id)
        assert seqs == list(range(len(seqs))), f"{runner_id} has gaps or duplicates"
    assert _complete(stored, "task-cmd-outage")


async def test_a_runner_killed_mid_generation_is_failed_with_its_signal_and_the_cluster_heals(
    cluster: Cluster,
) -> None:
    chunks: asyncio.Queue[Msg] = asyncio.Queue()
    await cluster.nc.subscribe(cluster.layout.subjects.output("cmd-killed", SPEAKER), cb=chunks.put)
    await cluster.submit("cmd-killed", max_tokens=2000)
    await asyncio.wait_for(chunks.get(), WAIT)  # it is generating
    (victim,) = (await cluster.diagnostics("node-b")).runners
    assert victim.pid is not None
    os.kill(victim.pid, signal.SIGKILL)

    def task_failed() -> dict[str, str | None]:
        return {
            e.runnerId or "": e.detail
            for e in cluster.task_statuses
            if e.taskId == "task-cmd-killed" and e.taskStatus is TaskStatus.FAILED
        }

    # the task can never finish: every rank says so, and nobody waits on it forever
    await cluster.until(lambda: set(RANKS) <= set(task_failed()))
    assert task_failed()[RANKS[1]] == "the runner died: killed by SIGKILL"

    def failed() -> list[RunnerStatusChanged]:  # it may be restarting already
        return [
            s
            for s in cluster.statuses
            if s.runner.runnerId == RANKS[1] and s.statusKind is RunnerStatusKind.FAILED
        ]

    await cluster.until(lambda: bool(failed()))
    status = failed()[-1]
    assert status.signal == "SIGKILL"
    assert status.detail is not None
    assert status.detail.startswith("killed by SIGKILL")
    entries = (await cluster.diagnostics("node-b")).runners[0].entries
    error = [e for e in entries if e.phase is Phase.ERROR]
    assert error[-1].event == "process_exited"
    assert error[-1].detail == "killed by SIGKILL"
    await cluster.until(cluster.all_ready)  # the peer's watchdog fires, both restart
    text, _ = await cluster.generate("cmd-healed", max_tokens=4)
    assert text


async def test_the_peer_of_a_killed_runner_records_the_lost_connection(cluster: Cluster) -> None:
    await cluster.until(cluster.all_ready)
    errors = [e for e in cluster.entries[RANKS[0]] if e.phase is Phase.ERROR]
    if errors[0].detail == "watchdog: a collective did not finish in time":
        # mlx's ring does not always fail a collective whose peer died (a send that meets
        # the closed socket can leave it waiting for good): then its deadline names it
        timeouts = [e for e in cluster.entries[RANKS[0]] if e.event == "pipeline_eval_timeout"]
        assert timeouts[0].attrs["site"]
        return
    assert errors[0].detail == "[ring] connection to a peer was lost"
    assert errors[0].event == "peer_lost"  # a victim of its peer, in the collective it was in
    assert errors[0].attrs["exception"] == "RuntimeError"
    site = errors[0].attrs["site"]
    assert isinstance(site, str)
    failed = [
        s.detail or ""
        for s in cluster.statuses
        if s.runner.runnerId == RANKS[0] and s.statusKind is RunnerStatusKind.FAILED
    ]
    assert failed[0] == "RuntimeError: [ring] connection to a peer was lost"  # its own word
    assert failed[1] == f"lost its peer in {site} (exit code 1); restarting"  # its agent's
    assert errors[0].mlxMemory is not None


async def test_a_stopped_peer_trips_the_watchdog_with_a_breadcrumb(cluster: Cluster) -> None:
    await cluster.until(cluster.all_ready)
    (victim,) = (await cluster.diagnostics("node-b")).runners
    assert victim.pid is not None
    os.kill(victim.pid, signal.SIGSTOP)  # alive but wedged: its socket stays open
    try:
        await asyncio.sleep(1.5)  # the idle peer meets it within a tick (1 s) and waits
        (stopped,) = (await cluster.evidence("node-b", RANKS[1], "not-here")).runners
        assert (stopped.process, stopped.stack) == (ProcessState.STOPPED, None)
        (waiting,) = (await cluster.evidence("node-a", RANKS[0])).runners
        assert waiting.process is ProcessState.SLEEPING  # blocked in the collective
        assert waiting.stack is not None
        # the line it waits on: agreeing on the next task, or decoding one still queued
        assert "in _agree" in waiting.stack or "generation.py" in waiting.stack, waiting.stack
        assert waiting.mlxMemory is not None
        bad = await cluster.nc.request(cluster.layout.subjects.node_evidence("node-a"), b"[]", 5)
        assert decode(bad.data, QueryError).status == 422
        await cluster.until(
            lambda: any(e.event == "pipeline_eval_timeout" for e in cluster.entries[RANKS[0]])
        )
    finally:
        os.kill(victim.pid, signal.SIGCONT)
    entries = cluster.entries[RANKS[0]]
    (breadcrumb,) = [e for e in entries if e.event == "pipeline_eval_timeout"]
    before = entries[: entries.index(breadcrumb)]
    # it said it was waiting (and where) long before its deadline, not idle: in the task
    # agreement when idle, in decode_stream when a chat of an earlier test still decoded
    said = [e for e in before if e.event == "collective_wait"][-1]
    site = said.attrs["site"]
    assert site in ("task_agreement", "decode_stream")
    assert said.phase.value == site
    assert breadcrumb.attrs["site"] == site
    assert breadcrumb.detail == f"{site} did not finish within 5s"
    assert breadcrumb.mlxMemory is not None

    def wedge_reported() -> bool:
        return any(
            s.runner.runnerId == RANKS[0] and (s.detail or "").startswith("watchdog")
            for s in cluster.statuses
        )

    await cluster.until(wedge_reported)
    await cluster.until(cluster.all_ready)


async def test_a_cancel_stops_every_rank_at_the_same_step(cluster: Cluster) -> None:
    chunks: asyncio.Queue[TokenChunk] = asyncio.Queue()

    async def keep(msg: Msg) -> None:
        await chunks.put(decode(msg.data, TokenChunk))

    await cluster.nc.subscribe(cluster.layout.subjects.output("cmd-cancel", SPEAKER), cb=keep)
    await cluster.submit("cmd-cancel", max_tokens=2000)
    await asyncio.wait_for(chunks.get(), WAIT)  # it is generating
    cancel = TaskCreated(
        at=now(),
        taskId="cancel-1",
        instanceId="i",
        taskKind=TaskKind.CANCEL_TASK,
        targetTaskId="task-cmd-cancel",
    )
    await cluster.nc.jetstream().publish(cluster.layout.subjects.tasks("i"), encode(cancel))
    while (chunk := await asyncio.wait_for(chunks.get(), WAIT)).finishReason is None:
        pass
    assert chunk.finishReason == "cancelled"
    wanted = {(r, TaskStatus.CANCELLED) for r in RANKS}
    await cluster.until(
        lambda: (
            wanted
            <= {
                (e.runnerId, e.taskStatus)
                for e in cluster.task_statuses
                if e.taskId == "task-cmd-cancel"
            }
        )
    )
    await cluster.until(lambda: cluster.completed("task-cmd-cancel"))
    observed = {
        r: [e.attrs["step"] for e in cluster.entries[r] if e.phase is Phase.CANCEL_OBSERVED]
        for r in RANKS
    }
    assert observed[RANKS[0]] == observed[RANKS[1]]
    assert len(observed[RANKS[0]]) == 1
    assert all(any(e.phase is Phase.CANCEL_REQUESTED for e in cluster.entries[r]) for r in RANKS)


async def test_a_runner_that_cannot_load_fails_with_the_reason_and_is_not_restarted(
    cluster: Cluster,
) -> None:
    rank = RunnerAssignment(
        runnerId="broken-a0-r0",
        nodeId="node-a",
        deviceRank=0,
        worldSize=1,
        startLayer=0,
        endLayer=LAYERS,
        nLayers=LAYERS,
        host="127.0.0.1",
        port=free_port(),
    )
    placed = InstanceCreated(
        at=now(),
        instanceId="broken",
        runnerSpecId="spec",
        modelId="tiny",
        modelPath="/nonexistent/model",
        assignments=[rank],
    )
    await cluster.nc.jetstream().publish(
        cluster.layout.subjects.placement("broken"), encode(placed)
    )

    def gave_up() -> bool:
        latest = cluster.latest("broken-a0-r0")
        return latest is not None and "not restarted" in (latest.detail or "")

    await cluster.until(gave_up)
    failures = [
        s
        for s in cluster.statuses
        if s.runner.runnerId == "broken-a0-r0" and s.statusKind is RunnerStatusKind.FAILED
    ]
    assert any("FileNotFoundError" in (s.detail or "") for s in failures)
    errors = [e for e in cluster.entries["broken-a0-r0"] if e.phase is Phase.ERROR]
    assert errors[0].event == "FileNotFoundError"
    assert errors[0].attrs["failedIn"] == "load_model"
    assert errors[0].attrs["permanent"] is True
    latest = cluster.latest("broken-a0-r0")
    assert latest is not None
    assert latest.detail == (
        "it could not load its model; not restarted: the same error would recur on every start"
    )
    (broken,) = [
        r for r in (await cluster.diagnostics("node-a")).runners if r.runnerId == "broken-a0-r0"
    ]
    assert not broken.processAlive
    assert broken.restarts == 0  # one try: no restart loop
    assert len(failures) == 2  # its own word and its agent's, once


async def test_release_shuts_every_runner_down(cluster: Cluster) -> None:
    released = InstanceReleased(
        at=now(), instanceId="i", cause=ReleaseCause.SPEC_DELETED, reason="test over"
    )
    await cluster.nc.jetstream().publish(cluster.layout.subjects.placement("i"), encode(released))

    def shut_down() -> bool:
        latest = [cluster.latest(r) for r in RANKS]
        return all(s is not None and s.statusKind is RunnerStatusKind.SHUTDOWN for s in latest)

    await cluster.until(shut_down)
    await cluster.until(
        lambda: all(
            any(e.phase is Phase.SHUTDOWN_CLEANUP for e in cluster.entries[r]) for r in RANKS
        )
    )
    for node in ("node-a", "node-b"):
        runners = (await cluster.diagnostics(node)).runners
        assert all(r.instanceId != "i" for r in runners)


async def test_a_runner_released_while_it_starts_ends_at_once_on_sigterm(
    cluster: Cluster,
) -> None:
    """Its peer never comes (no agent on that node; its port takes connections and says
    nothing): it waits in the ring's connect, where it has no task to finish, so a release
    ends it at once rather than after the grace a serving rank gets to stop with its peers
    (it was SIGKILLed 6 s later, or its connect gave up first)."""
    ranks = [
        RunnerAssignment(
            runnerId=f"waiting-r{rank}",
            nodeId=node,
            deviceRank=rank,
            worldSize=2,
            startLayer=rank * LAYERS // 2,
            endLayer=(rank + 1) * LAYERS // 2,
            nLayers=LAYERS // 2,
            host="127.0.0.1",
            port=free_port(),
        )
        for rank, node in enumerate(("node-a", "node-absent"))
    ]
    placed = InstanceCreated(
        at=now(),
        instanceId="waiting",
        runnerSpecId="spec",
        modelId="tiny",
        modelPath=str(cluster.model),
        assignments=ranks,
    )
    js, subjects = cluster.nc.jetstream(), cluster.layout.subjects
    silent_peer = socket.create_server(("127.0.0.1", ranks[1].port))
    await js.publish(subjects.placement("waiting"), encode(placed))

    def connecting() -> bool:
        latest = cluster.latest("waiting-r0")
        return latest is not None and latest.statusKind is RunnerStatusKind.CONNECTING

    await cluster.until(connecting)
    released = InstanceReleased(
        at=now(), instanceId="waiting", cause=ReleaseCause.SPEC_DELETED, reason="test over"
    )
    await js.publish(subjects.placement("waiting"), encode(released))

    def shut_down() -> bool:
        latest = cluster.latest("waiting-r0")
        return latest is not None and latest.statusKind is RunnerStatusKind.SHUTDOWN

    await cluster.until(shut_down)
    silent_peer.close()
    latest = cluster.latest("waiting-r0")
    assert latest is not None
    assert (latest.signal, latest.detail) == (
        "SIGTERM",
        "stopped while starting (killed by SIGTERM)",
    )
    assert RunnerStatusKind.FAILED not in {
        s.statusKind for s in cluster.statuses if s.runner.instanceId == "waiting"
    }
