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
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from rankscope.shared.wire import (
    Finding,
    FindingKind,
    Phase,
)
from tests.reliability.deployment import (
    FAULT_TEST_MARKS,
    Deployment,
    both,
    node_loss_seen,
    serving,
)

pytestmark = FAULT_TEST_MARKS

TTL = 3.0
SILENT = 5.0  # Thresholds.silent: a rank without a word this long is frozen
NODES = ("node-a", "node-b")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def deployment(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Deployment]:
    root = tmp_path_factory.mktemp("faults")
    # a frozen peer is diagnosed here, not timed out
    async with serving(root, NODES, heartbeat_ttl=TTL, collective_timeout=120.0) as built:
        yield built


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
    # both ranks decode on: each observes a cancel at its next token and completes the task
    # (the rest of the 3000 tokens would take 20 s of both cores)
    await deployment.cancel("hang")
    await deployment.until(
        "the generation ended", lambda: both(deployment.entries("hang", Phase.COMPLETION)), 120
    )
    assert await deployment.entries("hang", Phase.CANCEL_OBSERVED) == {
        r.runnerId for r in runners.values()
    }


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
        lambda: both(deployment.entries("restart", Phase.COMPLETION)),
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
    agent = deployment.processes["node-b"]
    # the agent and its runner, with no goodbye
    await node_loss_seen(deployment, "node-b", lambda: os.killpg(agent.pid, signal.SIGKILL), TTL)
    assert [n for n in deployment.crashed() if n != "node-b"] == []
