"""The rules over a recorded job's ranks (`rankscope record`): they move in collectives,
not in phases. Pure: the ranks as the aggregator sees them in, a verdict out.

A recorded rank says when it has waited in a collective for a while (`collective_wait`,
its site `all_sum #417 (group world)`, `step` the collective's number in its group), and
its process's end with how it ended. Whoever waits is a victim unless the ranks disagree
on what they wait in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rankscope.services.aggregator.runners import RunnerView
from rankscope.shared.timestamps import to_epoch
from rankscope.shared.wire import FindingKind, RunnerStatusKind

__all__ = ["RecordedVerdict", "judge_recorded"]

DEATH_SPREAD_S = 0.1
"""Ranks killed this close to the first death died with it (an OOM killer, a lost
machine)."""
CAUSE_WINDOW_S = 2.0
"""Deaths this close to the first are weighed together: a launcher stops every rank the
moment one dies, and who noticed first is a matter of scheduling."""


NOTE_SLACK_S = 1.5
"""A rank heard this long after its peer said it waits would have said so too, were it
waiting (it says so after a second, and its word comes in order with what follows)."""
_STOPS = frozenset({"SIGTERM", "SIGINT", "SIGHUP"})
"""How launchers and operators ask a process to stop."""
_ABORTS = frozenset({"SIGABRT"})
"""How a process ends itself on an error it met (`std::terminate`: gloo's and NCCL's
watchdogs abort a rank whose peer is gone)."""


@dataclass(frozen=True, slots=True)
class RecordedVerdict:
    """Who is at fault, who waits on them, in words."""

    kind: FindingKind
    culprits: list[RunnerView]
    waiting: list[RunnerView]
    summary: str


def _rank(view: RunnerView) -> str:
    return f"rank {view.ref.deviceRank} ({view.ref.nodeId})"


def _current(waiting: Sequence[RunnerView]) -> list[RunnerView]:
    """The waiting ranks whose news is current: a rank said to wait in a collective of a
    group whose later collective a peer waits in is stale news (the peer could not have
    passed it without the rank; its completion and next wait are still on their way)."""

    def group(view: RunnerView) -> str:
        return (view.waiting_in or "").rpartition("(group ")[2]

    newest: dict[str, int] = {}
    for view in waiting:
        newest[group(view)] = max(newest.get(group(view), 0), view.synopsis.step or 0)
    return [v for v in waiting if (v.synopsis.step or 0) >= newest[group(v)]]


def _in_collective(view: RunnerView) -> bool:
    """Waiting in a collective it named (`all_sum #417 (group world)`), not merely in an
    evaluation (`eval()`: whose collectives, if any, compiled code hides)."""
    return view.waiting_in is not None and " #" in view.waiting_in


def _ended(view: RunnerView) -> bool:
    return view.status is not None and not view.status.processAlive


def _clean(view: RunnerView) -> bool:
    """Ended as programs end: exit status 0."""
    status = view.status
    return (
        status is not None
        and not status.processAlive
        and status.statusKind is RunnerStatusKind.SHUTDOWN
        and status.exitCode == 0
    )


def _end(view: RunnerView) -> float:
    """When its process ended (seconds since the epoch)."""
    return to_epoch(view.status.at) if view.status is not None else 0.0


def _sureness(view: RunnerView) -> int:
    """How surely its death is a cause rather than a consequence: killed outright, or
    gone without a word (2); failed with an exit status or aborted itself, perhaps on its
    lost peer (1); stopped politely, as launchers stop the rest once one died (0)."""
    status = view.status
    if status is None or status.signal in _STOPS:
        return 0
    if status.signal in _ABORTS:
        return 1
    return 1 if status.signal is None and status.exitCode is not None else 2


def _how(view: RunnerView) -> str:
    status = view.status
    if status is None:
        return "ended"
    if status.signal:
        return f"killed by {status.signal}"
    if status.exitCode is not None:
        return f"exited with status {status.exitCode}"
    return status.detail or "ended"


def _doing(view: RunnerView) -> str:
    """What a rank not at fault is doing."""
    if _ended(view):
        return f"{_how(view)} after it"
    return f"waits in {view.waiting_in}" if view.waiting_in else "runs outside any collective"


def _list(views: Sequence[RunnerView]) -> str:
    return "".join(f"; {_rank(v)} {_doing(v)}" for v in views)


def judge_recorded(
    views: Sequence[RunnerView],
    *,
    waited: Callable[[RunnerView], float],
    silent: Callable[[RunnerView], str | None],
    patience: float,
    now: float,
) -> RecordedVerdict | None:
    """What the ranks of one recorded job say now.

    Args:
        views: the job's ranks.
        waited: seconds a rank has been waiting in its collective.
        silent: when a running rank was last heard, when it has been silent longer than
            a live one can be (its process is stopped or wedged), else None.
        patience: seconds of waiting past which the ranks not waiting are held to account.
        now: the wall clock (seconds since the epoch).
    """
    if any(v.status is not None and v.status.stoppedByUser for v in views):
        return None  # the user stopped the job: however its ranks end, it is no fault
    dead = sorted((v for v in views if _ended(v) and not _clean(v)), key=_end)
    if dead:
        near = [v for v in dead if _end(v) - _end(dead[0]) <= CAUSE_WINDOW_S]
        worst = max(_sureness(v) for v in near)
        first = next(v for v in near if _sureness(v) == worst)
        if worst < 2 and now - _end(first) < CAUSE_WINDOW_S:
            return None  # stopped or failed after a peer, perhaps: how it ended may follow
        culprits = [first] + [
            v
            for v in near
            if v is not first
            and _sureness(v) == worst == 2
            and _end(v) - _end(first) <= DEATH_SPREAD_S
        ]
        others = [v for v in views if v not in culprits]
        words = "; ".join(f"{_rank(v)}: process {_how(v)}" for v in culprits)
        return RecordedVerdict(FindingKind.DEAD_RANK, culprits, others, words + _list(others))
    frozen = [(v, heard) for v in views if (heard := silent(v)) is not None]
    if frozen and len(frozen) < len(views):
        culprits = [v for v, _ in frozen]
        others = [v for v in views if v not in culprits]
        words = "; ".join(
            f"{_rank(v)} went silent, last heard {heard} (stopped or wedged)"
            if v.waiting_in is None
            else f"{_rank(v)} went silent in {v.waiting_in}, last heard {heard}"
            for v, heard in frozen
        )
        return RecordedVerdict(FindingKind.STALLED_RANK, culprits, others, words + _list(others))
    waiting = [v for v in views if _in_collective(v) and waited(v) > patience]
    if not waiting:
        return None
    held = [v for v in views if v not in waiting]
    finished = [v for v in held if _clean(v)]
    if finished:
        words = "; ".join(
            f"{_rank(v)} ended after {v.synopsis.step or 0} collectives" for v in finished
        )
        return RecordedVerdict(
            FindingKind.RANK_DISAGREEMENT, finished, waiting, words + _list(waiting)
        )
    noted = max(v.progressed or 0.0 for v in waiting)
    outside = [
        v
        for v in held
        if v.waiting_in is None and v.heard is not None and v.heard - noted > NOTE_SLACK_S
    ]
    if outside:
        words = f"{', '.join(_rank(v) for v in outside)} outside any collective"
        return RecordedVerdict(FindingKind.STALLED_RANK, outside, waiting, words + _list(waiting))
    current = _current(waiting)
    if held or len({v.waiting_in for v in current}) == 1:
        return None  # all in one collective, or some not waiting long yet (or in evaluations)
    sites: dict[str | None, list[RunnerView]] = {}
    for view in current:
        sites.setdefault(view.waiting_in, []).append(view)
    odd = min(  # the fewest ranks; of as few, the newest (an older number is stale news:
        # its peers could not have passed it without it, a completion said late)
        sites.values(),
        key=lambda group: (len(group), -max(v.synopsis.step or 0 for v in group)),
    )
    others = [v for v in waiting if v not in odd]
    words = "ranks wait in different collectives: " + "; ".join(
        f"{_rank(v)} in {v.waiting_in}" for v in waiting
    )
    return RecordedVerdict(FindingKind.RANK_DISAGREEMENT, odd, others, words)
