"""The aggregator's state, folded from events by pure reducers, and the views built from it.

Nothing here does I/O or reads a clock: events come in as arguments and their shell says
when they arrived (`ClusterState.arrive`), so every view is testable without NATS on
virtual time, and a replay fed the moments of a live run folds the same state. Telemetry
is idempotent by (runner, seq).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from operator import attrgetter

from rankscope.services.aggregator.pace import PaceHistory
from rankscope.services.aggregator.runners import Runners, RunnerView, TaskView
from rankscope.services.aggregator.store import EntryStore
from rankscope.shared.inputs import BadInputError, entry_times
from rankscope.shared.synopsis import advance
from rankscope.shared.timestamps import from_micros, second_micros
from rankscope.shared.wire import (
    Breadcrumb,
    FlightRecord,
    InstanceCreated,
    InstanceReleased,
    MemorySampled,
    NodeInfo,
    PhaseRecords,
    PlacementEvent,
    ReceivedTelemetry,
    RunnerRef,
    RunnerStatusKind,
    TaskCreated,
    TaskEvent,
    TaskKind,
    UnreachableNode,
    encode,
)

__all__ = ["ClusterState", "Held"]

log = logging.getLogger(__name__)

TASKS_PER_INSTANCE = 128
SEQ_SLACK = 200_000
"""Seqs a runner's next message may skip at once: entries its agent dropped when its
buffer (100,000 entries) overflowed, twice over."""
SEQ_RATE = 10_000
"""Seqs a second a runner may skip beyond `SEQ_SLACK` while it was not heard from (far
more than an entry per token of any model); a larger jump is refused, since it would make
every later message of that runner look old."""
_GAVE_UP = frozenset({Breadcrumb.COLLECTIVE_TIMEOUT, Breadcrumb.PEER_LOST})
_TURNS = _GAVE_UP | {Breadcrumb.RUNNER_READY}
"""Entries that change whether a runner gave up or failed."""
_EVENT = attrgetter("event")


def _site(entry: FlightRecord) -> str:
    site = entry.attrs.get("site")
    return site if isinstance(site, str) else entry.phase.value


Held = tuple[PhaseRecords, bytes | None, int | None]
"""A batch of entries held for `settle`: the message, its JSON as received, when stored."""


def _refused(held: Held, error: BadInputError) -> None:
    log.warning("runner %s: a batch refused: %s", held[0].runner.runnerId, error)


@dataclass(slots=True)
class _Unsettled:
    """A runner's entries newer than its synopsis, in seq order, and when the last of
    them arrived (µs since the epoch)."""

    view: RunnerView
    entries: list[FlightRecord]
    arrived: int


class ClusterState:
    """Runners, entries, placements, tasks and nodes.

    Args:
        store: where entries are kept.
    """

    def __init__(self, *, store: EntryStore) -> None:
        self.store = store
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
        self._unsettled: dict[str, _Unsettled] = {}
        """Per runner, entries newer than its synopsis that `settle` has yet to fold in."""
        self._now: tuple[float, int] | None = None
        """When the telemetry applied now arrived, as `arrive` said: (monotonic seconds,
        µs since the epoch)."""
        self._held: dict[str, tuple[RunnerView, list[Held]]] = {}
        """Per runner, entry batches applied since the last `settle`, filed by it."""
        self.refused: Callable[[Held, BadInputError], None] = _refused
        """Told of each held batch `settle` cannot file (its times or its seqs are
        nonsense), with why; the rest are filed."""

    def arrive(self, at: float, wall: float) -> None:
        """Say when the telemetry applied from now on arrived: `at` on the aggregator's
        monotonic clock (progress and silence; the runners' clocks are not trusted here),
        `wall` in seconds since the epoch (no entry counts as later than its arrival).
        Ingest says it once a run of messages (nothing arrives during a run, so each had
        arrived when the first was applied); a test says it on virtual time."""
        self._now = at, int(wall * 1e6)

    def _moment(self) -> tuple[float, int]:
        if self._now is None:
            raise RuntimeError("telemetry applied before `arrive` said when it arrived")
        return self._now

    def _runner(self, ref: RunnerRef) -> RunnerView:
        view = self.runners.get(ref.runnerId)
        return self.runners.add(RunnerView(ref=ref)) if view is None else view

    def apply_telemetry(
        self,
        event: ReceivedTelemetry,
        raw: bytes | None = None,
        stored_ns: int | None = None,
        *,
        settle: bool = True,
    ) -> int:
        """Apply one telemetry message (`raw`: its JSON as received, kept as is for entry
        batches; `stored_ns`: when NATS stored it); returns how many of its items were new.
        With `settle` False, an entry batch is filed only at the next `settle()` (it
        returns how many entries it holds): ingest files a runner's batches of one run of
        messages at once, and moves its synopsis once; a batch `settle` cannot file goes to
        `refused`.

        A runner's newest state is its highest seq, whatever its clock says; an entry's
        time counts as no later than its arrival here, so a clock ahead cannot hold the
        top of the timeline.

        Raises:
            BadInputError: its runner is not placed as it says, or (filed now) an entry's
                time is no RFC 3339 date-time or its seq jumps further past the runner's
                last than it could.
        """
        view = self._placed(event.runner, stored_ns)
        if isinstance(event, PhaseRecords):
            if not settle:
                held = self._held.get(view.ref.runnerId)
                if held is None:
                    self._held[view.ref.runnerId] = view, [(event, raw, stored_ns)]
                else:
                    held[1].append((event, raw, stored_ns))
                return len(event.entries)
            self._file_held(view.ref.runnerId)
            fresh = self._file(view, event, raw, stored_ns)
            self.settle()
            return fresh
        self._file_held(view.ref.runnerId)  # its status after its entries, as they came
        self._check_jump(view, view.seqs.last, event.seq, stored_ns)
        self._heard(view, stored_ns, self._moment()[0])
        self._settle(view.ref.runnerId)
        if not view.seqs.add(event.seq):
            self.duplicates += 1
            return 0
        if isinstance(event, MemorySampled):
            if event.seq > view.memory_seq:
                view.synopsis = dataclasses.replace(view.synopsis, memory=event.snapshot)
                view.memory_seq = event.seq
            if event.pace is not None:
                if view.pace is None:
                    view.pace = PaceHistory()
                view.pace.add(stored_ns / 1e9 if stored_ns else self._moment()[1] / 1e6, event.pace)
        elif view.status is None or event.seq > view.status.seq:
            view.status = event
            if event.statusKind is RunnerStatusKind.FAILED:
                view.failure = event
        return 1

    def _file(
        self, view: RunnerView, event: PhaseRecords, raw: bytes | None, stored_ns: int | None
    ) -> int:
        """File one batch's new entries and hold them for the synopsis; how many were new.

        Raises:
            BadInputError: an entry's time is no RFC 3339 date-time, or its seq jumps
                further past the runner's last than it could (nothing filed).
        """
        entries = event.entries
        times = entry_times(entries)
        seqs = [e.seq for e in entries]
        self._check_jump(view, view.seqs.last, max(seqs, default=-1), stored_ns)
        heard, arrived = self._moment()
        self._heard(view, stored_ns, heard)
        fresh = view.seqs.fresh(seqs)
        if len(fresh) < len(seqs):
            self.duplicates += len(seqs) - len(fresh)
            entries, times = [entries[i] for i in fresh], [times[i] for i in fresh]
        if fresh:
            payload = raw or encode(event)
            self.store.add(view.ref.runnerId, payload, fresh, times, arrived, view.ref.nodeId)
            self._unsettle(view, entries, arrived, consecutive=isinstance(fresh, range))
        return len(fresh)

    def _file_held(self, runner_id: str) -> None:
        """File the batches of one runner held since the last `settle`: all at once when
        they carry its next seqs in one second in order (the usual run), else one by one,
        each refused alone."""
        found = self._held.pop(runner_id, None)
        if found is None:
            return
        view, batches = found
        if len(batches) > 1 and self._file_run(view, batches):
            return
        for held in batches:
            try:
                self._file(view, *held)
            except BadInputError as exc:
                self.refused(held, exc)

    def _file_run(self, view: RunnerView, batches: list[Held]) -> bool:
        """File `batches` as one, if their entries are the runner's next seqs (no jump to
        judge, none seen) and of one second in order after its newest; else file nothing
        and say so."""
        entries = [entry for event, _, _ in batches for entry in event.entries]
        seqs = [entry.seq for entry in entries]
        if not view.seqs.follows(seqs) or len(seqs) > SEQ_SLACK:
            return False
        times = second_micros([entry.at for entry in entries])
        if times is None:
            return False
        heard, arrived = self._moment()
        payloads = [(raw or encode(event), len(event.entries)) for event, raw, _ in batches]
        if not self.store.add_run(view.ref.runnerId, payloads, times, arrived, view.ref.nodeId):
            return False
        view.seqs.advance(len(seqs))
        self._heard(view, batches[-1][2], heard)
        self._unsettle(view, entries, arrived, consecutive=True)
        return True

    def _heard(self, view: RunnerView, stored_ns: int | None, heard: float) -> None:
        """Note that the runner of `view` spoke at `heard` (monotonic seconds), in a
        message NATS stored at `stored_ns`."""
        self.version += 1
        self.touched.add(view.ref.instanceId)
        view.heard = heard
        if stored_ns is not None:
            view.stored_ns = stored_ns

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
        if (
            placed.nodeId != ref.nodeId
            or placed.instanceId != ref.instanceId
            or placed.deviceRank != ref.deviceRank
            or placed.worldSize != ref.worldSize
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

    def _unsettle(
        self, view: RunnerView, fresh: Sequence[FlightRecord], arrived: int, *, consecutive: bool
    ) -> None:
        """Hold the entries of `fresh` newer than any the runner's synopsis shows or holds
        for it, arrived at `arrived`, for `settle` (`consecutive`: their seqs are)."""
        unsettled = self._unsettled.get(view.ref.runnerId)
        top = view.synopsis.seq if unsettled is None else unsettled.entries[-1].seq
        if consecutive and fresh[0].seq > top:
            newer = fresh
        else:
            newer = [entry for entry in fresh if entry.seq > top]
        if unsettled is not None:
            unsettled.entries += newer
            unsettled.arrived = arrived
        elif newer:
            self._unsettled[view.ref.runnerId] = _Unsettled(view, list(newer), arrived)

    def settle(self) -> None:
        """File the entry batches held since the last call and move every runner's
        synopsis by the entries applied since."""
        for runner_id in list(self._held):
            self._file_held(runner_id)
        for runner_id in list(self._unsettled):
            self._settle(runner_id)

    def _settle(self, runner_id: str) -> None:
        unsettled = self._unsettled.pop(runner_id, None)
        if unsettled is not None:
            received = from_micros(unsettled.arrived)
            self._progress(unsettled.view, unsettled.entries, received)

    def _progress(self, view: RunnerView, entries: list[FlightRecord], received: str) -> None:
        """Move the runner's synopsis to the last of `entries` (newer than what it had),
        received at `received` (no entry counts as later than that)."""
        view.synopsis = advance(view.synopsis, entries, received=received)
        last = entries[-1]
        view.waiting_in = _site(last) if last.event == Breadcrumb.COLLECTIVE_WAIT else None
        if not _TURNS.isdisjoint(map(_EVENT, entries)):  # rare: not a Python step an entry
            for entry in entries:
                if entry.event in _GAVE_UP:
                    view.gave_up = entry
                elif entry.event == Breadcrumb.RUNNER_READY:
                    view.gave_up = view.failure = None
        view.progressed = self._moment()[0]

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
            if self.recorded(view):
                continue  # no agent lists a recorded rank
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
        if self.recorded(view):
            return False  # no agent speaks for it: it speaks for itself
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
        """Nodes that hold a rank of a live instance an agent runs."""
        return {
            a.nodeId for i in self.instances.values() if i.recorded is None for a in i.assignments
        }

    def recorded(self, view: RunnerView) -> bool:
        """Whether the runner is a rank of a recorded job (`rankscope record`)."""
        instance = self.instances.get(view.ref.instanceId)
        return instance is not None and instance.recorded is not None
