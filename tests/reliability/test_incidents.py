"""Incidents as an operator lives them, on a real deployment (every part its own process,
two agents serving the tiny model over two ranks) with a short collective timeout.

A rank frozen for three collective timeouts stays the one named, under one `since`, in
every sample: its peer times out, restarts and waits again, and is only ever listed as
waiting; the finding carries what was captured as it opened (the waiting rank's stack on
the line of its collective, the frozen one reported as stopped). NATS paused for four
heartbeat TTLs is an outage of NATS: readiness says so, no rank is blamed, no node is
declared lost and nothing is placed again. A client that leaves mid-stream cancels its
generation on both ranks, and a rank killed mid-generation ends the chat with a 502
within seconds.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import pytest_asyncio

from rankscope.shared.jetstream import Layout
from rankscope.shared.wire import (
    Finding,
    FindingKind,
    Phase,
    ProcessState,
    RankRole,
    TaskCreated,
    decode,
)
from tests.reliability.deployment import FAULT_TEST_MARKS, JOB, SPEC, Deployment, serving

pytestmark = FAULT_TEST_MARKS

TTL = 3.0
COLLECTIVE = 7.0
SILENT = 5.0  # Thresholds.silent: a rank without a word this long is frozen
NODES = ("node-a", "node-b")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def deployment(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Deployment]:
    root = tmp_path_factory.mktemp("incidents")
    async with serving(root, NODES, heartbeat_ttl=TTL, collective_timeout=COLLECTIVE) as built:
        yield built


async def test_a_hang_longer_than_the_collective_timeout_names_the_frozen_rank_throughout(
    deployment: Deployment,
) -> None:
    ranks = {r.deviceRank: r for r in (await deployment.timeline()).runners}
    frozen, waiting = ranks[1], ranks[0]
    assert frozen.pid is not None
    os.kill(frozen.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    samples: list[tuple[float, list[Finding]]] = []
    try:
        while time.monotonic() - stopped < 3 * COLLECTIVE:  # sampled every second
            await asyncio.sleep(1)
            samples.append((time.monotonic() - stopped, await deployment.findings()))
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    findings = [f for _, found in samples for f in found]
    assert all(found for t, found in samples if t > SILENT + 2), "a sample without a finding"
    assert {tuple(f.culpritRunnerIds) for f in findings} == {(frozen.runnerId,)}
    assert {f.kind for f in findings} == {FindingKind.STALLED_RANK}
    assert len({f.since for f in findings}) == 1, "one incident, not one per flap"
    peer = [e for f in findings for e in f.evidence if e.runnerId == waiting.runnerId]
    assert {e.role for e in peer} == {RankRole.WAITING}
    timed_out = [e for e in peer if e.gaveUp]
    assert timed_out, "the peer's collective timeout is in the evidence"
    assert (timed_out[-1].gaveUp or "").startswith(
        f"timed out in task_agreement after {COLLECTIVE:g}s"
    )
    assert "timed out in task_agreement" in findings[-1].summary
    # the evidence captured as the incident opened: the line the waiting rank was on
    (culprit,) = [e for e in findings[-1].evidence if e.runnerId == frozen.runnerId]
    assert culprit.process is ProcessState.STOPPED
    assert culprit.stack is None
    (victim,) = [e for e in findings[-1].evidence if e.runnerId == waiting.runnerId]
    assert victim.stack is not None
    assert "in _agree" in victim.stack
    await deployment.until("both ranks ready again", deployment.ready, 120)
    await deployment.until("the incident closed", _no_findings(deployment), 30)


def _no_findings(deployment: Deployment) -> Callable[[], Awaitable[bool | None]]:
    async def none() -> bool | None:
        return True if not await deployment.findings() else None

    return none


async def test_nats_paused_is_an_outage_of_nats_not_lost_nodes(deployment: Deployment) -> None:
    await deployment.until("both ranks ready", deployment.ready, 120)
    await deployment.until("no open finding", _no_findings(deployment), 30)
    serving = {r.runnerId for r in (await deployment.timeline()).runners}
    before = await deployment.ranktable()
    assert before is not None
    feed = await deployment.findings_feed()
    pid = deployment.server.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(2 * TTL)
        ready = await deployment.http.get("/readyz")
        diagnosis = await deployment.http.get("/v1/cluster/diagnosis")
        await asyncio.sleep(2 * TTL)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert ready.status_code == 503
    assert ready.json()["reason"].startswith("NATS unreachable since ")
    (outage,) = diagnosis.json()["findings"]
    assert outage["kind"] == "nats_unreachable"
    await asyncio.sleep(3 * TTL)  # time for anything false to surface
    assert {f.kind for f in feed} == {FindingKind.NATS_UNREACHABLE}, [f.summary for f in feed]
    assert [f.open for f in feed] == [True, False]  # recorded once NATS was back, and closed
    assert await deployment.ranktable() == before, "nothing was released or placed again"
    assert {r.runnerId for r in (await deployment.timeline()).runners} == serving
    assert await deployment.findings() == []
    assert (await deployment.http.get("/readyz")).status_code == 200
    assert not deployment.crashed(), f"{deployment.crashed()} exited"


CHAT = {"model": SPEC, "messages": [{"role": "user", "content": "go on"}]}


async def test_a_client_gone_mid_stream_frees_the_instance_for_the_next_chat(
    deployment: Deployment,
) -> None:
    await deployment.until("both ranks ready", deployment.ready, 120)
    body = CHAT | {"stream": True, "max_tokens": 4000}
    async with deployment.http.stream("POST", "/v1/chat/completions", json=body) as events:
        chunks = 0
        async for line in events.aiter_lines():
            chunks += line.startswith("data: ")
            if chunks == 4:  # the role, then three chunks of text: then the client goes
                break
    started = time.monotonic()
    reply = await deployment.http.post("/v1/chat/completions", json=CHAT | {"max_tokens": 8})
    assert reply.status_code == 200, reply.text
    assert time.monotonic() - started < 20, "the abandoned generation held the instance"

    async def cancelled() -> bool | None:
        found = (await deployment.timeline()).timeline
        ranks = {e.runnerId for e in found if e.phase is Phase.CANCEL_OBSERVED}
        return True if len(ranks) == 2 else None

    await deployment.until("the abandoned task cancelled on both ranks", cancelled, 30)


async def test_a_chat_s_prompt_is_stored_only_in_the_copies_for_its_nodes(
    deployment: Deployment,
) -> None:
    await deployment.until("both ranks ready", deployment.ready, 120)
    prompt = "Which rank holds the secret 7f3a?"
    body = CHAT | {"messages": [{"role": "user", "content": prompt}], "max_tokens": 4}
    reply = await deployment.http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    js, layout = deployment.nc.jetstream(), Layout()
    ordered = await js.get_last_msg(layout.tasks_stream.name, layout.subjects.tasks(JOB))
    task = decode(ordered.data or b"", TaskCreated)
    assert task.request is None, "the tasks stream, which every agent reads, holds the prompt"
    for node in NODES:  # each node's ranks ran it from their own copy
        raw = await js.get_last_msg(
            layout.inputs_stream.name, layout.subjects.task_input(node, JOB, task.taskId)
        )
        whole = decode(raw.data or b"", TaskCreated)
        assert whole.request is not None
        assert whole.request.messages[0].content == prompt


async def test_a_rank_killed_mid_generation_ends_the_chat_with_a_502_naming_it(
    deployment: Deployment,
) -> None:
    await deployment.until("both ranks ready", deployment.ready, 120)
    ranks = {r.deviceRank: r for r in (await deployment.timeline()).runners}
    chat = asyncio.create_task(
        deployment.http.post("/v1/chat/completions", json=CHAT | {"max_tokens": 4000})
    )
    await deployment.until("decoding", _decoding(deployment), 60)
    assert ranks[0].pid is not None
    os.kill(ranks[0].pid, signal.SIGKILL)
    killed = time.monotonic()
    reply = await chat
    assert time.monotonic() - killed < 10, "waited on a dead rank"
    assert reply.status_code == 502
    assert ranks[0].runnerId in reply.json()["detail"] or "rank 0" in reply.json()["detail"]
    await deployment.until("both ranks ready again", deployment.ready, 120)
    exits = [e.detail for e in (await deployment.timeline()).timeline if e.phase is Phase.ERROR]
    # the dead_rank finding asked for stacks while rank 0 was restarting: that must not kill it
    assert not [d for d in exits if d and "SIGUSR1" in d], exits


def _decoding(deployment: Deployment) -> Callable[[], Awaitable[bool | None]]:
    async def decoding() -> bool | None:
        runners = (await deployment.timeline()).runners
        return True if all(r.phase is Phase.DECODE_STREAM for r in runners) else None

    return decoding
