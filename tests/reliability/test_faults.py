"""Faults on a real deployment, every part its own process: nats-server (file storage),
aggregator, rank-table service, gateway and two agents serving the tiny model over two
ranks. A rank frozen mid-decode is named with the rank waiting on it; a NATS restart
loses no entry and crashes nothing; a node killed outright is declared dead, its job's
rank table goes back to `initializing` and the spec is placed again or refused with a
reason, all within two heartbeat TTLs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import pytest_asyncio
from nats.aio.client import Client

from services.stack.demo import spec
from shared.connection import close, connect
from shared.jetstream import Layout
from shared.nats_server import EmbeddedNats
from shared.settings import Settings, to_environ
from shared.timestamps import now
from shared.tiny_model import TinyModelSpec, write_tiny_model
from shared.wire import (
    ClusterTimeline,
    Diagnosis,
    Finding,
    FindingKind,
    GenerationRequest,
    Phase,
    RankTable,
    RankTableStatus,
    RankTableStream,
    RunnerSpecStatus,
    TaskCreated,
    TaskKind,
    decode,
    encode,
)
from tests.gateway.conftest import free_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.nats,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(240),
]

REPO = Path(__file__).parent.parent.parent
TTL = 3.0
SILENT = 5.0  # Thresholds.silent: a rank without a word this long is frozen
NODES = ("node-a", "node-b")
SPEC = "faults"
JOB = f"{SPEC}-0"
T = TypeVar("T")


@dataclass
class Deployment:
    root: Path
    server: EmbeddedNats
    env: dict[str, str]
    http: httpx.AsyncClient
    nc: Client
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, *args: str, **env: str) -> None:
        log = (self.root / f"{name}.log").open("wb")
        self.processes[name] = subprocess.Popen(
            [sys.executable, "-m", "services.cli", *args],
            cwd=REPO,
            env={**self.env, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # an agent and its runners form one process group
        )
        log.close()

    def crashed(self) -> list[str]:
        return [name for name, p in self.processes.items() if p.poll() is not None]

    async def until(self, what: str, probe: Callable[[], Awaitable[T | None]], within: float) -> T:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            found = await probe()
            if found is not None:
                return found
            await asyncio.sleep(0.1)
        raise AssertionError(f"not within {within:g}s: {what}")

    async def timeline(self) -> ClusterTimeline:
        reply = await self.http.get("/v1/cluster/timeline", params={"instanceId": JOB})
        return decode(reply.content, ClusterTimeline)

    async def findings(self) -> list[Finding]:
        reply = await self.http.get("/v1/cluster/diagnosis")
        return decode(reply.content, Diagnosis).findings

    async def ranktable(self) -> tuple[int, RankTable] | None:
        reply = await self.http.get(f"/v1/jobs/{JOB}/ranktable")
        if reply.status_code != 200:
            return None
        table = decode(decode(reply.content, RankTableStream).rankTable, RankTable)
        return int(reply.headers["ETag"].strip('"')), table

    async def ready(self) -> ClusterTimeline | None:
        found = await self.timeline()
        live = [r for r in found.runners if r.statusKind == "RunnerReady" and r.processAlive]
        return found if len(live) == 2 else None

    async def generate(self, task_id: str, max_tokens: int) -> None:
        task = TaskCreated(
            at=now(),
            taskId=task_id,
            instanceId=JOB,
            taskKind=TaskKind.TEXT_GENERATION,
            commandId=task_id,
            request=GenerationRequest(prompt="Which rank is stuck?", maxTokens=max_tokens),
        )
        await self.nc.jetstream().publish(Layout().subjects.tasks(JOB), encode(task))

    async def entries(self, task_id: str, phase: Phase) -> set[str] | None:
        """The runners that recorded `phase` for `task_id`, if any did."""
        reply = await self.http.get(
            "/v1/cluster/timeline", params={"instanceId": JOB, "limit": 100_000}
        )
        if reply.status_code != 200:  # NATS or the aggregator may be away for a while
            return None
        found = decode(reply.content, ClusterTimeline).timeline
        runners = {e.runnerId for e in found if e.taskId == task_id and e.phase is phase}
        return runners or None


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def deployment(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Deployment]:
    root = tmp_path_factory.mktemp("faults")
    model = write_tiny_model(root / "model", TinyModelSpec(layers=5, hidden=64))
    server = EmbeddedNats(store_dir=root / "nats", port=free_port()).start()
    gateway = free_port()
    settings = Settings(
        nats_url=server.url,
        heartbeat_ttl=TTL,
        collective_timeout=120.0,  # a frozen peer is diagnosed, not timed out, here
        gateway_port=gateway,
        grpc_port=free_port(),
        ring_port_base=free_port(),
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE_")}
    env.update(to_environ(settings))
    nc = await connect(settings, "faults-test")
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway}", timeout=30) as http:
        built = Deployment(root=root, server=server, env=env, http=http, nc=nc)
        for service in ("aggregator", "ranktable", "gateway"):
            built.start(service, service)
        for node in NODES:
            built.start(node, "agent", RANKSCOPE_NODE_ID=node, RANKSCOPE_DATA_DIR=str(root / node))

        async def created() -> bool | None:
            try:
                reply = await http.post(
                    "/v1/runners", json={"runners": [spec(model) | {"id": SPEC}]}
                )
            except httpx.TransportError:
                return None
            return True if reply.status_code == 200 else None

        await built.until("the gateway accepts the spec", created, 60)
        await built.until("both ranks ready", built.ready, 90)
        yield built
        for process in built.processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in built.processes.values():
            process.wait(timeout=20)
    await close(nc)
    server.stop()


async def test_a_rank_frozen_mid_decode_is_named_with_the_rank_waiting_on_it(
    deployment: Deployment,
) -> None:
    await deployment.generate("hang", max_tokens=3000)
    await deployment.until("decoding", lambda: deployment.entries("hang", Phase.DECODE_STREAM), 60)
    runners = {r.deviceRank: r for r in (await deployment.timeline()).runners}
    victim, waiting = runners[1], runners[0]
    assert victim.pid is not None
    os.kill(victim.pid, signal.SIGSTOP)
    stopped = time.monotonic()

    async def named() -> Finding | None:
        for finding in await deployment.findings():
            if finding.culpritRunnerIds == [victim.runnerId]:
                return finding
        return None

    try:
        finding = await deployment.until("the frozen rank named", named, SILENT + 10)
        named_after = time.monotonic() - stopped
    finally:
        os.kill(victim.pid, signal.SIGCONT)
    assert named_after <= SILENT + 2, f"named after {named_after:.1f}s"
    assert finding.kind is FindingKind.STALLED_RANK
    assert finding.waitingRanks == [waiting.deviceRank]
    assert f"rank {victim.deviceRank}" in finding.summary

    async def cleared() -> bool | None:
        return True if not await named() else None

    await deployment.until("the finding cleared after SIGCONT", cleared, 15)
    await deployment.until(
        "the generation finished", lambda: _both(deployment.entries("hang", Phase.COMPLETION)), 120
    )


async def _both(found: Awaitable[set[str] | None]) -> bool | None:
    runners = await found
    return True if runners is not None and len(runners) == 2 else None


async def test_a_nats_restart_mid_generation_loses_nothing_and_crashes_nothing(
    deployment: Deployment,
) -> None:
    serving = {r.runnerId for r in (await deployment.timeline()).runners}
    await deployment.generate("restart", max_tokens=1500)
    await deployment.until(
        "decoding", lambda: deployment.entries("restart", Phase.DECODE_STREAM), 60
    )
    deployment.server.stop()
    await asyncio.sleep(3)
    deployment.server.start()  # same port, same store
    await deployment.until(
        "the generation finished",
        lambda: _both(deployment.entries("restart", Phase.COMPLETION)),
        120,
    )
    assert not deployment.crashed(), f"{deployment.crashed()} exited"

    async def complete() -> dict[str, Any] | None:
        health = json.loads((await deployment.nc.request("rankscope.query.health", b"")).data)
        return health if not health["missingSeqs"] else None

    health = await deployment.until("every seq present", complete, 30)
    assert health["runners"] == 2, "an outage of NATS is not the loss of a node: nothing moved"
    assert {r.runnerId for r in (await deployment.timeline()).runners} == serving
    metrics = (await deployment.http.get("/metrics")).text
    assert "rankscope_telemetry_missing_seqs{" not in metrics


async def test_a_killed_node_is_dead_its_rank_table_reset_and_its_spec_handled(
    deployment: Deployment,
) -> None:
    before = await deployment.ranktable()
    assert before is not None
    version, table = before
    assert table.status is RankTableStatus.COMPLETED
    runners = {r.nodeId: r for r in (await deployment.timeline()).runners}
    agent = deployment.processes["node-b"]
    os.killpg(agent.pid, signal.SIGKILL)  # the agent and its runner, no goodbye
    killed = time.monotonic()

    async def unreachable() -> ClusterTimeline | None:
        found = await deployment.timeline()
        return found if any(n.nodeId == "node-b" for n in found.unreachableNodes) else None

    async def dead() -> Finding | None:
        for finding in await deployment.findings():
            lost = runners["node-b"].runnerId
            if finding.kind is FindingKind.DEAD_RANK and lost in finding.culpritRunnerIds:
                return finding
        return None

    async def reset() -> tuple[int, RankTable] | None:
        found = await deployment.ranktable()
        if found and found[0] > version and found[1].status is RankTableStatus.INITIALIZING:
            return found
        return None

    await deployment.until("node-b unreachable", unreachable, 2 * TTL + 1)
    await deployment.until("a dead_rank finding", dead, 2 * TTL + 1)
    await deployment.until("the rank table back to initializing", reset, 2 * TTL + 1)
    assert time.monotonic() - killed <= 2 * TTL + 1

    async def handled() -> RunnerSpecStatus | None:
        kv = await deployment.nc.jetstream().key_value(Layout().runner_status_bucket.bucket)
        status = decode((await kv.get(SPEC)).value or b"", RunnerSpecStatus)
        placed_again = status.accepted and status.instances
        refused = not status.accepted and status.reason
        return status if (placed_again or refused) and status.revision else None

    status = await deployment.until("the spec placed again or refused", handled, 2 * TTL + 1)
    if not status.accepted:
        assert "node" in (status.reason or ""), status.reason
    assert [n for n in deployment.crashed() if n != "node-b"] == []
