"""Who a pipeline waits on: each stage's work per layer, compared with its peers' over the
same span.

A pipeline's stages hand one step down the line and meet at its end, so every stage waits
for the others' work and a stage's wait says nothing of who is slow; its work does. Work
per step differs between stages by design (the layers each holds), so each stage's work
is taken per layer held: the stage doing more per layer than its peers, consistently, is
the one its receivers wait on, and what it takes beyond its peers' pace for the layers it
holds is the time the pipeline loses to it. Compared between stages over one span, a
machine-wide slowdown and a stage slow from its first step read right, with no history
to learn, and no clock compared between hosts: works are durations on each rank's own
clock.

Pure: samples come in with the time NATS stored them; the judgement takes the time now.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from rankscope.services.aggregator.arrivals import Straggle
from rankscope.services.aggregator.pace import PaceHistory, typical
from rankscope.shared.settings import default

__all__ = ["StageLimits", "judge_stages", "vs_peers"]

Sample = tuple[float, int, float, float]
"""(when NATS stored it, steps, work seconds, wait seconds)."""


@dataclass(frozen=True, slots=True)
class StageLimits:
    """When a stage is the one its pipeline waits on."""

    window: float = default("straggler_window")
    """Seconds of the newest samples judged..."""
    steps: int = 12
    """...once every stage's hold this many sampled steps..."""
    span: float = 5.0
    """...over this many seconds at least (a burst of steps is one moment)."""
    slice: float = 2.0
    """Seconds of samples compared at a time, to tell a consistent straggler from a stage
    the scheduler held up once."""
    apart: float = 1.35
    """A stage is named when its work per layer is this many times its peers' median
    (healthy stages sharing two busy cores strayed up to 1.27x apart over 20 s)..."""
    certainty: float = 2.0
    """...when it did the most per layer in more slices than chance (1/N) by this many
    standard deviations of chance's count..."""
    share: float = 0.03
    """...and the pipeline loses this share of its work a step to it, at least (a stage
    doing next to nothing costs nothing to speak of, however out of line)."""
    beyond: float = 1.6
    """A stage this many times its peers' work per layer is named whatever its own work
    strays: the pipeline loses a sixth of its work a step to it or more. (A stage's spread
    is learnt over 15 minutes, slowdowns included: one crowded a minute in three strayed
    2.2-2.8x by its history, and was named 40 s into a slowdown instead of 7.)"""
    clear: float = 1.2
    """A named stage stays named while its work per layer is this many times its peers'
    (above the 1.1x healthy stages often stray apart, so it clears once back in line)."""


def judge_stages(
    histories: Sequence[PaceHistory | None],
    layers: Sequence[int],
    now: float,
    limits: StageLimits,
    named: frozenset[int] = frozenset(),
    strays: Sequence[float] = (),
) -> Straggle | None:
    """The stages (each rank's pace history and the layers it holds, in stage order)
    compared over the newest `limits.window` seconds as of `now`; None when they cannot be
    (fewer than two stages, a stage holding no layer, too few steps or seconds). `named`:
    stages an open finding names, held to the `clear` bar; `strays`: how far each stage's
    own work strays by nature over such a span, where known (`pace.strays`): a stage whose
    work wanders (sharing a core with a busy neighbour) is named only beyond that, or
    beyond `limits.beyond`."""
    if len(histories) < 2 or len(layers) != len(histories) or min(layers, default=0) < 1:
        return None
    taken: list[list[Sample]] = []
    for history in histories:
        if history is None:
            return None
        taken.append([s for s in history.samples if now - limits.window < s[0] <= now and s[1]])
    if any(sum(s[1] for s in samples) < limits.steps for samples in taken):
        return None
    since = min(samples[0][0] for samples in taken)
    if now - since < limits.span:
        return None
    work = [typical(samples, 2) for samples in taken]
    wait = [typical(samples, 3) for samples in taken]
    ratios = _vs_peers(taken, layers)
    middle = (since + now) / 2
    halves = [  # each half of the span on its own: out of line throughout, not by a burst
        _vs_peers([[s for s in samples if (s[0] <= middle) == first] for samples in taken], layers)
        for first in (True, False)
    ]
    size, total = len(work), sum(work)
    lost = [w - w / ratio if ratio > 1 else 0.0 for w, ratio in zip(work, ratios, strict=True)]
    waited_on = [seconds / total if total > 0 else 0.0 for seconds in lost]
    bars = [
        max(limits.apart, min(own if own < math.inf else 0.0, limits.beyond))
        for own in strays or [0.0] * size
    ]
    most, slices = _most_per_layer(taken, layers, now, limits)
    chance = slices / size
    often = chance + limits.certainty * math.sqrt(chance * (1 - 1 / size))
    stragglers = [
        i
        for i in range(size)
        if (
            min(ratios[i], *(half[i] for half in halves)) >= bars[i]
            and most[i] >= often
            and waited_on[i] >= limits.share
        )
        or (i in named and ratios[i] >= limits.clear)
    ]
    return Straggle(
        steps=min(sum(s[1] for s in samples) for samples in taken),
        since=since,
        waited_on=waited_on,
        last=[count / slices if slices else 0.0 for count in most],
        work_ms=[1000 * w for w in work],
        wait_ms=[1000 * w for w in wait],
        stragglers=sorted(stragglers, key=lambda i: -waited_on[i]),
        layers=list(layers),
    )


def vs_peers(
    histories: Sequence[PaceHistory], layers: Sequence[int], now: float, span: float
) -> list[float]:
    """Each stage's work per layer over the newest `span` seconds as of `now`, against its
    peers' median (0.0 for every stage when one took no step in it)."""
    taken = [[s for s in h.samples if now - span < s[0] <= now and s[1]] for h in histories]
    return _vs_peers(taken, layers)


def _vs_peers(taken: list[list[Sample]], layers: Sequence[int]) -> list[float]:
    """Each stage's work per layer over `taken` against its peers' median (0.0 for every
    stage when one took no step in it)."""
    if any(not samples for samples in taken):
        return [0.0] * len(taken)
    per_layer = [typical(s, 2) / held for s, held in zip(taken, layers, strict=True)]
    return [
        per_layer[i] / peers
        if (peers := statistics.median(per_layer[:i] + per_layer[i + 1 :]))
        else 1.0
        for i in range(len(per_layer))
    ]


def _most_per_layer(
    taken: list[list[Sample]], layers: Sequence[int], now: float, limits: StageLimits
) -> tuple[list[int], int]:
    """Per stage, in how many `slice`s of the window it worked the most per layer, and
    how many slices every stage stepped in."""
    slices: list[dict[int, list[Sample]]] = []
    for samples in taken:
        held: dict[int, list[Sample]] = {}
        for sample in samples:
            held.setdefault(int((now - sample[0]) // limits.slice), []).append(sample)
        slices.append(held)
    most, counted = [0] * len(taken), 0
    for index in set.intersection(*(set(held) for held in slices)):
        per_layer = [
            sum(s[2] for s in held[index]) / sum(s[1] for s in held[index]) / count
            for held, count in zip(slices, layers, strict=True)
        ]
        most[max(range(len(per_layer)), key=per_layer.__getitem__)] += 1
        counted += 1
    return most, counted
