"""A rankscope deployment whose every part is its own process, for fault tests: start
services and agents, and read what an operator would (timeline, findings, rank table)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from rankscope.services.stack.demo import spec
from rankscope.shared.connection import close, connect
from rankscope.shared.jetstream import Layout
from rankscope.shared.nats_server import EmbeddedNats
from rankscope.shared.settings import Settings, to_environ
from rankscope.shared.timestamps import now, to_epoch
from rankscope.shared.tiny_model import TinyModelSpec, write_tiny_model
from rankscope.shared.wire import (
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
from tests.stack_up import free_port

__all__ = [
    "FAULT_TEST_MARKS",
    "JOB",
    "SPEC",
    "Agent",
    "Deployment",
    "both",
    "deployed",
    "node_loss_seen",
    "serving",
]

REPO = Path(__file__).parent.parent.parent
SPEC = "faults"
JOB = f"{SPEC}-0"
T = TypeVar("T")
FAULT_TEST_MARKS = [
    pytest.mark.slow,
    pytest.mark.nats,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(240),
]
"""Marks of a module whose tests share one deployment."""


@dataclass
class Deployment:
    root: Path
    server: EmbeddedNats
    env: dict[str, str]
    http: httpx.AsyncClient
    nc: Client
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, *args: str, within: Sequence[str] = (), **env: str) -> None:
        """Run `rankscope <args>` (prefixed by `within`, e.g. `ip netns exec ns`)."""
        log = (self.root / f"{name}.log").open("wb")
        self.processes[name] = subprocess.Popen(
            [*within, sys.executable, "-m", "rankscope.services.cli", *args],
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

    async def findings_feed(self) -> list[Finding]:
        """Every finding published from now on, as the aggregator opens and clears them."""
        feed: list[Finding] = []

        async def keep(msg: Msg) -> None:
            feed.append(decode(msg.data, Finding))

        await self.nc.subscribe(Layout().subjects.diagnosis_all(), cb=keep)
        return feed

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

    async def cancel(self, task_id: str) -> None:
        """Ask every rank to cancel `task_id`, as a client gone mid-chat does."""
        cancel = TaskCreated(
            at=now(),
            taskId=f"cancel-{task_id}",
            instanceId=JOB,
            taskKind=TaskKind.CANCEL_TASK,
            targetTaskId=task_id,
        )
        await self.nc.jetstream().publish(Layout().subjects.tasks(JOB), encode(cancel))

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

    async def spec_status(self) -> RunnerSpecStatus | None:
        kv = await self.nc.jetstream().key_value(Layout().runner_status_bucket.bucket)
        entry = await kv.get(SPEC)
        return decode(entry.value or b"", RunnerSpecStatus) if entry.value else None


async def both(found: Awaitable[set[str] | None]) -> bool | None:
    """True once both ranks are in `found`."""
    runners = await found
    return True if runners is not None and len(runners) == 2 else None


@dataclass(frozen=True)
class Agent:
    """How one node's agent runs: a command prefix, and its NATS URL and address if not
    those of the others."""

    within: Sequence[str] = ()
    nats_url: str | None = None
    address: str | None = None


@contextlib.asynccontextmanager
async def deployed(
    root: Path, server: EmbeddedNats, agents: Mapping[str, Agent], **settings: Any
) -> AsyncIterator[Deployment]:
    """Aggregator, rank-table service, gateway and `agents`, each a process, serving the
    tiny model over two ranks (spec `SPEC`), ready when the block starts."""
    model = write_tiny_model(root / "model", TinyModelSpec(layers=5, hidden=64))
    gateway = free_port()
    config = Settings(
        nats_url=f"nats://127.0.0.1:{server.url.rsplit(':', 1)[1]}",
        gateway_port=gateway,
        grpc_port=free_port(),
        ring_port_base=free_port(),
        **settings,
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE_")}
    env.update(to_environ(config))
    nc = await connect(config, "fault-test")
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway}", timeout=30) as http:
        built = Deployment(root=root, server=server, env=env, http=http, nc=nc)
        for service, *flags in (("aggregator",), ("ranktable", "--serve"), ("gateway",)):
            built.start(service, service, *flags)
        for node, agent in agents.items():
            own = {"RANKSCOPE_NODE_ID": node, "RANKSCOPE_DATA_DIR": str(root / node)}
            if agent.nats_url:
                own["RANKSCOPE_NATS_URL"] = agent.nats_url
            if agent.address:
                own["RANKSCOPE_NODE_ADDRESS"] = agent.address
            built.start(node, "agent", within=agent.within, **own)

        async def created() -> bool | None:
            try:
                body = {"runners": [spec(model) | {"id": SPEC}]}
                reply = await http.post("/v1/runners", json=body)
            except httpx.TransportError:
                return None
            return True if reply.status_code == 200 else None

        try:
            await built.until("the gateway accepts the spec", created, 60)
            await built.until("both ranks ready", built.ready, 90)
            yield built
        finally:
            for process in built.processes.values():
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGTERM)
            for process in built.processes.values():
                process.wait(timeout=20)
            await close(nc)


@contextlib.asynccontextmanager
async def serving(root: Path, nodes: Sequence[str], **settings: Any) -> AsyncIterator[Deployment]:
    """`deployed`, on an embedded NATS (file storage) of its own, with an agent per node."""
    server = EmbeddedNats(store_dir=root / "nats", port=free_port()).start()
    try:
        async with deployed(root, server, {node: Agent() for node in nodes}, **settings) as built:
            yield built
    finally:
        server.stop()


async def node_loss_seen(
    deployment: Deployment, node_id: str, fault: Callable[[], None], ttl: float
) -> RunnerSpecStatus:
    """Cause `fault` to `node_id`, then see, within two heartbeat TTLs, what a lost node must
    cause: the node in `unreachableNodes`, a `dead_rank` finding naming its rank, the job's
    rank table back to `initializing` under a new version, and the spec placed again or
    refused with a reason (returned)."""
    before = await deployment.ranktable()
    assert before is not None
    assert before[1].status is RankTableStatus.COMPLETED
    lost = {r.nodeId: r for r in (await deployment.timeline()).runners}[node_id].runnerId
    feed = await deployment.findings_feed()
    fault()
    began, fault_at, window = time.monotonic(), time.time(), 2 * ttl

    async def unreachable() -> bool | None:
        found = await deployment.timeline()
        return True if any(n.nodeId == node_id for n in found.unreachableNodes) else None

    async def dead() -> Finding | None:
        for finding in feed:
            if finding.kind is FindingKind.DEAD_RANK and lost in finding.culpritRunnerIds:
                return finding
        return None

    async def reset() -> bool | None:
        found = await deployment.ranktable()
        if found and found[0] > before[0] and found[1].status is RankTableStatus.INITIALIZING:
            return True
        return None

    async def handled() -> RunnerSpecStatus | None:
        status = await deployment.spec_status()
        if status is None or to_epoch(status.updated_at) < fault_at:
            return None
        return status if status.instances or status.reason else None  # placed, or refused

    await deployment.until(f"{node_id} unreachable", unreachable, window)
    await deployment.until(f"a dead_rank finding for {node_id}", dead, window)
    await deployment.until("the rank table back to initializing", reset, window)
    status = await deployment.until("the spec placed again or refused", handled, window)
    took = time.monotonic() - began
    assert took <= window + 1, f"took {took:.1f}s"
    if not status.instances:
        assert "node" in (status.reason or ""), status.reason
    return status
