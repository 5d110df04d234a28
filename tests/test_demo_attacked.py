"""`rankscope up --demo --nats-auth` attacked with its demo nodes' own credentials (the
passwords `up` keeps for `rankscope record`), then restarted: the attacks are refused, and
the restarted demo has both ranks ready and serves a chat within 120 s, while `/readyz`
and `/v1/jobs` say only what holds."""

from __future__ import annotations

import asyncio
import os
import threading
import time
import urllib.error
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client

from rankscope.services.stack.main import node_password
from rankscope.shared.connection import close, connect
from rankscope.shared.nats_auth import agent_user
from rankscope.shared.settings import Settings
from rankscope.shared.subjects import Subjects
from rankscope.shared.timestamps import now
from rankscope.shared.wire import RecordedRank, Registered, decode, encode
from tests.demo_up import Demo, launch_demo, stop_up
from tests.stack_up import free_port

pytestmark = [pytest.mark.slow, pytest.mark.nats, pytest.mark.timeout(480)]

SUBJECTS = Subjects()
RESTART_S = 120
"""How soon a restarted demo must have both ranks ready and a chat served."""
RANKS_PER_NODE = 256
"""`RANKSCOPE_RECORD_RANKS_PER_NODE`'s default."""


async def _login(url: str, data: Path, node: str) -> Client:
    password = node_password(Settings(data_dir=data), node).read_text().strip()
    settings = Settings(nats_url=url, nats_user=agent_user(node), nats_password=password)
    return await connect(settings, f"attacker-{node}")


async def _register(client: Client, node: str, job: str, **fields: Any) -> Registered:
    given = {"command": "python train.py", **fields}
    rank = RecordedRank(
        jobId=job,
        nodeId=node,
        deviceRank=0,
        worldSize=1,
        pid=os.getpid(),
        host="127.0.0.1",
        port=5000,
        startedAt=now(),
        **given,
    )
    reply = await client.request(SUBJECTS.record_register(node), encode(rank), timeout=30)
    return decode(reply.data, Registered)


async def _hijack_refused(url: str, data: Path) -> bool:
    """Whether node-b is still refused node-a's live job (after a restart: the owners are
    rebuilt from the stored placements)."""
    b = await _login(url, data, "node-b")
    try:
        told = await _register(b, "node-b", "train-7")
    finally:
        await close(b)
    return told.refused is not None and "may not replace or join it" in told.refused


async def _attack(url: str, data: Path) -> None:
    """Each attack of issue 45 a node's credentials can still try, with what each is told."""
    a, b = await _login(url, data, "node-a"), await _login(url, data, "node-b")
    try:
        assert (await _register(a, "node-a", "train-7")).announced
        for job in range(10):  # the 30 MB command lines that once erased every placement
            huge = await _register(b, "node-b", f"huge-{job}", command="x" * (30 << 20))
            assert "<= 4096" in (huge.refused or ""), huge
        told = await asyncio.gather(
            *(_register(b, "node-b", f"silent-{job}") for job in range(RANKS_PER_NODE + 44))
        )
        assert sum(t.announced for t in told) == RANKS_PER_NODE
        assert sum(t.refused is not None for t in told) == 44
        junk = SUBJECTS.runner("node-b", "demo-0", 1, "phase")
        for _ in range(64):  # its own rank's subject, flooded with what is no telemetry
            await b.publish(junk, os.urandom(1 << 20))
        await b.flush()
    finally:
        await close(a)
        await close(b)


@dataclass
class _Watch:
    """What `/readyz`, `/v1/jobs` and the placement said, twice a second, while a demo
    comes back: the lies found, and how often it was ready."""

    demo: Demo
    lies: list[str] = field(default_factory=list)
    ready_seen: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.wait(0.5):
            try:
                self._look()
            except (urllib.error.URLError, OSError):
                continue  # the gateway is not up yet

    def _look(self) -> None:
        jobs = self.demo.get("/v1/jobs")["jobs"]
        placed = self.demo.get("/v1/placement/runners")
        demo = [r for r in placed if r.get("instanceId") == "demo-0"]
        for job in jobs:
            if job["jobId"] == "demo-0" and job["status"] == "completed" and len(demo) != 2:
                self.lies.append(f"demo-0 completed while {len(demo)} of its ranks are placed")
        try:
            self.demo.get("/readyz")
        except urllib.error.HTTPError as refused:  # 503 while not ready: true either way
            refused.close()
            return
        self.ready_seen += 1
        try:
            self.demo.get("/v1/cluster/diagnosis")
        except urllib.error.HTTPError as failed:
            failed.close()
            self.lies.append(f"/readyz ready while the diagnosis answers {failed.code}")


def test_a_demo_attacked_with_its_nodes_credentials_comes_back_whole_after_a_restart(
    tmp_path: Path,
) -> None:
    port, nats_port, data = free_port(), free_port(), tmp_path / ".rankscope"
    process = launch_demo(data, port, "--nats-auth", nats_port=nats_port)
    try:
        asyncio.run(_attack(f"nats://127.0.0.1:{nats_port}", data))
        assert asyncio.run(_hijack_refused(f"nats://127.0.0.1:{nats_port}", data))
    finally:
        stop_up(process)
    watch = _Watch(Demo(process, f"http://127.0.0.1:{port}", data))
    watching = threading.Thread(target=watch.run, daemon=True)
    watching.start()
    started = time.monotonic()
    process = launch_demo(data, port, "--nats-auth", nats_port=nats_port)  # both ranks ready
    try:
        demo = Demo(process, f"http://127.0.0.1:{port}", data)
        chat = demo.post(
            "/v1/chat/completions",
            {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        )
        back = time.monotonic() - started
        assert chat["choices"][0]["message"]["content"] is not None
        assert back < RESTART_S, f"the demo served again only after {back:.0f} s"
        watch.stop.set()
        watching.join()
        assert watch.ready_seen, "nothing was watched as the demo came back"
        assert watch.lies == [], watch.lies[:5]
        assert demo.get("/v1/cluster/diagnosis")["findings"] == []
        assert asyncio.run(_hijack_refused(f"nats://127.0.0.1:{nats_port}", data))
    finally:
        watch.stop.set()
        stop_up(process)
