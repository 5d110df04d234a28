"""The aggregator's state, folded from events by pure reducers, and the views built from it.

Nothing here does I/O: events and the clock come in as arguments, so every view is
testable without NATS. Telemetry is idempotent by (runner, seq).
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

import msgspec

from services.aggregator.store import EntryStore, Selection, SeqTracker
from shared.inputs import BadInputError
from shared.synopsis import Synopsis, advance
from shared.timestamps import from_micros, micros, now, to_epoch
from shared.wire import (
    Breadcrumb,
    ClusterTimeline,
    FlightEntry,
    InstanceCreated,
    InstanceReleased,
    InstanceState,
    MemorySampled,
    NodeInfo,
    Phase,
    PhaseEntries,
    PlacementEvent,
    PlacementRunnerDiagnostics,
    PlacementTaskDiagnostics,
    RankState,
    RunnerAssignment,
    RunnerHistory,
    RunnerRef,
    RunnerStatusChanged,
    RunnerStatusKind,
    RunnerSynopsis,
    RunnerTelemetry,
    TaskCreated,
    TaskEvent,
    TaskKind,
    TaskStatus,
    TimelineEntry,
    TimelineQuery,
    UnreachableNode,
    encode,
)

__all__ = ["ClusterState", "RunnerView", "Runners", "TaskView", "TimelinePlan"]

TASKS_PER_INSTANCE = 128
UNLISTED = 2
"""Probes in a row a runner's node answers without it before it counts as not alive (one
is not enough: an agent lists a runner only once it has started it)."""
SEQ_SLACK = 200_000
"""Seqs a runner's next message may skip at once: entries its agent dropped when its
buffer (100,000 entries) overflowed, twice over."""
SEQ_RATE = 10_000
"""Seqs a second a runner may skip beyond `SEQ_SLACK` while it was not heard from (far
more than an entry per token of any model); a larger jump is refused, since it would make
every later message of that runner look old."""
_READY = frozenset({RunnerStatusKind.READY, RunnerStatusKind.RUNNING})
_GAVE_UP = frozenset({Breadcrumb.COLLECTIVE_TIMEOUT, Breadcrumb.PEER_LOST})


@dataclass(slots=True)
class RunnerView:
    """Everything known about one runner."""

    ref: RunnerRef
    seqs: SeqTracker = field(default_factory=SeqTracker)
    status: RunnerStatusChanged | None = None
    synopsis: Synopsis = field(default_factory=Synopsis)
    """Where its entries say it is (phase, task, step, memory)."""
    memory_seq: int = -1
    """The seq of the memory sample its synopsis shows (samples may overtake each other)."""
    progressed: float | None = None
    heard: float | None = None
    acknowledged: int | None = None
    """The newest seq its agent had acknowledged by JetStream, as of the last probe."""
    waiting_in: str | None = None
    """The collective its last entry says it is waiting in (its site)."""
    gave_up: FlightEntry | None = None
    """The last time it gave up on a peer since it was last ready (its collective timed
    out, or the ring lost the peer): a victim's breadcrumb, kept across its restarts."""
    failure: RunnerStatusChanged | None = None
    """Its last failure since it was last ready (how its process ended)."""
    unlisted: int = 0
    """Probes in a row its node answered without listing it: no agent supervises it."""
    stored_ns: int | None = None
    """When NATS stored its last message (ns since the epoch), if known."""
    placed_ns: int | None = None
    """When NATS stored the placement that created it (ns since the epoch), if known:
    nothing of it can have been stored before."""

    @property
    def alive(self) -> bool:
        """Whether the supervisor last reported the process alive (unknown counts as yes),
        and its node's agent still lists it (one restarted without it did not keep it)."""
        return (self.status is None or self.status.processAlive) and self.unlisted < UNLISTED

    @property
    def ready(self) -> bool:
        """Whether the runner last reported itself ready or serving."""
        return self.status is not None and self.alive and self.status.statusKind in _READY


