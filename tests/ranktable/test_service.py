"""The rank-table service against a real nats-server: placement from KV, rank tables on
NATS and gRPC, readiness, node loss, restarts and bad specs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import signal
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import msgspec
import pytest
from mlx_lm import __version__ as mlx_lm_version
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, NotFoundError

from rankscope.services.agent.agent import Agent
from rankscope.services.lifecycle import StartError
from rankscope.services.ranktable.grpc_server import serve
from rankscope.services.ranktable.grpcapi import config_pb2, config_pb2_grpc
from rankscope.services.ranktable.hub import TableHub
from rankscope.services.ranktable.models import ModelShapes
from rankscope.services.ranktable.service import RankTableService
from rankscope.shared.headers import VERSION_HEADER
from rankscope.shared.heartbeat import Heartbeat
from rankscope.shared.jetstream import Layout
from rankscope.shared.provision import ensure
from rankscope.shared.subjects import MAX_TOKEN, token
from rankscope.shared.telemetry import TelemetryPublisher
from rankscope.shared.timestamps import now
from rankscope.shared.tiny_model import TinyModelSpec, write_tiny_model
from rankscope.shared.wire import (
    InstanceCreated,
    NodeInfo,
    PlacementEvent,
    RankTable,
    RankTableStatus,
    RankTableStream,
    Runner,
    RunnerRef,
    RunnerSpecStatus,
    RunnerStatusChanged,
    RunnerStatusKind,
    decode,
    encode,
)
from tests.ranktable.builders import node_info, runner

pytestmark = pytest.mark.nats

WAIT = 10.0


@dataclass
class Stack:
    js: JetStreamContext
    nc: Client
    layout: Layout
    hub: TableHub
    grpc_target: str
    service: RankTableService | None = None
    stop: asyncio.Event | None = None
    task: asyncio.Task[None] | None = None

    async def start(self, shapes: ModelShapes | None = None) -> RankTableService:
        self.stop = asyncio.Event()
        self.service = RankTableService(
            js=self.js, layout=self.layout, hub=self.hub, port_base=52000, shapes=shapes
        )
        self.task = asyncio.create_task(self.service.run(self.stop))
        await asyncio.wait_for(self.service.ready.wait(), WAIT)
        return self.service

    async def halt(self) -> None:
        assert self.stop is not None
        assert self.task is not None
        self.stop.set()
        await self.task

    async def put_node(self, info: NodeInfo) -> None:
        kv = await self.js.key_value(self.layout.nodes_bucket.bucket)
        await kv.put(token(info.nodeId), encode(info))

    async def put_spec(self, spec: Runner | bytes, key: str | None = None) -> None:
        kv = await self.js.key_value(self.layout.runners_bucket.bucket)
        if isinstance(spec, Runner):
            key, spec = key or spec.id, encode(spec)
        assert key is not None
        await kv.put(token(key), spec)

    async def status(
        self, spec_id: str, until: Callable[[RunnerSpecStatus], bool] = lambda _: True
    ) -> RunnerSpecStatus:
        """The spec's status, once `until` holds (statuses follow the rank tables)."""
        kv = await self.js.key_value(self.layout.runner_status_bucket.bucket)
        for _ in range(int(WAIT / 0.05)):
            with contextlib.suppress(KeyNotFoundError):
                status = decode((await kv.get(token(spec_id))).value or b"", RunnerSpecStatus)
                if until(status):
                    return status
            await asyncio.sleep(0.05)
        raise AssertionError(f"the status of {spec_id!r} never got there")

    async def report(
        self,
        instance: InstanceCreated,
        kind: RunnerStatusKind,
        seq: int = 1,
        publisher: str | None = None,
        claimed: bool = False,
    ) -> None:
        """Every rank's status, each on its node's subject (or all on `publisher`'s, the
        payload saying it runs there when `claimed`)."""
        for a in instance.assignments:
            ref = RunnerRef(
                runnerId=a.runnerId,
                nodeId=publisher if claimed and publisher else a.nodeId,
                instanceId=instance.instanceId,
                modelId=instance.modelId,
                deviceRank=a.deviceRank,
                worldSize=a.worldSize,
            )
            event = RunnerStatusChanged(
                runner=ref,
                seq=seq,
                at=now(),
                statusKind=kind,
                processAlive=True,
                pid=1000 + a.deviceRank,
            )
            subject = self.layout.subjects.runner(
                publisher or a.nodeId, instance.instanceId, a.deviceRank, "status"
            )
            await self.js.publish(subject, encode(event))


