"""Snapshots of the aggregator's folded state, so that a restart replays only what came
after them: what one holds, taken from the views and put back into them (pure; the file
is `snapshot_file.py`'s).

A snapshot holds the state and, per stream, the stream's identity (its creation time) and
the last sequence folded in. It is a cache, never the truth: one that comes from another
incarnation of a stream (deleted and made again) or runs past a stream's end is ignored
with a log line, and the views are rebuilt by a full replay.
"""

from __future__ import annotations

from collections import OrderedDict

import msgspec

from rankscope.services.aggregator.pace import PaceHistory, PaceImage
from rankscope.services.aggregator.runners import Runners, RunnerView, TaskView
from rankscope.services.aggregator.seqs import SeqTracker
from rankscope.services.aggregator.store import EntryStore, StoreImage
from rankscope.services.aggregator.views import ClusterState
from rankscope.shared.synopsis import Synopsis
from rankscope.shared.wire import (
    FlightRecord,
    InstanceCreated,
    MlxMemorySnapshot,
    Phase,
    RunnerRef,
    RunnerStatusChanged,
    TaskCreated,
    TaskStatus,
)

__all__ = ["Position", "Snapshot", "capture", "restore"]


class Position(msgspec.Struct, array_like=True, frozen=True):
    """How far into one stream a snapshot goes."""

    created: str
    """The stream's creation time: a stream made again under the same name differs."""
    seq: int
    """The last stream sequence folded into the snapshot."""


class _Runner(msgspec.Struct, array_like=True):
    ref: RunnerRef
    starts: list[int]
    ends: list[int]
    seen: int
    status: RunnerStatusChanged | None
    phase: Phase | None
    phase_detail: str | None
    phase_since: str | None
    last_at: str | None
    step: int | None
    task_id: str | None
    command_id: str | None
    memory: MlxMemorySnapshot | None
    heard: bool
    progressed: bool
    waiting_in: str | None = None
    gave_up: FlightRecord | None = None
    failure: RunnerStatusChanged | None = None
    folded: int = -1
    """The seq of the newest entry its synopsis folded."""
    pace: PaceImage | None = None


class _Task(msgspec.Struct, array_like=True):
    created: TaskCreated
    statuses: dict[str, TaskStatus]


class Snapshot(msgspec.Struct):
    """The folded state and the stream positions it covers."""

    positions: dict[str, Position]
    runners: list[_Runner]
    instances: list[InstanceCreated]
    tasks: dict[str, list[_Task]]
    store: StoreImage
    duplicates: int


def capture(state: ClusterState, positions: dict[str, Position]) -> Snapshot:
    """What `state` holds now, covering `positions` (take both without awaiting between)."""
    return Snapshot(
        positions=positions,
        runners=[
            _Runner(
                ref=view.ref,
                starts=list(view.seqs.starts),
                ends=list(view.seqs.ends),
                seen=view.seqs.seen,
                status=view.status,
                phase=view.synopsis.phase,
                phase_detail=view.synopsis.detail,
                phase_since=view.synopsis.phase_since,
                last_at=view.synopsis.last_at,
                step=view.synopsis.step,
                task_id=view.synopsis.task_id,
                command_id=view.synopsis.command_id,
                memory=view.synopsis.memory,
                heard=view.heard is not None,
                progressed=view.progressed is not None,
                waiting_in=view.waiting_in,
                gave_up=view.gave_up,
                failure=view.failure,
                folded=view.synopsis.seq,
                pace=view.pace.image() if view.pace is not None else None,
            )
            for view in state.runners.values()
        ],
        instances=list(state.instances.values()),
        tasks={
            instance: [_Task(created=t.created, statuses=dict(t.statuses)) for t in tasks.values()]
            for instance, tasks in state.tasks.items()
        },
        store=state.store.image(),
        duplicates=state.duplicates,
    )


def restore(state: ClusterState, snapshot: Snapshot, *, moment: float) -> None:
    """Make `state` hold what `snapshot` held, within its store's limits; runners heard of
    before count as heard at `moment`, as after a full replay.

    Raises:
        ValueError: the snapshot does not hold together; `state` is left unchanged.
    """
    store = EntryStore.from_image(
        snapshot.store,
        per_runner=state.store.per_runner,
        total=state.store.total,
        max_bytes=state.store.max_bytes,
    )
    runners = Runners()
    for held in snapshot.runners:
        if len(held.starts) != len(held.ends):
            raise ValueError(f"runner {held.ref.runnerId!r}: seq runs do not pair up")
        runners.add(
            RunnerView(
                ref=held.ref,
                seqs=SeqTracker(starts=held.starts, ends=held.ends, seen=held.seen),
                status=held.status,
                synopsis=Synopsis(
                    phase=held.phase,
                    phase_since=held.phase_since,
                    detail=held.phase_detail,
                    last_at=held.last_at,
                    task_id=held.task_id,
                    command_id=held.command_id,
                    step=held.step,
                    memory=held.memory,
                    seq=held.folded,
                ),
                progressed=moment if held.progressed else None,
                heard=moment if held.heard else None,
                waiting_in=held.waiting_in,
                gave_up=held.gave_up,
                failure=held.failure,
                pace=PaceHistory.from_image(held.pace) if held.pace is not None else None,
            )
        )
    state.store = store
    state.runners = runners
    state.instances = {i.instanceId: i for i in snapshot.instances}
    state.tasks = {
        instance: OrderedDict(
            (t.created.taskId, TaskView(created=t.created, statuses=dict(t.statuses)))
            for t in tasks
        )
        for instance, tasks in snapshot.tasks.items()
    }
    state.duplicates = snapshot.duplicates
    state.version += 1
