"""The views an operator asks for, built from the aggregator's state: the cross-rank
`ClusterTimeline` (seed 001), placement diagnostics (seed 000), each runner's history
coverage and each instance's ready and lost ranks. Pure: the state and its clocks in, the
view out."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import msgspec

from rankscope.services.aggregator.rules import Thresholds, straggle_of
from rankscope.services.aggregator.runners import RunnerView, TaskView
from rankscope.services.aggregator.store import Selection
from rankscope.services.aggregator.views import ClusterState
from rankscope.shared.timestamps import from_micros, micros, to_epoch
from rankscope.shared.wire import (
    ClusterTimeline,
    InstanceCreated,
    InstanceState,
    Phase,
    PlacementRunnerDiagnostics,
    PlacementTaskDiagnostics,
    RankState,
    RunnerAssignment,
    RunnerHistory,
    RunnerRef,
    RunnerStatusKind,
    RunnerSynopsis,
    TaskStatus,
    TimelineEntry,
    TimelineQuery,
)

__all__ = [
    "TimelinePlan",
    "history",
    "instance_states",
    "placement",
    "timeline",
    "timeline_plan",
]


class TimelinePlan:
    """A timeline answer in the making: its head (every field but the entries) and the
    entries it will hold, built by slices in order."""

    def __init__(
        self, head: ClusterTimeline, selection: Selection, refs: dict[str, RunnerRef]
    ) -> None:
        self.head = head
        self.selection = selection
        self._refs = refs

    @property
    def size(self) -> int:
        """Entries the answer will hold."""
        return len(self.selection.rows)

    def entries(self, start: int, stop: int) -> list[TimelineEntry]:
        """Entries `[start, stop)` of the answer, oldest first."""
        rows = self.selection.rows[start:stop]
        return [
            stored.of(self._refs[row[3]])
            for row, stored in zip(rows, self.selection.read(start, stop), strict=True)
        ]


def _unseen(view: RunnerView) -> int:
    """Acknowledged seqs newer than the newest received."""
    if view.acknowledged is None:
        return 0
    last = view.seqs.last
    return max(view.acknowledged - (-1 if last is None else last), 0)


def _selected(state: ClusterState, query: TimelineQuery) -> list[RunnerView]:
    if query.instanceId is not None:
        candidates = state.runners.of_instance(query.instanceId)
    elif query.nodeId is not None:
        candidates = state.runners.on_node(query.nodeId)
    else:
        candidates = state.runners.values()
    return [
        view
        for view in candidates
        if (query.instanceId is None or view.ref.instanceId == query.instanceId)
        and (query.nodeId is None or view.ref.nodeId == query.nodeId)
        and (query.modelId is None or view.ref.modelId == query.modelId)
    ]


def _synopsis(state: ClusterState, view: RunnerView, moment: float) -> RunnerSynopsis:
    status = view.status
    return RunnerSynopsis(
        nodeId=view.ref.nodeId,
        runnerId=view.ref.runnerId,
        instanceId=view.ref.instanceId,
        modelId=view.ref.modelId,
        deviceRank=view.ref.deviceRank,
        worldSize=view.ref.worldSize,
        pid=status.pid if status else None,
        processAlive=view.alive if status else False,
        statusKind=status.statusKind.value if status else RunnerStatusKind.IDLE.value,
        phase=view.synopsis.phase or Phase.CREATED,
        phaseDetail=view.synopsis.detail,
        secondsInPhase=round(max(moment - to_epoch(view.synopsis.phase_since), 0.0), 3)
        if view.synopsis.phase_since
        else 0.0,
        lastProgressAt=view.synopsis.last_at,
        activeTaskId=view.synopsis.task_id,
        activeCommandId=view.synopsis.command_id,
        lastMlxMemory=view.synopsis.memory,
        recorded=True if state.recorded(view) else msgspec.UNSET,
    )


def timeline_plan(
    state: ClusterState, query: TimelineQuery, *, local_node_id: str, now: float
) -> TimelinePlan:
    """What the seed-001 `ClusterTimeline` under `query`'s filters holds: its head made
    at `now` (seconds since the epoch), its entries chosen but built on demand (a big
    answer is built a slice at a time)."""
    views = _selected(state, query)
    runners = sorted(
        (_synopsis(state, v, now) for v in views),
        key=lambda r: (r.modelId, r.deviceRank, r.runnerId),
    )
    by_id = {v.ref.runnerId: v.ref for v in views}
    selection = state.store.select(
        {runner_id: (ref.nodeId, ref.deviceRank) for runner_id, ref in by_id.items()},
        limit=query.limit,
        since=micros(query.since) if query.since else None,
        until=micros(query.until) if query.until else None,
    )
    nodes = {v.ref.nodeId for v in views}
    unreachable = [
        u
        for node, u in sorted(state.unreachable.items())
        if (query.nodeId is None and query.instanceId is None) or node in nodes
    ]
    head = ClusterTimeline(
        generatedAt=from_micros(int(now * 1e6)),
        localNodeId=local_node_id,
        runners=runners,
        timeline=[],
        unreachableNodes=unreachable,
    )
    return TimelinePlan(head, selection, by_id)


def timeline(
    state: ClusterState, query: TimelineQuery, *, local_node_id: str, now: float
) -> ClusterTimeline:
    """The seed-001 `ClusterTimeline` under `query`'s filters, made at `now` (seconds since
    the epoch)."""
    plan = timeline_plan(state, query, local_node_id=local_node_id, now=now)
    return msgspec.structs.replace(plan.head, timeline=plan.entries(0, plan.size))


def history(state: ClusterState, limits: Thresholds) -> list[RunnerHistory]:
    """How much of each runner's history is held, by instance and rank, and how long its
    job waits for it (`limits`: the steps compared)."""
    waits = _waited_on(state, limits)
    found = []
    for view in sorted(state.runners.values(), key=lambda v: (v.ref.instanceId, v.ref.deviceRank)):
        oldest, evicted = state.store.retention(view.ref.runnerId)
        waited_on, last, layers = waits.get(view.ref.runnerId, (None, None, None))
        found.append(
            RunnerHistory(
                runnerId=view.ref.runnerId,
                nodeId=view.ref.nodeId,
                instanceId=view.ref.instanceId,
                deviceRank=view.ref.deviceRank,
                firstSeq=view.seqs.first,
                lastSeq=view.seqs.last,
                missingSeqs=view.seqs.missing,
                heldEntries=state.store.count(view.ref.runnerId),
                evictedEntries=evicted,
                oldestAt=None if oldest is None else from_micros(oldest),
                acknowledgedSeq=view.acknowledged,
                unseenSeqs=_unseen(view),
                pace=view.pace.histogram() if view.pace is not None else None,
                waitedOn=waited_on,
                lastArrival=last,
                layers=layers,
            )
        )
    return found


def _waited_on(
    state: ClusterState, limits: Thresholds
) -> dict[str, tuple[float | None, float | None, int | None]]:
    """Per runner of a job whose ranks can be compared (`rules.straggle_of`): the share of
    the job's time spent waiting for it, how often it was the one waited on, and the layers
    it holds where the job is a pipeline compared per layer, as of its ranks' newest
    message."""
    found: dict[str, tuple[float | None, float | None, int | None]] = {}
    for instance in state.instances.values():
        views = [state.runners[a.runnerId] for a in instance.assignments]
        newest = max((v.stored_ns for v in views if v.stored_ns), default=None)
        straggle = straggle_of(state, views, newest / 1e9, limits) if newest else None
        if straggle is not None:
            for index, view in enumerate(views):
                found[view.ref.runnerId] = (
                    round(straggle.waited_on[index], 3),
                    round(straggle.last[index], 3),
                    straggle.layers[index] if straggle.layers else None,
                )
    return found


def placement(state: ClusterState, *, local_node_id: str) -> list[PlacementRunnerDiagnostics]:
    """Seed-000 placement of every rank of every live instance, by instance and rank."""
    found = []
    for instance in sorted(state.instances.values(), key=lambda i: i.instanceId):
        tasks = state.tasks.get(instance.instanceId, OrderedDict())
        for rank in instance.assignments:
            view = state.runners.get(rank.runnerId)
            node = state.nodes.get(rank.nodeId)
            found.append(
                PlacementRunnerDiagnostics(
                    runnerId=rank.runnerId,
                    nodeId=rank.nodeId,
                    friendlyName=node.friendlyName if node else None,
                    statusKind=view.status.statusKind.value if view and view.status else None,
                    deviceRank=rank.deviceRank,
                    worldSize=rank.worldSize,
                    startLayer=rank.startLayer,
                    endLayer=rank.endLayer,
                    nLayers=rank.nLayers,
                    isLocal=rank.nodeId == local_node_id,
                    isMaster=False,
                    tasks=list(_tasks_of(instance, rank.runnerId, tasks.values())),
                    instanceId=instance.instanceId,
                    pid=view.status.pid if view and view.status else None,
                )
            )
    return found


def _tasks_of(
    instance: InstanceCreated, runner_id: str, tasks: Iterable[TaskView]
) -> Iterable[PlacementTaskDiagnostics]:
    """Tasks that concern one runner: submitted to its instance since it was placed."""
    for task in tasks:
        if task.created.at < instance.at:
            continue
        yield PlacementTaskDiagnostics(
            taskId=task.created.taskId,
            taskKind=task.created.taskKind.value,
            taskStatus=task.statuses.get(runner_id, TaskStatus.PENDING).value,
            instanceId=instance.instanceId,
            commandId=task.created.commandId,
            runnerId=runner_id,
            modelId=instance.modelId,
        )


def instance_states(state: ClusterState) -> list[InstanceState]:
    """Ready and lost ranks of every live instance."""
    return [
        InstanceState(
            instanceId=i.instanceId,
            runnerSpecId=i.runnerSpecId,
            modelId=i.modelId,
            ranks=[_rank_state(state, a) for a in i.assignments],
        )
        for i in sorted(state.instances.values(), key=lambda i: i.instanceId)
    ]


def _rank_state(state: ClusterState, rank: RunnerAssignment) -> RankState:
    view = state.runners.get(rank.runnerId)
    status = view.status if view else None
    lost = (view is not None and not view.alive) or (
        state.cut_off(view) if view is not None else rank.nodeId in state.unreachable
    )
    return RankState(
        runnerId=rank.runnerId,
        nodeId=rank.nodeId,
        deviceRank=rank.deviceRank,
        statusKind=status.statusKind.value if status else None,
        ready=bool(view and view.ready) and not lost,
        lost=lost,
        gaveUp=view is not None and view.gave_up is not None,
    )
