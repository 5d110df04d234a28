"""The rules over one instance's ranks at one moment: who is stuck, dead, held behind its
peers or slow, and who waits on them; each rank's evidence. Pure: the state and the time
in, a verdict out (`diagnosis.py` keeps incidents across calls)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import timedelta

from rankscope.services.aggregator.arrivals import ArrivalLimits, Straggle
from rankscope.services.aggregator.collectives import judge_recorded
from rankscope.services.aggregator.pace import PaceLimits, paces_of
from rankscope.services.aggregator.runners import RunnerView
from rankscope.services.aggregator.slowness import Ranks, compared, judge_slowness
from rankscope.services.aggregator.stages import StageLimits
from rankscope.services.aggregator.views import ClusterState
from rankscope.shared.recording import WAIT_NOTE_S
from rankscope.shared.settings import default
from rankscope.shared.timestamps import format_ts, parse_ts, to_epoch
from rankscope.shared.wire import (
    Breadcrumb,
    Finding,
    FindingKind,
    Phase,
    RankEvidence,
    RankPace,
    RankRole,
    RunnerStatusKind,
)

__all__ = [
    "PHASE_ORDER",
    "Incident",
    "Judge",
    "Thresholds",
    "Verdict",
    "evidence",
    "straggle_of",
]

PHASE_ORDER = {phase: index for index, phase in enumerate(Phase)}
"""Phases in the order a request goes through them (the seed's order)."""

STEPPING_S = 1.2
"""Seconds since a rank's newest sampled step (it samples every second) after which it
counts as not stepping (idle, or held by a peer), unless it steps that slowly."""
_RESTING = frozenset({Phase.IDLE, Phase.CREATED, Phase.SHUTDOWN_CLEANUP, Phase.ERROR})
_LONG = frozenset({Phase.CONNECT_GROUP, Phase.LOAD_MODEL, Phase.WARMUP})
_GONE = frozenset({RunnerStatusKind.SHUTDOWN, RunnerStatusKind.SHUTTING_DOWN})


@dataclass(frozen=True, slots=True)
class Thresholds:
    """Seconds without progress before a rank counts as stuck; when one counts as slow."""

    working: float = default("stall_threshold")
    loading: float = default("load_threshold")
    no_data: float = 30.0
    silent: float = 5.0
    """A live runner samples its memory every second; this long without a word from it
    means its process is frozen, not merely waiting in a collective."""
    slow: PaceLimits = field(default_factory=PaceLimits)
    arrivals: ArrivalLimits = field(default_factory=ArrivalLimits)
    stages: StageLimits = field(default_factory=StageLimits)

    def of(self, phase: Phase | None) -> float:
        """The threshold that applies in `phase`."""
        return self.loading if phase in _LONG else self.working


@dataclass(frozen=True, slots=True)
class Incident:
    """An open finding, and the aggregator's monotonic clock when it opened and when its
    rules last found it (a `slow_rank` is held a while after)."""

    finding: Finding
    opened: float
    found: float | None = None
    """None: when it opened."""


@dataclass(frozen=True, slots=True)
class Verdict:
    kind: FindingKind
    culprits: list[RunnerView]
    waiting: list[RunnerView]
    words: str | None = None
    """The summary, when the rules that found it wrote one."""
    held: bool = False
    """The incident before, kept though not found now (the rules cannot tell, or it is
    held)."""


class Judge:
    """The rules, over one instance's ranks at one moment."""

    def __init__(
        self,
        state: ClusterState,
        views: list[RunnerView],
        now: float,
        wall: str,
        placed: float,
        thresholds: Thresholds,
    ) -> None:
        self.state, self.views, self.now, self.wall = state, views, now, wall
        self.placed, self.limits = placed, thresholds
        self.newest_stored = max((v.stored_ns for v in views if v.stored_ns), default=None)
        """When NATS stored the newest message of any of the ranks (ns since the epoch)."""
        self._paces: list[RankPace | None] | None = None
        self._compared: Straggle | None = None
        """The ranks compared with each other, where they were: their paces come from it."""

    @property
    def pace_now(self) -> float:
        """Now, as pace samples are timed: by NATS's clock as of the ranks' newest message,
        so an aggregator reading a backlog judges each moment as it was."""
        return self.newest_stored / 1e9 if self.newest_stored else to_epoch(self.wall)

    def pace(self, view: RunnerView) -> RankPace | None:
        """The rank's pace over its newest samples, if it keeps one."""
        if self._paces is None and self._compared is not None:
            self._paces = self._straggle_paces(self._compared)
        elif self._paces is None:
            histories = [v.pace for v in self.views]
            limits = self.limits.slow
            self._paces = paces_of(histories, self.pace_now, limits.window, limits)
        return self._paces[self.views.index(view)]

    def stepping(self) -> bool:
        """Whether every rank took a step in its newest samples (a second apart): pace is
        judged while work flows, not while the ranks idle or wait on one that stopped (the
        span judged then only loses its oldest samples, and with them its evenness)."""
        return all(
            v.pace is not None and v.pace.stepping(self.pace_now, STEPPING_S) for v in self.views
        )

    def slow(self, previous: Incident | None) -> Verdict | None:
        """The ranks the job waits on (or, where its ranks do not sample the same steps,
        those working out of line with their usual pace and their peers'); while they do
        not step or cannot be judged, and for `hold` seconds after it was last found, what
        was found before; none once every rank has stopped on purpose."""
        if all(_stopped(v) for v in self.views):
            return None  # the job ended on purpose: nothing is slow any more
        was_slow = previous is not None and previous.finding.kind is FindingKind.SLOW_RANK
        named = frozenset(
            i
            for i, v in enumerate(self.views)
            if was_slow and previous is not None
            and v.ref.runnerId in previous.finding.culpritRunnerIds
        )  # fmt: skip
        found = self._slowness(named) if self.stepping() else None
        if previous is not None and was_slow and (found is None or not found[0]):
            found_last = previous.opened if previous.found is None else previous.found
            if found is None or self.now - found_last < self.limits.slow.hold:
                kept = self.kept(previous)
                return dataclasses.replace(kept, words=previous.finding.summary, held=True)
        if found is None or not found[0]:
            return None
        culprits = [self.views[i] for i in found[0]]
        return Verdict(FindingKind.SLOW_RANK, culprits, _without(self.views, culprits), found[1])

    def _slowness(self, named: frozenset[int]) -> tuple[list[int], str] | None:
        """The slow ranks by index and the words naming them (none: an empty list), or
        None when the ranks cannot be judged (`slowness.judge_slowness`)."""
        ranks = _ranks_of(self.state, self.views)
        found = judge_slowness(ranks, self.pace_now, self.limits, named)
        if isinstance(found, Straggle):
            return self._straggled(found)
        if found is None or not found.slow:
            return None if found is None else ([], "")
        self._paces = list(found.paces)  # the evidence: the span that showed it
        words = "; ".join(
            f"{_ranks([self.views[i]])} works {pace.ratio:.2g}x slower than usual: "
            f"{pace.workMs:.3g} ms a step, usually {pace.usualWorkMs:.3g} ms "
            + (
                f"(its peers: {found.peers_ratio[i]:.2g}x theirs)"
                if found.backed is None
                else f"(its work per layer: {found.backed[i]:.2g}x its peers')"
            )
            for i in found.slow
            if (pace := found.paces[i]).ratio is not None and pace.usualWorkMs is not None
        )
        words += "".join(
            f"; {_ranks([v])} waits {found.paces[i].waitMs:.3g} ms a step"
            for i, v in enumerate(self.views)
            if i not in found.slow
        )
        return found.slow, words

    def _straggled(self, straggle: Straggle) -> tuple[list[int], str]:
        """The stragglers and the words naming them; their paces, the evidence, worked out
        only if a finding asks (most rounds name nobody)."""
        self._compared, self._paces = straggle, None
        if not straggle.stragglers:
            return [], ""
        return straggle.stragglers, self._straggle_words(straggle)

    def _straggle_paces(self, straggle: Straggle) -> list[RankPace | None]:
        """Each rank's pace over the steps compared, its own history's ratio beside it
        (corroboration: a rank slow from its first step has no usual to differ from)."""
        limits = self.limits.slow
        own = paces_of([v.pace for v in self.views], self.pace_now, limits.window, limits)
        return [
            RankPace(
                steps=straggle.steps,
                workMs=round(straggle.work_ms[i], 3),
                waitMs=round(straggle.wait_ms[i], 3),
                usualWorkMs=mine.usualWorkMs if mine is not None else None,
                ratio=mine.ratio if mine is not None else None,
                waitedOn=round(straggle.waited_on[i], 3),
                lastArrival=round(straggle.last[i], 3),
                workVsPeers=round(straggle.work_vs_peers(i), 3),
                layers=straggle.layers[i] if straggle.layers else None,
            )
            for i, mine in enumerate(own)
        ]

    def _straggle_words(self, straggle: Straggle) -> str:
        """`rank 2 (node-c) is the straggler: the job loses 23% of its time waiting for it,
        last to arrive on 94% of 120 steps; its work per step is 1.3x its peers'
        median`, and what the others wait a step."""
        said = [
            f"{_ranks([self.views[i]])} is the straggler: "
            + (
                f"the job loses {straggle.waited_on[i]:.0%} of its time waiting for it, "
                f"last to arrive on {straggle.last[i]:.0%} of {straggle.steps} steps; its "
                f"work per step is {straggle.work_vs_peers(i):.2g}x its peers' median"
                if straggle.layers is None
                else f"its work per layer is {straggle.work_vs_peers(i):.2g}x its peers' "
                f"median, the most of any stage in {straggle.last[i]:.0%} of the span; the "
                f"pipeline loses {straggle.waited_on[i]:.0%} of its work a step to it"
            )
            for i in straggle.stragglers
        ]
        waiting = [i for i in range(len(self.views)) if i not in straggle.stragglers]
        said += [
            f"{_ranks([self.views[i]])} waits {straggle.wait_ms[i]:.3g} ms a step" for i in waiting
        ]
        return "; ".join(said)

    def down(self, view: RunnerView) -> bool:
        """Not running (or unreachable), and not because it was shut down."""
        return not _stopped(view) and (not view.alive or self.unreachable(view))

    def unreachable(self, view: RunnerView) -> bool:
        """Whether the rank's node is unreachable and the rank has not spoken since."""
        return self.state.cut_off(view)

    def frozen(self, view: RunnerView) -> bool:
        """Running, yet silent: no memory sample for longer than a live runner allows. A
        rank stopped on purpose (released, its agent stopped or restarted) is not silent.

        By NATS's clock where it stored the rank's messages: silent while a peer's messages
        were stored that much later. An aggregator behind in reading (busy, paused, catching
        up) reads a live rank's messages late, and its peer's a moment before them.

        A rank connecting its ring is silent by nature: MLX holds the interpreter's lock
        until its peers come. It waits there; past the loading threshold it is stuck."""
        return (
            not self.down(view)
            and not _stopped(view)
            and view.heard is not None
            and not (view.status and view.status.statusKind is RunnerStatusKind.CONNECTING)
            and self.silent_for(view) > self.limits.silent
        )

    def silent_for(self, view: RunnerView) -> float:
        """Seconds since the rank's last message: by NATS's clock as of its peers' newest,
        where it stored them; else by this aggregator's, since it read the last."""
        if view.stored_ns and self.newest_stored:
            return (self.newest_stored - view.stored_ns) / 1e9
        return self.now - (view.heard if view.heard is not None else self.now)

    def last_heard(self, view: RunnerView) -> str:
        """When the rank was last heard, as a time of day: `12:01:00Z`."""
        quiet = self.silent_for(view)
        return _hms(format_ts(parse_ts(self.wall) - timedelta(seconds=quiet)))

    def stale(self, view: RunnerView) -> bool:
        last = view.progressed if view.progressed is not None else self.placed
        return self.now - last > self.limits.of(view.synopsis.phase)

    def verdict(self) -> Verdict | None:
        """What the ranks' state says now, with no memory of earlier moments."""
        views = self.views

        def others(culprits: list[RunnerView]) -> list[RunnerView]:
            return _without(views, culprits)

        silent = [v for v in views if v.progressed is None]
        if silent and self.now - self.placed > self.limits.no_data:
            return Verdict(FindingKind.MISSING_DATA, silent, [])
        dead = [v for v in views if self.down(v) and v.gave_up is None]
        if dead:
            return Verdict(FindingKind.DEAD_RANK, dead, others(dead))
        frozen = [v for v in views if self.frozen(v)]
        if frozen and len(frozen) < len(views):
            # A live runner samples its memory every second, busy or idle: silence while
            # its peers still talk means a frozen process (stopped, wedged in the kernel),
            # and whatever the instance does next waits on it.
            return Verdict(FindingKind.STALLED_RANK, frozen, others(frozen))
        working = [v for v in views if v.synopsis.phase not in _RESTING and v.gave_up is None]
        if not working or not all(self.stale(v) for v in working):
            return None
        # Ranks move in lockstep: one at rest while a peer waits in a collective is behind.
        steps = {v.synopsis.step for v in views if v.synopsis.step is not None}
        phases = {v.synopsis.phase for v in views if v.synopsis.phase is not None}
        if len(steps) > 1 or len(phases) > 1:
            if len(steps) > 1:
                behind = [v for v in views if v.synopsis.step == min(steps)]
            else:
                first = min(PHASE_ORDER[p] for p in phases)
                behind = [
                    v
                    for v in views
                    if v.synopsis.phase is not None and PHASE_ORDER[v.synopsis.phase] == first
                ]
            return Verdict(FindingKind.RANK_DISAGREEMENT, behind, others(behind))
        stuck = [v for v in working if v.synopsis.task_id is not None]
        return Verdict(FindingKind.STALLED_RANK, stuck, []) if stuck else None

    def recorded(self) -> Verdict | None:
        """What the ranks of a recorded job say now (`collectives`)."""
        silent = [v for v in self.views if v.progressed is None]
        if silent and self.now - self.placed > self.limits.no_data:
            return Verdict(FindingKind.MISSING_DATA, silent, [])
        found = judge_recorded(
            self.views,
            waited=lambda v: self.now - (v.progressed or self.now) + WAIT_NOTE_S,
            silent=lambda v: self.last_heard(v) if self.frozen(v) else None,
            patience=self.limits.working,
            now=to_epoch(self.wall),
        )
        if found is None:
            return None
        return Verdict(found.kind, found.culprits, found.waiting, found.summary)

    def at_fault(self, incident: Incident) -> bool:
        """Whether every culprit of `incident` is still at fault: a dead one still down, a
        frozen one still silent, a stuck one still where it was when the incident opened."""
        kind = incident.finding.kind
        for runner_id in incident.finding.culpritRunnerIds:
            view = self.state.runners.get(runner_id)
            if view is None or view.ref.instanceId != incident.finding.instanceId:
                return False
            if view.gave_up is not None:
                return False  # now known to have given up on a peer: a victim after all
            if kind is FindingKind.MISSING_DATA:
                if view.progressed is not None:
                    return False
            elif self.down(view):
                if kind is not FindingKind.DEAD_RANK:
                    return False  # confirmed dead: the stall is over, a death is not
            elif kind is FindingKind.DEAD_RANK or not (
                self.frozen(view)
                or view.synopsis.phase is Phase.ERROR
                or (
                    view.synopsis.phase not in _RESTING
                    and (view.progressed is None or view.progressed < incident.opened)
                )
            ):
                return False  # back, heard, and at rest or moving since the incident opened
        return True

    def kept(self, incident: Incident) -> Verdict:
        """The incident's verdict, its culprits as they were named, the others waiting."""
        culprits = [self.state.runners[r] for r in incident.finding.culpritRunnerIds]
        return Verdict(incident.finding.kind, culprits, _without(self.views, culprits))

    # Words

    def summary(self, verdict: Verdict, task_id: str | None) -> str:
        culprits, kind = verdict.culprits, verdict.kind
        if verdict.words is not None:
            return verdict.words
        if kind is FindingKind.MISSING_DATA:
            return f"cannot decide: no data from {_ranks(culprits)}"
        if kind is FindingKind.DEAD_RANK:
            text = "; ".join(f"{_ranks([v])}: {self.why_down(v)}" for v in culprits)
        elif kind is FindingKind.RANK_DISAGREEMENT:
            text = f"{_ranks(culprits)} held in {_where(culprits[0])}"
        elif frozen := [v for v in culprits if self.frozen(v)]:
            heard = self.last_heard(min(frozen, key=self.silent_for))
            text = f"{_ranks(culprits)} went silent in {_where(culprits[0])}, last heard {heard}"
        else:
            text = f"{_ranks(culprits)} made no progress in {_where(culprits[0])}" + (
                f" with task {task_id} active" if task_id else ""
            )
        return text + "".join(f"; {_ranks([v])} {self.doing(v)}" for v in verdict.waiting)

    def why_down(self, view: RunnerView) -> str:
        if self.unreachable(view):
            return "node unreachable"
        return f"process not alive ({_exit(view) or 'exited'})"

    def doing(self, view: RunnerView) -> str:
        """What a waiting rank is doing, and how it got there."""
        words = []
        if view.gave_up is not None:
            words.append(_gave_up(view) or "")
        if self.down(view):
            words.append(self.why_down(view))
        elif view.waiting_in is not None:
            words.append(f"waiting in {view.waiting_in}")
        else:
            words.append(f"{'now ' if view.gave_up else ''}waiting in {_where(view)}")
        return ", ".join(words)


def _hms(at: str) -> str:
    """The time of day of a wire timestamp, labelled UTC: `12:01:00Z`."""
    return f"{at[11:19]}Z"


def _stopped(view: RunnerView) -> bool:
    """Whether the rank said it is shutting down (or has): its silence is on purpose."""
    return view.status is not None and view.status.statusKind in _GONE


def _without(views: list[RunnerView], some: list[RunnerView]) -> list[RunnerView]:
    ids = {v.ref.runnerId for v in some}
    return [v for v in views if v.ref.runnerId not in ids]


def _ranks(views: list[RunnerView]) -> str:
    return ", ".join(f"rank {v.ref.deviceRank} ({v.ref.nodeId})" for v in views)


def _where(view: RunnerView) -> str:
    step = f" at step {view.synopsis.step}" if view.synopsis.step is not None else ""
    return f"{view.synopsis.phase.value if view.synopsis.phase else 'no phase'}{step}"


def _exit(view: RunnerView) -> str | None:
    failure = view.failure or view.status
    return failure.detail if failure is not None else None


def _gave_up(view: RunnerView) -> str | None:
    """How and where it gave up on a peer: `timed out in decode_stream after 60s at
    12:01:00`, `lost its peer in decode_stream at 12:01:00`."""
    entry = view.gave_up
    if entry is None:
        return None
    site = entry.attrs.get("site", entry.phase.value)
    at = _hms(format_ts(parse_ts(entry.at)))
    if entry.event == Breadcrumb.PEER_LOST:
        return f"lost its peer in {site} at {at}"
    seconds = entry.attrs.get("timeoutSeconds")
    after = f" after {seconds:g}s" if isinstance(seconds, int | float) else ""
    return f"timed out in {site}{after} at {at}"


def evidence(judge: Judge, view: RunnerView, culprit: bool) -> RankEvidence:
    return RankEvidence(
        runnerId=view.ref.runnerId,
        nodeId=view.ref.nodeId,
        deviceRank=view.ref.deviceRank,
        phase=view.synopsis.phase,
        step=view.synopsis.step,
        lastProgressAt=view.synopsis.last_at,
        processAlive=view.alive,
        role=RankRole.CULPRIT if culprit else RankRole.WAITING,
        waitingIn=view.waiting_in,
        gaveUp=_gave_up(view),
        exitReason=_exit(view) if judge.down(view) or view.gave_up else None,
        pace=judge.pace(view),
    )


def straggle_of(
    state: ClusterState,
    views: list[RunnerView],
    now: float,
    limits: Thresholds,
) -> Straggle | None:
    """Who one instance's ranks wait on, the ranks compared with each other
    (`slowness.compared`); None when they cannot be compared."""
    return compared(_ranks_of(state, views), now, limits)


def _ranks_of(state: ClusterState, views: list[RunnerView]) -> Ranks:
    """One instance's ranks as the slowness rules compare them: the layers each holds
    where they are a pipeline of rankscope's runners."""
    instance = state.instances.get(views[0].ref.instanceId) if views else None
    layers = None
    if instance is not None and instance.recorded is None:
        layers = [a.endLayer - a.startLayer for a in instance.assignments]
    return Ranks([v.pace for v in views], [v.ref.nodeId for v in views], layers)