class Runners(dict[str, RunnerView]):
    """Every runner by id, also found by its instance and by its node (a query for one
    instance looks at its ranks, not at every runner). Runners join by `add` only; a
    runner's ref never changes."""

    def __init__(self) -> None:
        super().__init__()
        self._of_instance: dict[str, list[RunnerView]] = {}
        self._on_node: dict[str, list[RunnerView]] = {}

    def add(self, view: RunnerView) -> RunnerView:
        """Hold `view`, whose runner id is new here."""
        self[view.ref.runnerId] = view
        self._of_instance.setdefault(view.ref.instanceId, []).append(view)
        self._on_node.setdefault(view.ref.nodeId, []).append(view)
        return view

    def of_instance(self, instance_id: str) -> Collection[RunnerView]:
        """The runners of one instance."""
        return self._of_instance.get(instance_id, ())

    def on_node(self, node_id: str) -> Collection[RunnerView]:
        """The runners on one node."""
        return self._on_node.get(node_id, ())


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
            _entry(self._refs[row[3]], stored)
            for row, stored in zip(rows, self.selection.read(start, stop), strict=True)
        ]


def _site(entry: FlightEntry) -> str:
    site = entry.attrs.get("site")
    return site if isinstance(site, str) else entry.phase.value


def _unseen(view: RunnerView) -> int:
    """Acknowledged seqs newer than the newest received."""
    if view.acknowledged is None:
        return 0
    last = view.seqs.last
    return max(view.acknowledged - (-1 if last is None else last), 0)


def _entry(ref: RunnerRef, stored: FlightEntry) -> TimelineEntry:
    return TimelineEntry(
        at=stored.at,
        nodeId=ref.nodeId,
        runnerId=ref.runnerId,
        deviceRank=ref.deviceRank,
        worldSize=ref.worldSize,
        phase=stored.phase,
        event=stored.event,
        detail=stored.detail,
        attrs=stored.attrs,
        taskId=stored.taskId,
        commandId=stored.commandId,
        mlxMemory=stored.mlxMemory,
    )


@dataclass(slots=True)
class TaskView:
    """A task of an instance and each rank's status of it."""

    created: TaskCreated
    statuses: dict[str, TaskStatus] = field(default_factory=dict)