async def _stack(nc: Client, layout: Layout) -> AsyncIterator[Stack]:
    js = nc.jetstream()
    await ensure(js, layout)
    hub = TableHub()
    server, port = await serve(hub, "127.0.0.1", 0)
    stack = Stack(js=js, nc=nc, layout=layout, hub=hub, grpc_target=f"127.0.0.1:{port}")
    yield stack
    if stack.task is not None and not stack.task.done():
        await stack.halt()
    await server.stop(0)


@pytest.fixture
async def stack(nc: Client, layout: Layout) -> AsyncIterator[Stack]:
    async for built in _stack(nc, layout):
        yield built


@pytest.fixture
async def fast_stack(nc: Client, layout: Layout) -> AsyncIterator[Stack]:
    """A stack whose node entries live 2 s without a heartbeat."""
    async for built in _stack(nc, replace(layout, node_ttl_s=2.0)):
        yield built


async def _next(queue: asyncio.Queue[Msg]) -> Msg:
    return await asyncio.wait_for(queue.get(), WAIT)


async def _tables(stack: Stack, job: str) -> asyncio.Queue[Msg]:
    queue: asyncio.Queue[Msg] = asyncio.Queue()
    await stack.nc.subscribe(stack.layout.subjects.ranktable(job), cb=queue.put)
    return queue


async def _placed_and_following(stack: Stack) -> asyncio.Queue[Msg]:
    """Two nodes, the service, one placed 2-rank instance, and its rank tables from v2 on."""
    await stack.put_node(node_info("node-a", 24))
    await stack.put_node(node_info("node-b", 8))
    await stack.start()
    await _place(stack, runner())
    await _until_version(stack, "llm-0", 1)
    return await _tables(stack, "llm-0")


def _table(msg: Msg) -> tuple[int, RankTable]:
    wire = decode(msg.data, RankTableStream)
    return int((msg.headers or {})[VERSION_HEADER]), decode(wire.rankTable, RankTable)


async def _place(stack: Stack, spec: Runner, instance_id: str = "llm-0") -> InstanceCreated:
    """Put a spec and wait for its instance's placement event and the rank table that
    lists it. Subscribers may see the event before the service has published that table,
    and a status reported in between would make the first table of the job `completed`."""
    events: asyncio.Queue[Msg] = asyncio.Queue()
    sub = await stack.nc.subscribe(stack.layout.subjects.placement(instance_id), cb=events.put)
    await stack.put_spec(spec)
    event: PlacementEvent = decode((await _next(events)).data, PlacementEvent)
    await sub.unsubscribe()
    assert isinstance(event, InstanceCreated)
    nodes = {a.nodeId for a in event.assignments}
    await _until(stack, instance_id, lambda _, table: _nodes_of(table) == nodes)
    return event


def _nodes_of(wire: RankTableStream) -> set[str]:
    table = decode(wire.rankTable, RankTable)
    return {s.server_id for group in table.server_group_list for s in group.server_list}


async def _until(stack: Stack, job: str, until: Callable[[int, RankTableStream], bool]) -> None:
    """Until the job's current or a later rank table and its version satisfy `until`."""

    async def reached() -> None:
        async for version, table in stack.hub.follow(job):
            if until(version, table):
                return

    await asyncio.wait_for(reached(), WAIT)


async def _until_version(stack: Stack, job: str, version: int) -> None:
    await _until(stack, job, lambda seen, _: seen >= version)


