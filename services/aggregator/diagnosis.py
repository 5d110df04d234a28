"""Name the rank an instance is waiting on.

Pure: the cluster state and the clock in, findings out. Progress is judged by when the
aggregator last received an entry from a rank (its own clock), not by the runners' clocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.aggregator.views import ClusterState, RunnerView
from shared.wire import Finding, FindingKind, InstanceCreated, Phase, RankEvidence, RunnerStatusKind

__all__ = ["PHASE_ORDER", "Thresholds", "diagnose"]

PHASE_ORDER = {phase: index for index, phase in enumerate(Phase)}
"""Phases in the order a request goes through them (the seed's order)."""

_RESTING = frozenset({Phase.IDLE, Phase.CREATED, Phase.SHUTDOWN_CLEANUP, Phase.ERROR})
_LONG = frozenset({Phase.CONNECT_GROUP, Phase.LOAD_MODEL, Phase.WARMUP})
_GONE = frozenset({RunnerStatusKind.SHUTDOWN, RunnerStatusKind.SHUTTING_DOWN})


@dataclass(frozen=True, slots=True)
class Thresholds:
    """Seconds without progress before a rank counts as stuck."""

    working: float = 10.0
    loading: float = 300.0
    no_data: float = 30.0
    silent: float = 5.0
    """A live runner samples its memory every second; this long without a word from it
    means its process is frozen, not merely waiting in a collective."""

    def of(self, phase: Phase | None) -> float:
        """The threshold that applies in `phase`."""
        return self.loading if phase in _LONG else self.working


def _evidence(view: RunnerView) -> RankEvidence:
    return RankEvidence(
        runnerId=view.ref.runnerId,
        nodeId=view.ref.nodeId,
        deviceRank=view.ref.deviceRank,
        phase=view.phase,
        step=view.step,
        lastProgressAt=view.last_at,
        processAlive=view.alive,
    )


def _finding(
    instance: InstanceCreated,
    kind: FindingKind,
    culprits: list[RunnerView],
    waiting: list[RunnerView],
    summary: str,
    views: list[RunnerView],
    since: str,
) -> Finding:
    return Finding(
        instanceId=instance.instanceId,
        kind=kind,
        culpritRanks=[v.ref.deviceRank for v in culprits],
        culpritRunnerIds=[v.ref.runnerId for v in culprits],
        waitingRanks=[v.ref.deviceRank for v in waiting],
        summary=summary,
        since=since,
        evidence=[_evidence(v) for v in views],
    )


def _ranks(views: list[RunnerView]) -> str:
    return ", ".join(f"rank {v.ref.deviceRank} ({v.ref.nodeId})" for v in views)


def _where(view: RunnerView) -> str:
    step = f" at step {view.step}" if view.step is not None else ""
    return f"{view.phase.value if view.phase else 'no phase'}{step}"


def diagnose(
    state: ClusterState,
    *,
    now: float,
    since: Callable[[str, FindingKind], str],
    placed_at: Callable[[str], float],
    thresholds: Thresholds = Thresholds(),
) -> list[Finding]:
    """Findings for every live instance.

    Args:
        state: the cluster state.
        now: the aggregator's monotonic clock now.
        since: when a finding of this instance and kind was first seen (for `since`).
        placed_at: monotonic time the aggregator learnt of an instance's placement.
        thresholds: how long is too long.
    """
    findings: list[Finding] = []
    for instance in state.instances.values():
        views = [state.runners[a.runnerId] for a in instance.assignments]
        findings.extend(
            _diagnose_instance(state, instance, views, now, since, placed_at, thresholds)
        )
    return findings


def _diagnose_instance(
    state: ClusterState,
    instance: InstanceCreated,
    views: list[RunnerView],
    now: float,
    since: Callable[[str, FindingKind], str],
    placed_at: Callable[[str], float],
    thresholds: Thresholds,
) -> list[Finding]:
    def stale(view: RunnerView) -> bool:
        last = view.progressed if view.progressed is not None else placed_at(instance.instanceId)
        return now - last > thresholds.of(view.phase)

    def make(
        kind: FindingKind, culprits: list[RunnerView], waiting: list[RunnerView], summary: str
    ) -> Finding:
        return _finding(
            instance, kind, culprits, waiting, summary, views, since(instance.instanceId, kind)
        )

    silent = [v for v in views if v.progressed is None]
    if silent and now - placed_at(instance.instanceId) > thresholds.no_data:
        summary = f"cannot decide: no data from {_ranks(silent)}"
        return [make(FindingKind.MISSING_DATA, silent, [], summary)]
    dead = [
        v
        for v in views
        if (not v.alive or v.ref.nodeId in state.unreachable)
        and not (v.status and v.status.statusKind in _GONE)
    ]
    alive = [v for v in views if v not in dead]
    if dead:
        why = {
            v.ref.runnerId: "node unreachable"
            if v.ref.nodeId in state.unreachable
            else f"process not alive ({(v.status.detail if v.status else None) or 'exited'})"
            for v in dead
        }
        return [
            make(
                FindingKind.DEAD_RANK,
                dead,
                alive,
                "; ".join(f"{_ranks([v])}: {why[v.ref.runnerId]}" for v in dead)
                + (f"; waiting: {_ranks(alive)}" if alive else ""),
            )
        ]
    frozen = [v for v in views if v.heard is not None and now - v.heard > thresholds.silent]
    if frozen and len(frozen) < len(views):
        # A live runner samples its memory every second, busy or idle: silence while its
        # peers still talk means a frozen process (stopped, wedged in the kernel), and
        # whatever the instance does next waits on it.
        waiting = [v for v in views if v not in frozen]
        summary = (
            f"{_ranks(frozen)} went silent in {_where(frozen[0])} "
            f"{now - max(v.heard or now for v in frozen):.0f}s ago; "
            f"{_ranks(waiting)} waiting in "
            f"{', '.join(sorted({_where(v) for v in waiting}))}"
        )
        return [make(FindingKind.STALLED_RANK, frozen, waiting, summary)]
    working = [v for v in views if v.phase not in _RESTING]
    if not working or not all(stale(v) for v in working):
        return []
    # Ranks move in lockstep: one at rest while a peer waits in a collective is behind too.
    steps = {v.step for v in views if v.step is not None}
    phases = {v.phase for v in views if v.phase is not None}
    if len(steps) > 1 or len(phases) > 1:
        if len(steps) > 1:
            low = min(steps)
            behind = [v for v in views if v.step == low]
        else:
            first = min(PHASE_ORDER[p] for p in phases)
            behind = [v for v in views if v.phase is not None and PHASE_ORDER[v.phase] == first]
        waiting = [v for v in views if v not in behind]
        summary = (
            f"{_ranks(behind)} held in {_where(behind[0])}; "
            f"{_ranks(waiting)} waiting in "
            f"{', '.join(sorted({_where(v) for v in waiting}))}"
        )
        return [make(FindingKind.RANK_DISAGREEMENT, behind, waiting, summary)]
    stuck = [v for v in working if v.task_id is not None]
    if not stuck:
        return []
    return [
        make(
            FindingKind.STALLED_RANK,
            stuck,
            [],
            f"{_ranks(stuck)} made no progress in {_where(stuck[0])} "
            f"with task {stuck[0].task_id} active",
        )
    ]
