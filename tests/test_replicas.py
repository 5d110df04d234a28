"""On a 3-server NATS cluster, every stream and bucket keeps `RANKSCOPE_REPLICAS` copies:
at creation, and after `ensure` on ones that exist with another count (up and down). With
three, losing a stream's leader loses no telemetry; a stream without a leader is told."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import ServiceUnavailableError

from rankscope.shared.connection import close, connect
from rankscope.shared.jetstream import Layout, publish_acked
from rankscope.shared.nats_server import EmbeddedNats
from rankscope.shared.provision import LayoutError, ensure
from rankscope.shared.settings import Settings, SettingsError, load
from rankscope.shared.storage import Storage
from rankscope.shared.telemetry import TelemetryPublisher
from rankscope.shared.timestamps import now
from rankscope.shared.wire import FlightEntry, Phase, PhaseEntries, RunnerRef, decode
from tests.nats_cluster import nats_cluster, until_jetstream_answers

pytestmark = pytest.mark.slow  # three nats-servers a test

ENTRIES = 3000
"""Per runner, of 4, in the leader-loss test."""

T = TypeVar("T")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[list[EmbeddedNats]]:
    with nats_cluster(tmp_path / "cluster") as servers:
        yield servers


@pytest.fixture
async def nc(cluster: list[EmbeddedNats]) -> AsyncIterator[Client]:
    urls = [s.url for s in cluster]
    await until_jetstream_answers(urls)
    client = await connect(Settings(nats_url=",".join(urls)), "test-replicas")
    yield client
    await close(client)


async def _copies(nc: Client, layout: Layout) -> set[tuple[int, int]]:
    """(copies asked, current copies the cluster holds) of every stream, buckets' included."""
    js, found = nc.jetstream(), set()
    for name in layout.stream_names:
        info = await js.stream_info(name)
        peers = info.cluster.replicas if info.cluster and info.cluster.replicas else []
        found.add((info.config.num_replicas or 1, 1 + sum(1 for p in peers if p.current)))
    return found


async def _until_held(nc: Client, layout: Layout, copies: int) -> None:
    """Wait until every stream is held `copies` times (the cluster moves them meanwhile)."""
    for _ in range(100):
        if await _copies(nc, layout) == {(copies, copies)}:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"not {copies} copies each: {await _copies(nc, layout)}")


async def _held_three_times(nc: Client) -> tuple[Layout, JetStreamContext]:
    """Every stream and bucket made with three copies, all of them current."""
    layout, js = Layout(replicas=3), nc.jetstream()
    await ensure(js, layout)
    await _until_held(nc, layout, 3)
    return layout, js


async def _leader(js: JetStreamContext, cluster: list[EmbeddedNats], stream: str) -> EmbeddedNats:
    """The server leading `stream`."""
    placed = (await js.stream_info(stream)).cluster
    assert placed is not None
    return next(s for s in cluster if s.store_dir.name == placed.leader)


async def _once_answered(ask: Callable[[], Awaitable[T]]) -> T:
    """What `ask` returns once JetStream answers it: for a while after a server's loss
    (its elections), JetStream may say it is temporarily unavailable."""
    for _ in range(150):
        try:
            return await ask()
        except (ServiceUnavailableError, TimeoutError):
            await asyncio.sleep(0.2)
    return await ask()


def _kill(server: EmbeddedNats) -> None:
    assert server.pid is not None
    os.kill(server.pid, signal.SIGKILL)


async def test_every_stream_and_bucket_is_kept_three_times_and_can_scale(nc: Client) -> None:
    layout, js = await _held_three_times(nc)
    await js.publish(layout.subjects.placement("i"), b"{}", headers={"Nats-Msg-Id": "one"})
    await ensure(js, Layout(replicas=1))  # down
    await _until_held(nc, layout, 1)
    await ensure(js, layout)  # and up again
    await _until_held(nc, layout, 3)
    kept = await js.get_last_msg(layout.placement_stream.name, layout.subjects.placement("i"))
    assert kept.data == b"{}"  # what they held is kept through both


async def test_killing_the_telemetry_stream_leader_loses_and_doubles_no_entry(
    nc: Client, cluster: list[EmbeddedNats]
) -> None:
    layout, js = await _held_three_times(nc)
    stream = layout.runner_stream.name
    publisher = TelemetryPublisher(nc=nc, ack_timeout=1.0)
    stop = asyncio.Event()
    running = asyncio.create_task(publisher.run(stop))
    refs = [
        RunnerRef(runnerId=f"r{rank}", nodeId="n", instanceId="i", modelId="m",
                  deviceRank=rank, worldSize=4)
        for rank in range(4)
    ]  # fmt: skip
    for seq in range(ENTRIES):
        for ref in refs:
            subject = layout.subjects.runner("n", "i", ref.deviceRank, "phase")
            entry = FlightEntry(seq=seq, at=now(), phase=Phase.DECODE_STREAM, event="token")
            publisher.entry(ref, subject, entry)
        if seq % 50 == 0:
            await asyncio.sleep(0.01)  # ingest keeps flowing while the leader goes
        if seq == ENTRIES // 3:
            killed = await _leader(js, cluster, stream)
            _kill(killed)
    try:
        for _ in range(600):
            if publisher.pending == 0:
                break
            await asyncio.sleep(0.1)
        assert publisher.pending == 0, "ingest did not resume after the election"
        stop.set()
        await running
        held: dict[str, list[int]] = {ref.runnerId: [] for ref in refs}
        last = (await _once_answered(functools.partial(js.stream_info, stream))).state.last_seq
        for position in range(1, last + 1):
            stored = await _once_answered(functools.partial(js.get_msg, stream, position))
            batch = decode(stored.data or b"", PhaseEntries)
            held[batch.runner.runnerId] += [e.seq for e in batch.entries]
        for runner_id, seqs in held.items():
            assert sorted(seqs) == list(range(ENTRIES)), f"{runner_id}: lost or doubled"
        assert publisher.retries > 0  # the leader's loss was felt, and ridden out
    finally:
        killed.restart()