async def test_two_nodes_one_spec_place_one_instance_in_proportion(stack: Stack) -> None:
    await stack.put_node(node_info("node-a", 24))
    await stack.put_node(node_info("node-b", 8))
    tables = await _tables(stack, "llm-0")
    await stack.start()
    await stack.put_spec(runner())
    version, table = _table(await _next(tables))
    assert version == 1
    assert table.status is RankTableStatus.INITIALIZING
    placed = stack.service.placements["llm-0"]  # type: ignore[union-attr]
    assert [(a.nodeId, a.startLayer, a.endLayer) for a in placed.assignments] == [
        ("node-a", 0, 24),
        ("node-b", 24, 32),
    ]
    assert [s.server_id for s in table.server_group_list[0].server_list] == ["node-a", "node-b"]
    events = await stack.js.stream_info(stack.layout.placement_stream.name)
    assert events.state.messages == 1
    status = await stack.status("llm", until=lambda s: bool(s.instances))
    assert status.accepted
    assert status.instances == ["llm-0"]
    assert status.runner_metrics.pods_total == 2


async def test_nats_and_grpc_subscribers_see_initializing_then_completed(stack: Stack) -> None:
    await stack.put_node(node_info("node-a", 24))
    await stack.put_node(node_info("node-b", 8))
    await stack.start()
    tables = await _tables(stack, "llm-0")
    async with grpc.aio.insecure_channel(stack.grpc_target) as channel:
        stub = config_pb2_grpc.ConfigStub(channel)
        call = stub.SubscribeRankTable(config_pb2.ClientInfo(jobId="llm-0", role="controller"))
        await stack.put_spec(runner())
        first = await asyncio.wait_for(call.read(), WAIT)
        assert first.jobId == "llm-0"
        assert json.loads(first.rankTable)["status"] == "initializing"
        v1, _ = _table(await _next(tables))
        await stack.report(stack.service.placements["llm-0"], RunnerStatusKind.READY)  # type: ignore[union-attr]
        second = await asyncio.wait_for(call.read(), WAIT)
        assert json.loads(second.rankTable)["status"] == "completed"
        v2, table = _table(await _next(tables))
        assert (v1, v2) == (1, 2)
        assert table.status is RankTableStatus.COMPLETED
        call.cancel()
    running = await stack.status("llm", until=lambda s: s.runner_metrics.pods_running > 0)
    assert running.runner_metrics.pods_running == 2


async def test_a_node_cannot_report_another_node_s_rank_ready(stack: Stack) -> None:
    await stack.put_node(node_info("node-a", 24))
    await stack.put_node(node_info("node-b", 8))
    service = await stack.start()
    tables = await _tables(stack, "llm-0")
    await stack.put_spec(runner())
    _table(await _next(tables))
    placed = service.placements["llm-0"]
    assert placed is not None
    await stack.report(placed, RunnerStatusKind.READY, publisher="node-a")
    for _ in range(int(WAIT / 0.05)):
        if service.dead_letters.counts:
            break
        await asyncio.sleep(0.05)
    assert service.dead_letters.counts == {"telemetry_identity": 1}
    await asyncio.sleep(0.2)
    latest = stack.hub.latest("llm-0")
    assert latest is not None
    assert json.loads(latest[1].rankTable)["status"] == "initializing"
    await stack.report(placed, RunnerStatusKind.READY, seq=3)
    await _until(stack, "llm-0", lambda _, t: json.loads(t.rankTable)["status"] == "completed")


async def test_a_node_cannot_fail_another_node_s_rank_from_its_own_subject(stack: Stack) -> None:
    await stack.put_node(node_info("node-a", 24))
    await stack.put_node(node_info("node-b", 8))
    service = await stack.start()
    placed = await _place(stack, runner())
    await stack.report(placed, RunnerStatusKind.READY, seq=1)
    await _until(stack, "llm-0", lambda _, t: json.loads(t.rankTable)["status"] == "completed")
    # node-a, on its own subjects, says every rank runs on node-a and has failed
    await stack.report(placed, RunnerStatusKind.FAILED, seq=900, publisher="node-a", claimed=True)
    for _ in range(int(WAIT / 0.05)):
        if service.dead_letters.counts:
            break
        await asyncio.sleep(0.05)
    assert service.dead_letters.counts == {"telemetry_identity": 1}  # node-b's rank
    await asyncio.sleep(0.2)
    latest = stack.hub.latest("llm-0")
    assert latest is not None
    assert json.loads(latest[1].rankTable)["status"] == "initializing"  # node-a's own rank


