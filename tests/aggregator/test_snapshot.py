"""Snapshots: a restart from one serves the same views as a full replay and reads only
what came after it; a damaged snapshot, or one of another incarnation of the streams, is
ignored, never trusted."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from rankscope.services.aggregator import answers
from rankscope.services.aggregator.rules import Thresholds
from rankscope.services.aggregator.service import AggregatorService
from rankscope.services.aggregator.snapshot_file import SnapshotFile
from rankscope.services.aggregator.store import EntryStore
from rankscope.services.aggregator.views import ClusterState
from rankscope.shared.jetstream import Layout
from rankscope.shared.provision import ensure
from rankscope.shared.wire import (
    Phase,
    TaskCreated,
    TaskKind,
    TaskStatus,
    TaskStatusChanged,
    TimelineQuery,
    encode,
)
from tests.aggregator.builders import at, entries, placed, rank
from tests.aggregator.running import WAIT, aggregator, publish, until

pytestmark = pytest.mark.nats


async def _history(nc: Client, layout: Layout, first: int, count: int) -> None:
    """Entries `first`.. of both ranks, with a seq skipped now and then, and a task."""
    js = nc.jetstream()
    for index in (0, 1):
        await publish(
            nc,
            layout,
            entries(
                rank(index),
                *[(s, s, Phase.DECODE_STREAM, s) for s in range(first, first + count) if s % 7],
            ),
        )
    task = TaskCreated(
        at=at(first),
        instanceId="i",
        taskId=f"t{first}",
        commandId=f"c{first}",
        taskKind=TaskKind.TEXT_GENERATION,
    )
    await js.publish(layout.subjects.tasks("i"), encode(task))
    done = TaskStatusChanged(
        at=at(first + 1),
        instanceId="i",
        taskId=f"t{first}",
        runnerId="i-r0",
        taskStatus=TaskStatus.COMPLETE,
    )
    await js.publish(layout.subjects.task_status("i", "node-0"), encode(done))


def _views(service: AggregatorService) -> tuple[object, ...]:
    state = service.state
    timeline = answers.timeline(
        state, TimelineQuery(limit=100_000), local_node_id="agg", now=time.time()
    )
    filtered = [
        answers.timeline(state, query, local_node_id="agg", now=time.time())
        for query in (TimelineQuery(instanceId="i"), TimelineQuery(nodeId="node-1"))
    ]
    return (
        timeline.timeline,
        [(f.timeline, [r.runnerId for r in f.runners]) for f in filtered],
        [(r.runnerId, r.phase, r.lastProgressAt, r.activeTaskId) for r in timeline.runners],
        answers.history(state, Thresholds()),
        answers.placement(state, local_node_id="agg"),
        answers.instance_states(state),
        state.duplicates,
    )


async def _rebuilt(
    nc: Client, layout: Layout, snapshots: SnapshotFile | None
) -> tuple[object, ...]:
    async with aggregator(nc, layout, snapshots=snapshots) as running:
        await until(lambda: running.service.state.store.size == 2 * 171)
        views = _views(running.service)
        read = running.service.ingest.folding[layout.runner_stream.name].handled
    return (*views, read)


async def _snapshotted(nc: Client, layout: Layout, tmp_path: Path) -> SnapshotFile:
    """An instance and 100 rounds of history, folded by an aggregator that then stopped."""
    snapshots = SnapshotFile(tmp_path / "aggregator.snapshot")
    await publish(nc, layout, placed())
    await _history(nc, layout, 0, 100)
    async with aggregator(nc, layout, snapshots=snapshots) as running:
        await until(lambda: running.service.state.store.size == 2 * 85)
    return snapshots


async def test_a_restart_from_a_snapshot_serves_what_a_full_replay_serves(
    nc: Client, js_ready: Layout, tmp_path: Path
) -> None:
    snapshots = await _snapshotted(nc, js_ready, tmp_path)
    assert snapshots.path.exists()  # written on the way out
    await _history(nc, js_ready, 100, 100)  # arrives while no aggregator runs
    *restored, read_after_snapshot = await _rebuilt(nc, js_ready, snapshots)
    *replayed, read_in_full = await _rebuilt(nc, js_ready, None)
    assert restored == replayed
    assert (read_after_snapshot, read_in_full) == (2, 4)  # one batch per rank per round


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[: len(data) // 2],
        lambda data: data[:-1] + bytes([data[-1] ^ 1]),
        lambda data: b"not a snapshot at all",
    ],
    ids=["truncated", "bit-flip", "garbage"],
)
async def test_a_damaged_snapshot_is_ignored_and_the_views_rebuilt_in_full(
    nc: Client, js_ready: Layout, tmp_path: Path, damage: object
) -> None:
    snapshots = await _snapshotted(nc, js_ready, tmp_path)
    snapshots.path.write_bytes(damage(snapshots.path.read_bytes()))  # type: ignore[operator]
    await _history(nc, js_ready, 100, 100)
    *rebuilt, read = await _rebuilt(nc, js_ready, snapshots)
    *replayed, _ = await _rebuilt(nc, js_ready, None)
    assert rebuilt == replayed
    assert read == 4


async def test_a_snapshot_of_streams_since_made_again_is_ignored(
    nc: Client, js_ready: Layout, tmp_path: Path
) -> None:
    snapshots = await _snapshotted(nc, js_ready, tmp_path)
    js = nc.jetstream()
    for stream in js_ready.streams:
        await js.delete_stream(stream.name)
    await ensure(js, js_ready)
    await publish(nc, js_ready, placed())
    await _history(nc, js_ready, 200, 2)
    async with aggregator(nc, js_ready, EntryStore(), snapshots=snapshots) as running:
        await until(lambda: running.service.state.store.size == 2 * 2)
        history = answers.history(running.service.state, Thresholds())
    assert [(h.firstSeq, h.lastSeq) for h in history] == [(200, 201), (200, 201)]


async def test_a_snapshot_that_cannot_be_written_says_why_and_the_aggregator_goes_on(
    nc: Client, js_ready: Layout, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "file").write_text("a file where the snapshots' folder should be")
    snapshots = SnapshotFile(tmp_path / "file" / "aggregator.snapshot")
    await publish(nc, js_ready, placed())
    await _history(nc, js_ready, 0, 10)
    async with aggregator(nc, js_ready, snapshots=snapshots) as running:
        await until(lambda: running.service.state.store.size == 2 * 8)
        await running.service.snapshot()
        await _history(nc, js_ready, 10, 10)
        await until(lambda: running.service.state.store.size == 2 * 17)  # still folding
    refused = [r.getMessage() for r in caplog.records if "snapshot not written" in r.getMessage()]
    assert len(refused) == 2  # the one asked for, and the one on the way out
    assert all("File exists" in message for message in refused)  # the copy's own reason


def _beside(snapshots: SnapshotFile) -> list[str]:
    """Files named after the snapshot besides it."""
    path = snapshots.path
    return [p.name for p in path.parent.glob(f"{path.name}*") if p != path]


def _children() -> set[str]:
    """Processes this one started that have not been reaped yet."""
    return {
        pid
        for task in Path("/proc/self/task").iterdir()
        for pid in (task / "children").read_text().split()
    }


async def test_a_snapshot_cancelled_while_its_copy_writes_leaves_nothing_behind(
    nc: Client, js_ready: Layout, tmp_path: Path
) -> None:
    snapshots = await _snapshotted(nc, js_ready, tmp_path)
    kept = snapshots.path.read_bytes()
    await _history(nc, js_ready, 100, 100)
    async with aggregator(nc, js_ready, snapshots=snapshots) as running:
        await until(lambda: running.service.state.store.size == 2 * 171)
        before = _children()
        for _ in range(20):
            writing = asyncio.create_task(running.service.snapshot())
            await asyncio.sleep(0)
            writing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writing
            assert _beside(snapshots) == []  # no temporary file
            assert _children() == before  # the copy stopped and reaped, no zombie
            running.service.state.version += 1  # something changed: the next one writes
        await running.service.snapshot()
        assert snapshots.path.read_bytes() != kept
    *restored, read = await _rebuilt(nc, js_ready, snapshots)
    *replayed, _ = await _rebuilt(nc, js_ready, None)
    assert restored == replayed
    assert read == 0


async def test_a_stop_while_catching_up_ends_it_there_and_keeps_the_last_snapshot(
    nc: Client, js_ready: Layout, tmp_path: Path
) -> None:
    snapshots = await _snapshotted(nc, js_ready, tmp_path)
    kept = snapshots.path.read_bytes()
    await _history(nc, js_ready, 100, 100)  # a backlog to read back
    service = AggregatorService(
        nc=nc,
        js=nc.jetstream(),
        layout=js_ready,
        state=ClusterState(store=EntryStore()),
        node_id="agg",
        snapshots=snapshots,
    )
    stop = asyncio.Event()
    fold = service.ingest.on_telemetry

    def stopped_then_fold(msg: Msg) -> None:  # stopped as the backlog is read
        stop.set()
        fold(msg)

    service.ingest.on_telemetry = stopped_then_fold  # type: ignore[method-assign]
    await asyncio.wait_for(service.run(stop), WAIT)
    assert not service.ready.is_set()
    assert snapshots.path.read_bytes() == kept