async def test_a_write_rides_out_the_election_of_its_streams_new_leader(
    nc: Client, cluster: list[EmbeddedNats]
) -> None:
    layout, js = await _held_three_times(nc)
    stream = layout.tasks_stream.name
    leader = await _leader(js, cluster, stream)
    _kill(leader)
    try:
        subject = layout.subjects.tasks("i")
        stored = await publish_acked(js, subject, b"{}", msg_id="task-1")
        again = await publish_acked(js, subject, b"{}", msg_id="task-1")  # a client's retry
        assert again.duplicate
        assert again.seq == stored.seq
        assert (await js.stream_info(stream)).state.messages == 1
    finally:
        leader.restart()


async def test_a_stream_whose_only_copy_is_gone_makes_storage_fail_naming_it(
    nc: Client, cluster: list[EmbeddedNats]
) -> None:
    layout, js = Layout(replicas=1), nc.jetstream()
    await ensure(js, layout)
    storage = Storage(js, layout.subjects.canary("test"), timeout=1.0, streams=layout.stream_names)
    assert await storage.check()
    holder = await _leader(js, cluster, layout.runner_stream.name)
    holder.stop()  # its other streams may still be stored elsewhere, the canary's too
    try:
        assert not await storage.check()
        assert any(f"stream {name}" in storage.reason for name in layout.stream_names)
        assert "JetStream not storing since" in storage.why()
    finally:
        holder.restart()
    for _ in range(100):  # the server is back with its streams: storing again
        if await storage.check():
            break
        await asyncio.sleep(0.2)
    assert storage.storing, storage.reason


async def test_ensure_waits_while_a_starting_cluster_elects_its_leaders(tmp_path: Path) -> None:
    with nats_cluster(tmp_path / "cluster") as servers:  # not waiting for JetStream
        nc = await connect(Settings(nats_url=",".join(s.url for s in servers)), "test")
        try:
            layout = Layout(replicas=3)
            await ensure(nc.jetstream(), layout)
            await _until_held(nc, layout, 3)
        finally:
            await close(nc)


async def test_ensure_gives_up_in_one_line_when_jetstream_never_answers(
    cluster: list[EmbeddedNats],
) -> None:
    await until_jetstream_answers([s.url for s in cluster])
    for server in cluster[1:]:
        server.stop()  # one of three: no quorum to elect anything
    nc = await connect(Settings(nats_url=cluster[0].url), "test")
    try:
        # the survivor may still think itself the meta leader, or know it is not
        said = r"^after 2s: JetStream (did not answer|cannot place stream \S+ on 3 servers)"
        with pytest.raises(LayoutError, match=said):
            await ensure(nc.jetstream(), Layout(replicas=3), patience=2)
    finally:
        await close(nc)


async def test_more_copies_than_servers_is_refused_in_one_line_naming_the_setting(
    nc: Client,
) -> None:
    with pytest.raises(LayoutError, match=r"cannot place stream \S+ on 5 servers.*REPLICAS"):
        await ensure(nc.jetstream(), Layout(replicas=5), patience=1)


async def test_two_of_three_servers_lost_and_back_leave_every_stream_storing(
    nc: Client, cluster: list[EmbeddedNats]
) -> None:
    layout, js = await _held_three_times(nc)
    storage = Storage(js, layout.subjects.canary("test"), timeout=1.0, streams=layout.stream_names)
    assert await storage.check()
    lost = cluster[1:]
    for server in lost:
        _kill(server)
    for _ in range(50):  # the survivor notices its peers are gone
        if not await storage.check():
            break
    assert any(f"stream {name}" in storage.reason for name in layout.stream_names)
    for server in lost:
        server.restart()
    for _ in range(100):
        if await storage.check():
            break
        await asyncio.sleep(0.5)
    assert storage.storing, storage.reason
    await _until_held(nc, layout, 3)


def test_the_setting_takes_what_jetstream_can_keep(tmp_path: Path) -> None:
    assert load(None, {"RANKSCOPE_REPLICAS": "3"}).replicas == 3
    with pytest.raises(SettingsError, match="at most 5 copies"):
        load(None, {"RANKSCOPE_REPLICAS": "7"})
    with pytest.raises(SettingsError, match="positive"):
        load(None, {"RANKSCOPE_REPLICAS": "0"})