async def test_identical_tables_are_not_sent_again(stack: Stack) -> None:
    await stack.put_node(node_info("node-a", 24))
    await stack.put_node(node_info("node-b", 8))
    await stack.start()
    placed = await _place(stack, runner())
    await stack.report(placed, RunnerStatusKind.READY, seq=1)
    await stack.report(placed, RunnerStatusKind.RUNNING, seq=2)
    await stack.put_node(node_info("node-a", 20))  # memory moves; placement stays
    await stack.put_spec(runner(description="same shape"))
    await stack.service.reconcile()  # type: ignore[union-attr]
    info = await stack.js.stream_info(stack.layout.ranktable_stream.name)
    assert info.state.messages == 2  # initializing, then completed; nothing else


async def _agent_reading_models(stack: Stack, node_id: str) -> Subscription:
    """The model-shape answers of a real agent on `node_id` (which runs no runner here)."""
    agent = Agent(
        nc=stack.nc,
        js=stack.js,
        layout=stack.layout,
        node=lambda: node_info(node_id, 24),
        publisher=TelemetryPublisher(nc=stack.nc),
    )
    return await stack.nc.subscribe(stack.layout.subjects.node_model(node_id), cb=agent.model)


async def test_a_model_given_by_path_is_shaped_by_a_node_that_holds_it(
    stack: Stack, tmp_path: Path
) -> None:
    model = write_tiny_model(tmp_path / "tiny", TinyModelSpec(layers=6, hidden=32))
    await stack.put_node(node_info("node-a", 24))
    await stack.put_node(node_info("node-b", 8))
    answering = await _agent_reading_models(stack, "node-a")  # node-b's agent is not up
    await stack.start(ModelShapes(stack.nc, stack.layout.subjects, timeout=1.0))
    by_path = runner(metadata={"modelPath": str(model)})
    placed = await _place(stack, by_path)
    assert {a.nLayers for a in placed.assignments} == {6}
    assert placed.modelBytes == (model / "model.safetensors").stat().st_size
    await stack.put_spec(runner("lost", metadata={"modelPath": "/not/on/any/node"}))
    waiting = await stack.status("lost", until=lambda s: "no node could read" in (s.reason or ""))
    assert waiting.accepted
    assert waiting.instances == []
    assert waiting.reason == (
        "waiting for its model's shape: no node could read metadata.modelPath "
        "'/not/on/any/node' (node-a: '/not/on/any/node': no readable config.json ([Errno 2] "
        "No such file or directory: '/not/on/any/node/config.json'); node-b: no agent "
        "listening)"
    )
    await answering.unsubscribe()  # the restarted service asks no node: it knows the shape
    await stack.halt()
    service = await stack.start(ModelShapes(stack.nc, stack.layout.subjects, timeout=1.0))
    await service.reconcile()
    assert service.placements == {"llm-0": placed}


def _edited(model: Path, **config: Any) -> Path:
    path = model / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return model


