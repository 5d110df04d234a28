"""Recorded jobs through the rank-table service on a nats-server with one user per role:
one node's credentials cannot take, release or join another node's job, bad registrations
get a reason at once and are dead-lettered, and a rank that never reports is let go."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.js.api import RawStreamMsg
from nats.js.errors import NotFoundError

from rankscope.services.ranktable.hub import TableHub
from rankscope.services.ranktable.recorded import RecordLimits
from rankscope.services.ranktable.service import RankTableService
from rankscope.shared.connection import close, connect
from rankscope.shared.jetstream import Layout
from rankscope.shared.nats_auth import OPERATOR, ROLES, agent_user, render
from rankscope.shared.nats_server import EmbeddedNats
from rankscope.shared.provision import ensure
from rankscope.shared.settings import Settings
from rankscope.shared.timestamps import now
from rankscope.shared.wire import (
    InstanceCreated,
    InstanceReleased,
    PlacementEvent,
    RecordedRank,
    Registered,
    decode,
    encode,
)

pytestmark = [pytest.mark.nats, pytest.mark.timeout(120)]

NODES = ("node-a", "node-b")
LAYOUT = Layout()
SUBJECTS = LAYOUT.subjects
PASSWORDS = {user: f"pw-{user}" for user in (*ROLES, OPERATOR, *(agent_user(n) for n in NODES))}
DEADLINE_S = 1.5


@dataclass
class Cluster:
    server: EmbeddedNats
    service: RankTableService
    nodes: dict[str, Client]

    async def register(self, node: str, **fields: object) -> Registered:
        rank = _rank(node, **fields)
        return await self.ask(node, encode(rank))

    async def ask(self, node: str, body: bytes) -> Registered:
        reply = await self.nodes[node].request(SUBJECTS.record_register(node), body, timeout=5)
        return decode(reply.data, Registered)

    async def placements(self, job: str) -> list[PlacementEvent]:
        stored = await self._stored(LAYOUT.recorded_stream.name, SUBJECTS.recorded(job))
        return [decode(msg.data or b"", PlacementEvent) for msg in stored]

    async def dead_letters(self) -> list[str]:
        await self.service.dead_letters.settled()
        stored = await self._stored(LAYOUT.deadletter_stream.name)
        return [(msg.headers or {}).get("Rankscope-Kind", "") for msg in stored]

    async def _stored(self, stream: str, subject: str | None = None) -> list[RawStreamMsg]:
        """Every message `stream` holds (of `subject`), read as the operator."""
        operator = await _login(self.server, OPERATOR)
        js = operator.jetstream(timeout=2)
        found: list[RawStreamMsg] = []
        while True:
            after = found[-1].seq or 0 if found else 0
            try:
                found.append(await js.get_msg(stream, after + 1, next=True, subject=subject))
            except NotFoundError:
                break
        await close(operator)
        return found


def _rank(node: str, **fields: object) -> RecordedRank:
    rank = RecordedRank(
        jobId="train-7",
        nodeId=node,
        deviceRank=0,
        worldSize=1,
        pid=4242,
        host="127.0.0.1",
        port=5000,
        command="python train.py",
        startedAt=now(),
    )
    return msgspec.structs.replace(rank, **fields)


async def _login(server: EmbeddedNats, user: str) -> Client:
    settings = Settings(nats_url=server.url, nats_user=user, nats_password=PASSWORDS[user])
    return await connect(settings, f"test-{user}")


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    server = EmbeddedNats(store_dir=tmp_path, config=render(LAYOUT, NODES, PASSWORDS)).start()
    nc = await _login(server, "ranktable")
    js = nc.jetstream()
    await ensure(js, LAYOUT)
    service = RankTableService(
        js=js,
        layout=LAYOUT,
        hub=TableHub(),
        port_base=52000,
        nc=nc,
        record_limits=RecordLimits(ranks_per_node=4, deadline_s=DEADLINE_S),
    )
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    await asyncio.wait_for(service.ready.wait(), 10)
    nodes = {node: await _login(server, agent_user(node)) for node in NODES}
    yield Cluster(server, service, nodes)
    stop.set()
    await task
    for client in (*nodes.values(), nc):
        await close(client)
    server.stop()


async def test_another_node_cannot_take_a_live_job_and_is_told_why(cluster: Cluster) -> None:
    mine = await cluster.register("node-a")
    assert mine.announced
    forged = await cluster.register("node-b", pid=999)
    assert forged.runner is None
    assert forged.refused == (
        "job train-7 is running on node-a: node node-b may not replace or join it "
        "(a new run of the job may start once it ended)"
    )
    (created,) = await cluster.placements("train-7")
    assert isinstance(created, InstanceCreated)
    assert [a.nodeId for a in created.assignments] == ["node-a"]
    assert "registration_refused" in await cluster.dead_letters()
    again = await cluster.register("node-a", pid=1000)  # its own node starts it anew
    assert again.announced
    assert [type(e) for e in await cluster.placements("train-7")] == [
        InstanceCreated,
        InstanceReleased,
        InstanceCreated,
    ]
    operator = await _login(cluster.server, OPERATOR)
    placed = await operator.jetstream().stream_info(LAYOUT.placement_stream.name)
    assert placed.state.messages == 0  # the placed instances' stream holds none of them
    await close(operator)


async def test_a_node_cannot_register_on_another_node_s_subject(cluster: Cluster) -> None:
    body = encode(_rank("node-a"))
    with pytest.raises((TimeoutError, NatsError)):
        await cluster.nodes["node-b"].request(SUBJECTS.record_register("node-a"), body, timeout=1)
    assert await cluster.placements("train-7") == []


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"jobId": ""}, "Expected `str` of length >= 1"),
        ({"jobId": "x" * 600}, "Expected `str` of length <= 480"),
        ({"jobId": "../../etc"}, "job id '../../etc' is '.' or '..' or holds '/'"),
        ({"command": "x" * (30 << 20)}, "Expected `str` of length <= 4096"),
        ({"host": "h" * 256}, "Expected `str` of length <= 255"),
        ({"pid": 1 << 40}, "Expected `int` <= 4194304"),
        ({"worldSize": 100_000}, "Expected `int` <= 4096"),
    ],
)
async def test_a_bad_registration_is_refused_at_once_with_its_reason(
    cluster: Cluster, fields: dict[str, object], said: str
) -> None:
    answer = await cluster.register("node-a", **fields)
    assert answer.runner is None
    assert answer.refused is not None
    assert said in answer.refused, answer.refused
    assert await cluster.dead_letters() == ["registration_refused"]
    assert (await cluster.register("node-a")).announced  # nothing else was lost


async def test_a_node_holds_only_its_share_and_silent_ranks_are_let_go(cluster: Cluster) -> None:
    for job in range(4):
        assert (await cluster.register("node-a", jobId=f"j{job}")).announced
    over = await cluster.register("node-a", jobId="j4")
    assert over.refused == (
        "node node-a holds 4 recorded ranks, the most one node may "
        "(RANKSCOPE_RECORD_RANKS_PER_NODE=4)"
    )
    assert (await cluster.register("node-b", jobId="j4")).announced  # another node's share
    for _ in range(100):  # none of node-a's ranks ever reported
        if not {f"j{j}" for j in range(4)} & set(cluster.service.placements):
            break
        await asyncio.sleep(0.1)
    released = (await cluster.placements("j0"))[-1]
    assert isinstance(released, InstanceReleased)
    assert released.reason == (
        f"rank 0 of job j0 never reported within {DEADLINE_S:g} s of its announcement"
    )
    assert (await cluster.register("node-a", jobId="j5")).announced


async def test_a_job_that_cannot_be_announced_now_is_asked_for_again_not_refused(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    publish = cluster.service._publish_placement
    failures = [TimeoutError("JetStream did not acknowledge")]

    async def flaky(*args: Any, **kwargs: Any) -> None:
        if failures:
            raise failures.pop()
        await publish(*args, **kwargs)

    monkeypatch.setattr(cluster.service, "_publish_placement", flaky)
    body = encode(_rank("node-a"))
    with pytest.raises((TimeoutError, NatsError)):  # no answer: the rank asks again
        await cluster.nodes["node-a"].request(SUBJECTS.record_register("node-a"), body, timeout=1)
    assert (await cluster.ask("node-a", body)).announced
    assert await cluster.dead_letters() == []