class ClusterState:
    """Runners, entries, placements, tasks and nodes.

    Args:
        store: where entries are kept.
        clock: monotonic seconds, for progress (the runners' clocks are not trusted here).
    """

    def __init__(self, *, store: EntryStore, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self._clock = clock
        self.runners = Runners()
        self.instances: dict[str, InstanceCreated] = {}
        self.tasks: dict[str, OrderedDict[str, TaskView]] = {}
        self.nodes: dict[str, NodeInfo] = {}
        self.unreachable: dict[str, UnreachableNode] = {}
        self.unreachable_asked: dict[str, int] = {}
        """When each unreachable node was first found so (ns since the epoch): a rank whose
        message NATS stored after that speaks through a live agent, whatever the probe said."""
        self.duplicates = 0
        self.version = 0
        """Bumped by every applied event, so answers built from this state can be reused."""
        self.touched: set[str] = set()
        """Instances whose ranks, placement, tasks or nodes changed since the diagnosis
        last took this set (`take_touched`)."""

    def _runner(self, ref: RunnerRef) -> RunnerView:
        view = self.runners.get(ref.runnerId)
        return self.runners.add(RunnerView(ref=ref)) if view is None else view

    def apply_telemetry(
        self, event: RunnerTelemetry, raw: bytes | None = None, stored_ns: int | None = None
    ) -> int:
        """Apply one telemetry message (`raw`: its JSON as received, kept as is for entry
        batches; `stored_ns`: when NATS stored it); returns how many of its items were new.

        A runner's newest state is its highest seq, whatever its clock says; an entry's
        time counts as no later than its arrival here, so a clock ahead cannot hold the
        top of the timeline.

        Raises:
            BadInputError: its seq jumps further past the runner's last than it could.
        """
        view = self._placed(event.runner, stored_ns)
        last = view.seqs.last
        if isinstance(event, PhaseEntries):
            highest = max((e.seq for e in event.entries), default=-1)
        else:
            highest = event.seq
        self._check_jump(view, last, highest, stored_ns)
        self.version += 1
        self.touched.add(view.ref.instanceId)
        view.heard = self._clock()
        if stored_ns is not None:
            view.stored_ns = stored_ns
        if isinstance(event, PhaseEntries):
            fresh = view.seqs.fresh(event.entries)
            received = now()
            self.store.add(view.ref.runnerId, raw or encode(event), fresh, micros(received))
            newer = [e for _, e in fresh if e.seq > view.synopsis.seq]
            self._progress(view, newer, received)
            self.duplicates += len(event.entries) - len(fresh)
            return len(fresh)
        if not view.seqs.add(event.seq):
            self.duplicates += 1
            return 0
        if isinstance(event, MemorySampled):
            if event.seq > view.memory_seq:
                view.synopsis = dataclasses.replace(view.synopsis, memory=event.snapshot)
                view.memory_seq = event.seq
        elif view.status is None or event.seq > view.status.seq:
            view.status = event
            if event.statusKind is RunnerStatusKind.FAILED:
                view.failure = event
        return 1

    def _placed(self, ref: RunnerRef, stored_ns: int | None) -> RunnerView:
        """The view of the runner `ref` names, if a placement made that runner where `ref`
        says it runs, and the message could be its (stored after the placement).

        Raises:
            BadInputError: no placement made it, it runs elsewhere (a node speaking for
                another node's runner), or the message was stored before its placement.
        """
        view = self.runners.get(ref.runnerId)
        if view is None:
            raise BadInputError(
                "telemetry_unplaced", f"runner {ref.runnerId!r} is in no placement read so far"
            )  # the kind the service parks by
        placed = view.ref
        if (placed.nodeId, placed.instanceId, placed.deviceRank, placed.worldSize) != (
            ref.nodeId,
            ref.instanceId,
            ref.deviceRank,
            ref.worldSize,
        ):
            raise BadInputError(
                "telemetry_identity",
                f"runner {ref.runnerId!r} is rank {placed.deviceRank} of {placed.instanceId!r} on "
                f"node {placed.nodeId!r}; this message says rank {ref.deviceRank} of "
                f"{ref.instanceId!r} on node {ref.nodeId!r}",
            )
        if stored_ns is not None and view.placed_ns is not None and stored_ns < view.placed_ns:
            raise BadInputError(
                "telemetry_before_placement",
                f"stored before the placement that made runner {ref.runnerId!r}",
            )
        return view

    @staticmethod
    def _check_jump(view: RunnerView, last: int | None, seq: int, stored_ns: int | None) -> None:
        since = view.stored_ns if last is not None else view.placed_ns
        if (
            stored_ns is None
            or since is None
            or seq <= (last if last is not None else -1) + SEQ_SLACK
        ):
            return  # nothing to judge by
        quiet = max(stored_ns - since, 0) / 1e9
        first = -1 if last is None else last
        if seq > first + SEQ_SLACK + SEQ_RATE * quiet:
            after = "its placement" if last is None else f"its last ({last:,})"
            raise BadInputError(
                "telemetry_seq_jump",
                f"seq {seq:,} of runner {view.ref.runnerId!r} jumps {seq - first:,} past "
                f"{after} after {quiet:.0f}s: more than it could have used",
            )

    def _progress(self, view: RunnerView, entries: list[FlightEntry], received: str) -> None:
        """Move the runner's synopsis to the last of `entries` (newer than what it had),
        received at `received` (no entry counts as later than that)."""
        if not entries:
            return
        view.synopsis = advance(view.synopsis, entries, received=received)
        last = entries[-1]
        view.waiting_in = _site(last) if last.event == Breadcrumb.COLLECTIVE_WAIT else None
        for entry in entries:
            if entry.event in _GAVE_UP:
                view.gave_up = entry
            elif entry.event == Breadcrumb.RUNNER_READY:
                view.gave_up = view.failure = None
        view.progressed = self._clock()

    def apply_placement(self, event: PlacementEvent, stored_ns: int | None = None) -> None:
        """Apply a placement decision (`stored_ns`: when NATS stored it)."""
        self.version += 1
        self.touched.add(event.instanceId)
        if isinstance(event, InstanceReleased):
            self.instances.pop(event.instanceId, None)
            return
        self.instances[event.instanceId] = event
        for assignment in event.assignments:
            ref = RunnerRef(
                runnerId=assignment.runnerId,
                nodeId=assignment.nodeId,
                instanceId=event.instanceId,
                modelId=event.modelId,
                deviceRank=assignment.deviceRank,
                worldSize=assignment.worldSize,
            )
            view = self._runner(ref)  # known from its placement on, before it reports
            if view.placed_ns is None:
                view.placed_ns = stored_ns

    def apply_task(self, event: TaskEvent) -> None:
        """Apply a task or a rank's status of one."""
        self.version += 1
        self.touched.add(event.instanceId)
        tasks = self.tasks.setdefault(event.instanceId, OrderedDict())
        if isinstance(event, TaskCreated):
            tasks[event.taskId] = TaskView(created=event)
            while len(tasks) > TASKS_PER_INSTANCE:
                tasks.popitem(last=False)
            return
        view = tasks.get(event.taskId)
        if view is not None and event.runnerId is not None:
            view.statuses[event.runnerId] = event.taskStatus

    def note_listed(self, listed: set[str], runners: Iterable[RunnerView]) -> None:
        """Record which of `runners` (those on one node) its agent just listed as its own."""
        for view in runners:
            alive = view.alive
            view.unlisted = 0 if view.ref.runnerId in listed else view.unlisted + 1
            if view.alive != alive:
                self.version += 1
                self.touched.add(view.ref.instanceId)

    def note_acknowledged(self, runner_id: str, seq: int | None) -> None:
        """Record what a runner's agent says JetStream acknowledged of its telemetry."""
        view = self.runners.get(runner_id)
        if view is not None and seq is not None:
            view.acknowledged = seq

    def forgive(self, moment: float, *, keep: set[str]) -> None:
        """Count every runner but those in `keep` as heard from (and, if it ever reported,
        progressing) at `moment`: after an outage of NATS their silence meant nothing."""
        self.version += 1
        self.touched.update(self.instances)
        for view in self.runners.values():
            if view.ref.runnerId in keep:
                continue
            if view.heard is not None:
                view.heard = max(view.heard, moment)
            if view.progressed is not None:
                view.progressed = max(view.progressed, moment)

    def cut_off(self, view: RunnerView) -> bool:
        """Whether the runner's node is unreachable and the runner has not spoken since it
        was found so (an agent restarting was asked before it listened)."""
        asked = self.unreachable_asked.get(view.ref.nodeId)
        return view.ref.nodeId in self.unreachable and not (
            asked and view.stored_ns and view.stored_ns > asked
        )

    def set_unreachable(self, unreachable: dict[str, UnreachableNode], asked_ns: int = 0) -> None:
        """Record which nodes are unreachable now, as found by asking them at `asked_ns`
        (ns since the epoch), touching the instances on those that became unreachable or
        reachable."""
        changed = self.unreachable.keys() ^ unreachable.keys()
        self.unreachable = unreachable
        self.unreachable_asked = {
            n: self.unreachable_asked.get(n, asked_ns) for n in unreachable if n not in changed
        } | {n: asked_ns for n in unreachable.keys() & changed}
        if changed:
            self.version += 1
            self.touched.update(
                i.instanceId
                for i in self.instances.values()
                if any(a.nodeId in changed for a in i.assignments)
            )

    def take_touched(self) -> set[str]:
        """The instances touched since the last call."""
        touched, self.touched = self.touched, set()
        return touched

    def set_node(self, node_id: str, info: NodeInfo | None) -> None:
        """Record a node's inventory entry (None: it left or expired)."""
        if info is None:
            self.nodes.pop(node_id, None)
        else:
            self.nodes[node_id] = info

    def queued(self) -> dict[str, int]:
        """Generations of each live instance not yet over on every rank (waiting or
        running), among the tasks kept."""
        depth = {}
        for instance_id, instance in self.instances.items():
            world = len(instance.assignments)
            depth[instance_id] = sum(
                1
                for task in self.tasks.get(instance_id, {}).values()
                if task.created.taskKind is TaskKind.TEXT_GENERATION
                and sum(s.is_final for s in task.statuses.values()) < world
            )
        return depth

    def placed_nodes(self) -> set[str]:
        """Nodes that hold a rank of a live instance."""
        return {a.nodeId for i in self.instances.values() for a in i.assignments}

    # Views

    def _selected(self, query: TimelineQuery) -> list[RunnerView]:
        if query.instanceId is not None:
            candidates = self.runners.of_instance(query.instanceId)
        elif query.nodeId is not None:
            candidates = self.runners.on_node(query.nodeId)
        else:
            candidates = self.runners.values()
        return [
            view
            for view in candidates
            if (query.instanceId is None or view.ref.instanceId == query.instanceId)
            and (query.nodeId is None or view.ref.nodeId == query.nodeId)
            and (query.modelId is None or view.ref.modelId == query.modelId)
        ]

    def _synopsis(self, view: RunnerView, moment: float) -> RunnerSynopsis:
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
        )

    def timeline_plan(self, query: TimelineQuery, *, local_node_id: str) -> TimelinePlan:
        """What the seed-001 `ClusterTimeline` under `query`'s filters holds: its head now,
        its entries chosen but built on demand (a big answer is built a slice at a time)."""
        views = self._selected(query)
        moment = time.time()
        runners = sorted(
            (self._synopsis(v, moment) for v in views),
            key=lambda r: (r.modelId, r.deviceRank, r.runnerId),
        )
        by_id = {v.ref.runnerId: v.ref for v in views}
        selection = self.store.select(
            {runner_id: (ref.nodeId, ref.deviceRank) for runner_id, ref in by_id.items()},
            limit=query.limit,
            since=micros(query.since) if query.since else None,
            until=micros(query.until) if query.until else None,
        )
        nodes = {v.ref.nodeId for v in views}
        unreachable = [
            u
            for node, u in sorted(self.unreachable.items())
            if (query.nodeId is None and query.instanceId is None) or node in nodes
        ]
        head = ClusterTimeline(
            generatedAt=now(),
            localNodeId=local_node_id,
            runners=runners,
            timeline=[],
            unreachableNodes=unreachable,
        )
        return TimelinePlan(head, selection, by_id)

    def timeline(self, query: TimelineQuery, *, local_node_id: str) -> ClusterTimeline:
        """The seed-001 `ClusterTimeline` under `query`'s filters."""
        plan = self.timeline_plan(query, local_node_id=local_node_id)
        return msgspec.structs.replace(plan.head, timeline=plan.entries(0, plan.size))

    def history(self) -> list[RunnerHistory]:
        """How much of each runner's history is held, by instance and rank."""
        found = []
        for view in sorted(
            self.runners.values(), key=lambda v: (v.ref.instanceId, v.ref.deviceRank)
        ):
            oldest, evicted = self.store.retention(view.ref.runnerId)
            found.append(
                RunnerHistory(
                    runnerId=view.ref.runnerId,
                    nodeId=view.ref.nodeId,
                    instanceId=view.ref.instanceId,
                    deviceRank=view.ref.deviceRank,
                    firstSeq=view.seqs.first,
                    lastSeq=view.seqs.last,
                    missingSeqs=view.seqs.missing,
                    heldEntries=self.store.count(view.ref.runnerId),
                    evictedEntries=evicted,
                    oldestAt=None if oldest is None else from_micros(oldest),
                    acknowledgedSeq=view.acknowledged,
                    unseenSeqs=_unseen(view),
                )
            )
        return found

    def placement(self, *, local_node_id: str) -> list[PlacementRunnerDiagnostics]:
        """Seed-000 placement of every rank of every live instance, by instance and rank."""
        found = []
        for instance in sorted(self.instances.values(), key=lambda i: i.instanceId):
            tasks = self.tasks.get(instance.instanceId, OrderedDict())
            for rank in instance.assignments:
                view = self.runners.get(rank.runnerId)
                node = self.nodes.get(rank.nodeId)
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
                        tasks=list(self._tasks_of(instance, rank.runnerId, tasks.values())),
                    )
                )
        return found

    @staticmethod
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

    def instance_states(self) -> list[InstanceState]:
        """Ready and lost ranks of every live instance."""
        return [
            InstanceState(
                instanceId=i.instanceId,
                runnerSpecId=i.runnerSpecId,
                modelId=i.modelId,
                ranks=[self._rank_state(a) for a in i.assignments],
            )
            for i in sorted(self.instances.values(), key=lambda i: i.instanceId)
        ]

    def _rank_state(self, rank: RunnerAssignment) -> RankState:
        view = self.runners.get(rank.runnerId)
        status = view.status if view else None
        lost = (view is not None and not view.alive) or (
            self.cut_off(view) if view is not None else rank.nodeId in self.unreachable
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