async def test_a_model_that_cannot_run_split_is_rejected_with_the_reason(
    stack: Stack, tmp_path: Path
) -> None:
    spec = TinyModelSpec(layers=6, hidden=32)
    made_up = _edited(write_tiny_model(tmp_path / "made-up", spec), model_type="made_up")
    shared = _edited(write_tiny_model(tmp_path / "shared", spec), num_kv_shared_layers=2)
    await stack.put_node(node_info("node-a", 24))
    answering = await _agent_reading_models(stack, "node-a")
    await stack.start(ModelShapes(stack.nc, stack.layout.subjects, timeout=1.0))
    await stack.put_spec(runner("made-up", metadata={"modelPath": str(made_up)}))
    await stack.put_spec(runner("shared", metadata={"modelPath": str(shared)}))
    refused = await stack.status("made-up", until=lambda s: not s.accepted)
    assert refused.reason == (
        f"rejected: model_type 'made_up' is not an architecture mlx-lm {mlx_lm_version} "
        "knows (as read on node-a)"
    )
    refused = await stack.status("shared", until=lambda s: not s.accepted)
    assert refused.reason == (
        "rejected: the model's last 2 layers read the KV cache of earlier layers, which a "
        "split across 2 ranks cannot give them; run it on 1 rank"
    )
    await stack.put_spec(runner("shared", ranks=1, metadata={"modelPath": str(shared)}))
    await stack.status("shared", until=lambda s: s.accepted and bool(s.instances))
    await answering.unsubscribe()


async def test_restart_keeps_placements(stack: Stack) -> None:
    await stack.put_node(node_info("node-a", 24))
    await stack.put_node(node_info("node-b", 8))
    await stack.start()
    before = await _place(stack, runner())
    await stack.report(before, RunnerStatusKind.READY)
    await _until_version(stack, "llm-0", 2)
    await stack.halt()
    service = await stack.start()
    assert service.placements == {"llm-0": before}
    placement = await stack.js.stream_info(stack.layout.placement_stream.name)
    assert placement.state.messages == 1
    latest = stack.hub.latest("llm-0")
    assert latest is not None
    assert latest[0] == 2
    await service.reconcile()
    tables = await stack.js.stream_info(stack.layout.ranktable_stream.name)
    assert tables.state.messages == 2  # the restart re-sent nothing


async def test_a_restart_before_the_nodes_are_heard_again_places_nothing_anew(
    fast_stack: Stack,
) -> None:
    stack = fast_stack
    for node in ("node-a", "node-b"):
        await stack.put_node(node_info(node, 24 if node == "node-a" else 8))
    await stack.start()
    before = await _place(stack, runner())
    await stack.halt()
    nodes = await stack.js.key_value(stack.layout.nodes_bucket.bucket)
    for node in ("node-a", "node-b"):  # the whole stack went down: their entries expired
        await nodes.delete(token(node))
    restarting = asyncio.create_task(stack.start())
    await asyncio.sleep(0.5)  # the agents come back a moment after the service
    for node in ("node-a", "node-b"):
        await stack.put_node(node_info(node, 24 if node == "node-a" else 8))
    service = await restarting
    assert service.placements == {"llm-0": before}
    placement = await stack.js.stream_info(stack.layout.placement_stream.name)
    assert placement.state.messages == 1, "released and placed again"


async def test_lost_node_re_places_on_the_remaining_capacity(fast_stack: Stack) -> None:
    stack = fast_stack
    beats: dict[str, asyncio.Task[None]] = {}
    kv = await stack.js.key_value(stack.layout.nodes_bucket.bucket)

    def describer(info: NodeInfo) -> Callable[[], NodeInfo]:
        return lambda: msgspec.structs.replace(info, lastHeartbeat=now())

    for info in (node_info("node-a", 24), node_info("node-b", 8), node_info("node-c", 6)):
        beat = Heartbeat(kv=kv, describe=describer(info), interval=0.5)
        await beat.beat()
        beats[info.nodeId] = asyncio.create_task(beat.run(asyncio.Event()))
    await stack.start()
    first = await _place(stack, runner())
    assert {a.nodeId for a in first.assignments} == {"node-a", "node-b"}
    await _until_version(stack, "llm-0", 1)
    tables = await _tables(stack, "llm-0")
    placements: asyncio.Queue[Msg] = asyncio.Queue()
    await stack.nc.subscribe(stack.layout.subjects.placement("llm-0"), cb=placements.put)
    beats.pop("node-b").cancel()  # a crash: no goodbye, the entry just stops being renewed
    released: PlacementEvent = decode(
        (await asyncio.wait_for(placements.get(), 2 * 2.0)).data, PlacementEvent
    )
    assert "node node-b lost" in released.reason  # type: ignore[union-attr]
    again: PlacementEvent = decode((await _next(placements)).data, PlacementEvent)
    assert isinstance(again, InstanceCreated)
    assert {a.nodeId for a in again.assignments} == {"node-a", "node-c"}
    assert again.attempt == 1
    _, table = _table(await _next(tables))
    assert [s.server_id for s in table.server_group_list[0].server_list] == ["node-a", "node-c"]
    assert table.status is RankTableStatus.INITIALIZING
    for task in beats.values():
        task.cancel()


