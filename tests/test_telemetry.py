"""Telemetry reaches JetStream batched, deduplicated, in full across a NATS restart, and
what cannot be kept is counted."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.js.api import DeliverPolicy

from rankscope.shared.connection import connect
from rankscope.shared.jetstream import Layout
from rankscope.shared.nats_server import EmbeddedNats
from rankscope.shared.provision import ensure
from rankscope.shared.settings import Settings
from rankscope.shared.telemetry import TelemetryPublisher
from rankscope.shared.timestamps import now
from rankscope.shared.wire import FlightEntry, Phase, PhaseEntries, RunnerRef, decode
from tests.stack_up import free_port

pytestmark = pytest.mark.nats

RUNNER = RunnerRef(
    runnerId="i-a0-r0", nodeId="node-a", instanceId="i", modelId="m", deviceRank=0, worldSize=2
)


def _entry(seq: int) -> FlightEntry:
    return FlightEntry(
        seq=seq, at=now(), phase=Phase.DECODE_STREAM, event="token", attrs={"step": seq}
    )


async def _stored(nc: Client, layout: Layout) -> list[tuple[str, list[int]]]:
    """Every phase message in the stream: its msg id and the seqs it carries."""
    js = nc.jetstream()
    info = await js.stream_info(layout.runner_stream.name)
    found: list[tuple[str, list[int]]] = []
    if not info.state.messages:
        return found
    sub = await js.subscribe(
        layout.subjects.runner_all(), ordered_consumer=True, deliver_policy=DeliverPolicy.ALL
    )
    for _ in range(info.state.messages):
        msg = await sub.next_msg(timeout=5)
        batch = decode(msg.data, PhaseEntries)
        found.append(((msg.headers or {})["Nats-Msg-Id"], [e.seq for e in batch.entries]))
    await sub.unsubscribe()
    return found


@contextlib.asynccontextmanager
async def _running(publisher: TelemetryPublisher) -> AsyncIterator[None]:
    stop = asyncio.Event()
    task = asyncio.create_task(publisher.run(stop))
    yield
    stop.set()
    await task


@pytest.fixture
async def ready(nc: Client, layout: Layout) -> Layout:
    await ensure(nc.jetstream(), layout)
    return layout


async def test_entries_are_batched_with_deterministic_ids(nc: Client, ready: Layout) -> None:
    publisher = TelemetryPublisher(nc=nc, flush_after=10.0)
    subject = ready.subjects.runner("node-a", "i", 0, "phase")
    async with _running(publisher):
        for seq in range(130):
            publisher.entry(RUNNER, subject, _entry(seq))
        publisher.entry(RUNNER, subject, _entry(130))  # lone entry: flushed on stop
        assert publisher.pending == 131
    stored = await _stored(nc, ready)
    assert [msg_id for msg_id, _ in stored] == ["i-a0-r0:0-63", "i-a0-r0:64-127", "i-a0-r0:128-130"]
    assert [seq for _, seqs in stored for seq in seqs] == list(range(131))
    assert publisher.published_entries == 131
    assert publisher.acknowledged == {"i-a0-r0": 130}  # what a probe of the agent reports


async def test_task_statuses_and_telemetry_messages_share_the_queue_but_not_the_seqs(
    nc: Client, ready: Layout
) -> None:
    publisher = TelemetryPublisher(nc=nc, flush_after=0.01)
    status_subject = ready.subjects.task_status("i", "node-a")
    memory_subject = ready.subjects.runner("node-a", "i", 0, "memory")
    async with _running(publisher):
        publisher.message(status_subject, b"{}", "task-1:i-a0-r0:Complete")
        publisher.telemetry(memory_subject, b"{}", "i-a0-r0", 7)
        await publisher.settled()
    assert publisher.published_entries == 2
    assert publisher.acknowledged == {"i-a0-r0": 7}  # a task status carries no seq


async def test_a_runner_status_goes_behind_its_older_entries(nc: Client, ready: Layout) -> None:
    publisher = TelemetryPublisher(nc=nc, flush_after=10.0, max_in_flight=1)
    got: list[str] = []

    async def keep(msg: object) -> None:
        got.append(msg.subject.rsplit(".", 1)[1])  # type: ignore[attr-defined]

    await nc.subscribe(ready.subjects.runner_all(), cb=keep)
    async with _running(publisher):
        publisher.entry(RUNNER, ready.subjects.runner("node-a", "i", 0, "phase"), _entry(0))
        status = ready.subjects.runner("node-a", "i", 0, "status")
        publisher.telemetry(status, b"{}", RUNNER.runnerId, 1)  # newer than the open batch
        await publisher.settled()
    await nc.flush()
    assert got == ["phase", "status"]


async def test_a_quiet_runner_is_flushed_within_the_window(nc: Client, ready: Layout) -> None:
    publisher = TelemetryPublisher(nc=nc, flush_after=0.05)
    got: asyncio.Queue[bytes] = asyncio.Queue()

    async def keep(msg: object) -> None:
        await got.put(msg.data)  # type: ignore[attr-defined]

    await nc.subscribe(ready.subjects.runner_all(), cb=keep)
    async with _running(publisher):
        publisher.entry(RUNNER, ready.subjects.runner("node-a", "i", 0, "phase"), _entry(0))
        batch = decode(await asyncio.wait_for(got.get(), 5), PhaseEntries)
        assert [e.seq for e in batch.entries] == [0]


@pytest.mark.parametrize(
    ("entries", "outage"),
    [(100, 0.0), (2000, 3.0)],
    ids=["restart", "seconds-away-with-a-backlog"],
)
async def test_nothing_is_lost_across_a_nats_restart(
    tmp_path: Path, layout: Layout, entries: int, outage: float
) -> None:
    """The backlog case once wedged the publisher for good: its sends, failing while the
    client's outbound buffer (4 KiB here) was full, used up nats-py's publish slots."""
    port, store = free_port(), tmp_path / "nats"
    server = EmbeddedNats(store_dir=store, port=port).start()
    settings = Settings(nats_url=server.url, subject_prefix=layout.subjects.prefix)
    nc = await connect(settings, "publisher-test", pending_size=4096)
    await ensure(nc.jetstream(), layout)
    publisher = TelemetryPublisher(nc=nc, max_batch=4, ack_timeout=0.5)
    subject = layout.subjects.runner("node-a", "i", 0, "phase")
    try:
        async with _running(publisher):
            for seq in range(40):
                publisher.entry(RUNNER, subject, _entry(seq))
            await asyncio.wait_for(publisher.settled(), 10)
            server.stop()
            for seq in range(40, entries):
                publisher.entry(RUNNER, subject, _entry(seq))
            await asyncio.sleep(outage)
            server = EmbeddedNats(store_dir=store, port=port).start()
            await asyncio.wait_for(publisher.settled(), 30)
        stored = await _stored(nc, layout)
        seqs = sorted(seq for _, batch in stored for seq in batch)
        assert seqs == list(range(entries))  # complete, and no batch stored twice
        assert publisher.dropped_entries == 0
    finally:
        await nc.close()
        server.stop()


async def test_past_the_bound_the_oldest_is_dropped_and_counted(
    tmp_path: Path, layout: Layout
) -> None:
    server = EmbeddedNats(store_dir=tmp_path / "nats").start()
    nc = await connect(Settings(nats_url=server.url), "publisher-test")
    await ensure(nc.jetstream(), layout)
    server.stop()  # NATS is gone before anything is sent
    publisher = TelemetryPublisher(nc=nc, max_batch=10, max_buffered=30)
    subject = layout.subjects.runner("node-a", "i", 0, "phase")
    for seq in range(100):
        publisher.entry(RUNNER, subject, _entry(seq))
    assert publisher.dropped_entries == 70
    assert publisher.pending == 30
    await nc.close()
