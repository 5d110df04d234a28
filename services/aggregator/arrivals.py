"""Who the job waits on: each rank's sampled steps, named alike on every rank, compared rank
by rank on the same step.

In a collective every rank joins, the ranks leave together, so the one that arrived last
waited least, and what its peers waited beyond its own wait is time the job lost to it.
Summed over the steps where it was last, as a share of the steps' time, beyond the same
share of its median peer (on a busy machine every rank is the last now and then), that is
the share of the job's time lost to it; how often it was last, against the 1/N of chance,
says whether it is one rank or the luck of the scheduler. Compared between ranks on
one step, a machine-wide slowdown, a neighbour taking turns on a core and a rank slow from
its first step all read right, with no history to learn, and no clock compared between
hosts: works and waits are durations on each rank's own clock.

Pure: steps come in with the time NATS stored them; the judgement takes the time now.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from rankscope.shared.settings import default
from rankscope.shared.wire import SampledStep

__all__ = ["STEPS_KEPT", "ArrivalLimits", "Arrivals", "Straggle", "judge_arrivals"]

STEPS_KEPT = 2048
"""Sampled steps kept per rank (minutes of them at ten a second)."""


@dataclass(frozen=True, slots=True)
class ArrivalLimits:
    """When a rank is the one its job waits on."""

    window: float = default("straggler_window")
    """Seconds of the newest steps every rank sampled that are judged..."""
    steps: int = 20
    """...once they hold this many..."""
    span: float = 5.0
    """...stored over this many seconds at least: a job's first steps are uneven (compiling,
    warming caches, one rank started later), and a burst of them is one moment."""
    share: float = default("straggler_share")
    """The share of the steps' time the job loses to a rank (`Straggle.waited_on`) that
    names it (a change counts from 10%, as the field's best count a fail-slow)..."""
    certainty: float = 4.0
    """...when it arrived last more often than chance (1/N) by this many standard
    deviations of chance's count: consistently, not by the luck of the scheduler."""
    alone: float = 0.05
    """...and when the job would get back this share were the rank alone as quick as its
    peers (on the steps it was last, the next to arrive waited that much beyond it): where
    two ranks share a busy core, the job waits on the other once one is quick, and neither
    alone is the one it waits on."""
    clear: float = 0.05
    """A named rank stays named while the job loses this share to it over the window..."""
    glance: float = 8.0
    """...and `still` over the newest this many seconds of steps: a rank back in line is
    cleared once they say so, not once its slow steps have left the window..."""
    still: float = 0.075
    """...(between `clear` and the naming bar: at `clear`, a rank whose share by nature
    sat at 7-10%, sharing a busy core, stayed named two minutes after the slowdown that
    named it; at 10%, the newest 8 s of a rank given 4/3 its work dipped below it and
    one of 25 was named past 30 s)."""
    dominance: float = 2.5
    """A rank is named alone only when the job loses this many times more to it than to
    any other rank of its node: where two ranks share a busy core (or a node's ranks share
    its slowness) the blame is split, and the node is the straggler (named as a whole when
    its ranks together stand out from every other node's), or none is."""


class Arrivals:
    """One rank's sampled steps, the newest `STEPS_KEPT`: per step, when NATS stored it
    (seconds since the epoch) and the seconds it worked, waited, and spent between the
    step before and this one."""

    def __init__(self) -> None:
        self.steps: dict[int, tuple[float, float, float, float]] = {}

    def add(self, at: float, sampled: Sequence[SampledStep]) -> None:
        """Steps said in a sample stored at `at`; a step said again replaces the first."""
        for step in sampled:
            self.steps.pop(step.step, None)
            self.steps[step.step] = (at, step.workSeconds, step.waitSeconds, step.gapSeconds)
        while len(self.steps) > STEPS_KEPT:
            del self.steps[next(iter(self.steps))]


@dataclass(frozen=True, slots=True)
class Straggle:
    """The ranks of a job compared over the newest steps every one of them sampled, each
    list in rank order."""

    steps: int
    """Steps compared."""
    since: float
    """When the oldest of them was stored (seconds since the epoch)."""
    waited_on: list[float]
    """The share of the steps' whole time (between steps included) the job spent waiting
    for each rank beyond what it spent waiting for its median peer: the time lost to it,
    not to the luck of the scheduler, which makes every rank the last now and then."""
    last: list[float]
    """The share of the steps on which each rank arrived last."""
    work_ms: list[float]
    """Each rank's median work a step, in milliseconds."""
    wait_ms: list[float]
    """Each rank's median wait a step, in milliseconds."""
    stragglers: list[int]
    """The ranks the job waits on, by index, the most waited on first."""
    layers: list[int] | None = None
    """The layers each rank holds, where ranks are a pipeline's stages (their work is
    compared per layer)."""

    def work_vs_peers(self, rank: int) -> float:
        """The rank's median work a step (per layer, in a pipeline) over its peers' median
        of theirs."""
        work = self.work_ms
        if self.layers is not None:
            work = [ms / held for ms, held in zip(work, self.layers, strict=True)]
        peers = statistics.median(work[:rank] + work[rank + 1 :])
        return work[rank] / peers if peers > 0 else 1.0


def judge_arrivals(
    ranks: Sequence[Arrivals | None],
    now: float,
    limits: ArrivalLimits,
    named: frozenset[int] = frozenset(),
    nodes: Sequence[str] = (),
) -> Straggle | None:
    """The ranks compared over the newest `limits.window` seconds of steps every one
    sampled, as of `now`; None when they cannot be (fewer than two ranks, a rank with no
    sampled steps, fewer than `limits.steps` in common). `named`: ranks an open finding
    names, held to the `clear` bar; `nodes`: each rank's node (none given: each its own)."""
    if len(ranks) < 2 or any(r is None or not r.steps for r in ranks):
        return None
    held = [r.steps for r in ranks if r is not None]
    joined: list[list[tuple[float, float, float, float]]] = []
    oldest = now
    for step in reversed(min(held, key=len).keys()):
        rows = [steps.get(step) for steps in held]
        if any(row is None for row in rows):
            continue
        found = [row for row in rows if row is not None]
        at = max(row[0] for row in found)
        if at > now:
            continue
        if now - at > limits.window:
            break
        joined.append(found)
        oldest = min(oldest, at)
    if len(joined) < limits.steps or now - oldest < limits.span:
        return None
    size = len(held)
    shares = _shares(joined, size)
    newest = [ranked for ranked in joined if max(row[0] for row in ranked) > now - limits.glance]
    if len(newest) >= limits.steps:
        shares = replace(shares, still=_shares(newest, size).waited_on)
    waited_on = shares.waited_on
    stragglers = sorted(
        _stragglers(shares, list(nodes) or [str(i) for i in range(size)], named, limits),
        key=lambda i: -waited_on[i],
    )
    return Straggle(
        steps=len(joined),
        since=oldest,
        waited_on=waited_on,
        last=[count / len(joined) for count in shares.last],
        work_ms=[1000 * statistics.median(r[i][1] for r in joined) for i in range(size)],
        wait_ms=[1000 * statistics.median(r[i][2] for r in joined) for i in range(size)],
        stragglers=stragglers,
    )


def _shares(joined: list[list[tuple[float, float, float, float]]], size: int) -> _Shares:
    """The ranks' shares over the steps of `joined` (each step's rows in rank order)."""
    lost, alone, last, total = [0.0] * size, [0.0] * size, [0] * size, 0.0
    for ranked in joined:
        waits = [row[2] for row in ranked]
        total += statistics.median(row[1] + row[2] + row[3] for row in ranked)
        arrived_last = min(range(size), key=waits.__getitem__)
        peers = waits[:arrived_last] + waits[arrived_last + 1 :]
        last[arrived_last] += 1
        lost[arrived_last] += max(0.0, statistics.median(peers) - waits[arrived_last])
        alone[arrived_last] += max(0.0, min(peers) - waits[arrived_last])
    waited_on = _beyond_peers(lost, total)
    return _Shares(waited_on, _beyond_peers(alone, total), last, still=waited_on)


def _beyond_peers(seconds: list[float], total: float) -> list[float]:
    """Each rank's seconds as a share of `total`, beyond its median peer's: on a busy
    machine every rank is now and then the last."""
    shares = [lost / total if total > 0 else 0.0 for lost in seconds]
    return [
        max(0.0, shares[i] - statistics.median(shares[:i] + shares[i + 1 :]))
        for i in range(len(shares))
    ]


@dataclass(frozen=True, slots=True)
class _Shares:
    """Per rank: the share the job loses waiting for it, the share it would get back were
    the rank alone as quick as its peers, the steps it arrived last on, and the share the
    job loses to it over the newest `glance` of the steps (where they are too few to say,
    over all of them)."""

    waited_on: list[float]
    back: list[float]
    last: list[int]
    still: list[float]


def _stragglers(
    shares: _Shares, nodes: list[str], named: frozenset[int], limits: ArrivalLimits
) -> set[int]:
    """The ranks the job waits on: one rank, when the share lost to it is past the bar,
    it was last more often than chance, the job would get back `alone` were it quick, and
    it dominates its node's other ranks; else a node's ranks together, when the same holds
    of them (but the getting back) against every other node's ranks; and the ranks of an
    open finding, while the job still loses `clear` to them. None the newest steps show
    the job losing less than `still` to: they are back in line."""
    waited_on, last = shares.waited_on, shares.last
    size, steps = len(waited_on), sum(last)
    members: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        members.setdefault(node, []).append(i)

    def stands_out(group: list[int], rivals: list[int]) -> bool:
        share, chance = sum(waited_on[i] for i in group), steps * len(group) / size
        often = chance + limits.certainty * math.sqrt(chance * (1 - len(group) / size))
        return (
            share >= limits.share
            and sum(last[i] for i in group) >= often
            and all(share >= limits.dominance * waited_on[j] for j in rivals)
        )

    found = {
        i
        for i in range(size)
        if shares.still[i] >= limits.still
        and (
            (
                shares.back[i] >= limits.alone
                and stands_out([i], [j for j in members[nodes[i]] if j != i])
            )
            or (i in named and waited_on[i] >= limits.clear)
        )
    }
    for group in members.values():
        rivals = [j for j in range(size) if j not in group]
        held = set(group) <= named and sum(waited_on[i] for i in group) >= limits.clear
        if (
            len(group) > 1
            and rivals
            and sum(shares.still[i] for i in group) >= limits.still
            and (held or stands_out(group, rivals))
        ):
            found.update(group)
    return found