async def test_lost_node_without_spare_capacity_is_refused_with_a_reason(stack: Stack) -> None:
    tables = await _placed_and_following(stack)
    kv = await stack.js.key_value(stack.layout.nodes_bucket.bucket)
    await kv.delete(token("node-b"))
    _, table = _table(await _next(tables))
    assert table.status is RankTableStatus.INITIALIZING
    assert table.server_group_list[0].server_list == []
    status = await stack.status("llm", until=lambda s: s.reason is not None)
    assert "need 2 nodes, but nodepool 'default' has 1 live" in (status.reason or "")


async def test_bad_spec_is_rejected_and_others_still_place(stack: Stack) -> None:
    await stack.put_node(node_info("node-a", 24))
    await stack.put_node(node_info("node-b", 8))
    await stack.start()
    await stack.put_spec(b'{"id": "broken", "priority": 12}', key="broken")
    await stack.put_spec(runner("sizeless", metadata={}), key="sizeless")
    await _place(stack, runner())
    mismatched = runner("other")
    await stack.put_spec(mismatched, key="mismatch")
    await _until_version(stack, "llm-0", 1)
    broken = await stack.status("broken", until=lambda s: s.reason is not None)
    assert not broken.accepted
    assert broken.reason == "rejected: Expected `int` <= 9 - at `$.priority`"
    sizeless = await stack.status("sizeless", until=lambda s: s.reason is not None)
    assert sizeless.reason is not None
    assert "model's size is unknown" in sizeless.reason
    mismatch = await stack.status("mismatch", until=lambda s: s.reason is not None)
    assert mismatch.reason == "rejected: id 'other' does not match its key 'mismatch'"
    assert set(stack.service.placements) == {"llm-0"}  # type: ignore[union-attr]


async def test_deleting_a_spec_releases_its_instances(stack: Stack) -> None:
    tables = await _placed_and_following(stack)
    kv = await stack.js.key_value(stack.layout.runners_bucket.bucket)
    await kv.delete(token("llm"))
    _, table = _table(await _next(tables))
    assert table.server_group_list[0].server_list == []  # followers see it emptied
    assert stack.service.placements == {}  # type: ignore[union-attr]

    for _ in range(100):  # then the job and its table are gone, not initializing forever
        try:
            await stack.js.get_last_msg(
                stack.layout.ranktable_stream.name, stack.layout.subjects.ranktable("llm-0")
            )
        except NotFoundError:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the deleted spec's rank table is still there")


@pytest.mark.parametrize(
    ("job_id", "why"),
    [("", "empty"), ("x" * (MAX_TOKEN + 1), "limit of 512"), ("*" * 171, "escapes to 513")],
)
async def test_grpc_refuses_a_bad_job_id(stack: Stack, job_id: str, why: str) -> None:
    async with grpc.aio.insecure_channel(stack.grpc_target) as channel:
        stub = config_pb2_grpc.ConfigStub(channel)
        call = stub.SubscribeRankTable(config_pb2.ClientInfo(jobId=job_id))
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await asyncio.wait_for(call.read(), WAIT)
        assert failure.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await stub.Register(config_pb2.ClientInfo(jobId=job_id))
        assert failure.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert (failure.value.details() or "").startswith("jobId: ")
        assert why in (failure.value.details() or "")


async def test_the_docs_grpc_snippet_runs_as_a_script_and_ends_quietly_on_ctrl_c(
    stack: Stack, tmp_path: Path
) -> None:
    readme = (Path(__file__).parent.parent.parent / "docs" / "MODELS.md").read_text()
    (snippet,) = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    script = tmp_path / "follow.py"
    script.write_text(
        snippet.replace("127.0.0.1:8899", stack.grpc_target).replace('"demo-0"', '"llm-0"')
    )
    await stack.put_node(node_info("node-a", 24))
    await stack.put_node(node_info("node-b", 8))
    await stack.start()
    await _place(stack, runner())
    follower = await asyncio.create_subprocess_exec(
        sys.executable, str(script), cwd=Path(__file__).parent.parent.parent,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert follower.stdout is not None
        first = await asyncio.wait_for(follower.stdout.readline(), WAIT)
        assert json.loads(first)["status"] == "initializing"
        follower.send_signal(signal.SIGINT)  # Ctrl-C
        _, err = await asyncio.wait_for(follower.communicate(), WAIT)
        assert (follower.returncode, err.decode()) == (0, "")  # no traceback
    finally:
        if follower.returncode is None:
            follower.kill()
            await follower.wait()


async def test_a_subscriber_s_role_cannot_forge_or_flood_a_log_line(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    await stack.put_node(node_info("node-a", 24))
    await stack.start()
    role = "x\n2026-11-25T00:00:00Z ERROR rankscope: forged" + "y" * 3_000_000
    async with grpc.aio.insecure_channel(
        stack.grpc_target, options=[("grpc.max_send_message_length", 8 << 20)]
    ) as channel:
        stub = config_pb2_grpc.ConfigStub(channel)
        call = stub.SubscribeRankTable(config_pb2.ClientInfo(jobId="later-0", role=role))
        with pytest.raises(TimeoutError):  # the job has no table: the subscriber waits
            await asyncio.wait_for(call.read(), 1.0)
        call.cancel()
    (record,) = [r for r in caplog.records if r.getMessage() == "rank-table subscriber"]
    logged = str(record.__dict__["role"])
    assert "\n" not in logged
    assert len(logged) < 100


async def test_grpc_waits_for_an_unknown_job_and_serves_many_subscribers(stack: Stack) -> None:
    await stack.put_node(node_info("node-a", 24))
    await stack.put_node(node_info("node-b", 8))
    await stack.start()
    async with grpc.aio.insecure_channel(stack.grpc_target) as channel:
        stub = config_pb2_grpc.ConfigStub(channel)
        registered = await stub.Register(config_pb2.ClientInfo(jobId="llm-0"))
        assert registered.code == 0
        calls = [stub.SubscribeRankTable(config_pb2.ClientInfo(jobId="llm-0")) for _ in range(3)]
        reads = [asyncio.ensure_future(call.read()) for call in calls]
        done, _ = await asyncio.wait(reads, timeout=0.2)
        assert not done  # no job yet: the subscribers wait rather than fail
        await stack.put_spec(runner())
        tables = await asyncio.wait_for(asyncio.gather(*reads), WAIT)
        assert {t.jobId for t in tables} == {"llm-0"}
        for call in calls:
            call.cancel()


async def test_subscriber_joining_late_gets_the_current_table_first(stack: Stack) -> None:
    await stack.put_node(node_info("node-a", 24))
    await stack.put_node(node_info("node-b", 8))
    await stack.start()
    await stack.report(await _place(stack, runner()), RunnerStatusKind.READY)
    await _until_version(stack, "llm-0", 2)
    async with grpc.aio.insecure_channel(stack.grpc_target) as channel:
        call = config_pb2_grpc.ConfigStub(channel).SubscribeRankTable(
            config_pb2.ClientInfo(jobId="llm-0")
        )
        current = await asyncio.wait_for(call.read(), WAIT)
        assert json.loads(current.rankTable)["status"] == "completed"
        call.cancel()


async def test_a_second_rank_table_service_on_a_taken_port_stops_with_one_line() -> None:
    first, port = await serve(TableHub(), "127.0.0.1", 0)
    try:
        with pytest.raises(StartError, match=r"is a rank-table service running there already"):
            await serve(TableHub(), "127.0.0.1", port)
    finally:
        await first.stop(0)
