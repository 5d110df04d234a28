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

A stage stopped or starved of its core while it waits (a SIGSTOP duty cycle, a busy
neighbour) may show it in its wait rather than its work: stopped when its input arrives,
it starts late and its wait grows, as its peers' do. Its waits say it apart: a rank waits
spinning, and one not running takes less CPU in its wait than its peers take in theirs.
The wait a stage did not spin through, as its peers spin, is counted as its work where,
in each half of the span, its work is out of line already or it spun far slower than they.

Pure: samples come in with the time NATS stored them; the judgement takes the time now.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rankscope.services.aggregator.arrivals import Straggle
from rankscope.services.aggregator.pace import PaceHistory, Sample, typical
from rankscope.shared.settings import default

__all__ = ["StageLimits", "judge_stages", "vs_peers"]


@dataclass(frozen=True, slots=True)
class StageLimits:
    """When a stage is the one its pipeline waits on."""

    window: float = default("stage_window")
    """Seconds of the newest samples judged (a stage stopped 2 ms of every 4 was named
    17.5 s into it at p90 over 20 s, 12.5 s over 12 s; no healthy stage over either)..."""
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
    glance: float = 8.0
    """Seconds of the newest samples a stage `sharp` times its peers' work per layer in
    each half of is named without waiting for the whole window (a stage twice its peers'
    work named in ~6 s, not ~12), and a named stage back within `clear` over is cleared."""
    sharp: float = 1.8
    """(Above the 1.6x a stage sharing its core with a bursty neighbour holds for seconds
    at a time.)"""
    spins: float = 0.25
    """The share of their waits peers spend on a CPU for a stage's wait not spun through
    to count as its work: below it, ranks wait blocked (a backend that does not spin) and
    CPU time in a wait says nothing."""
    spread: float = 0.95
    """Healthy stages spin through their waits at rates that stray apart: a stage's wait
    counts as its work as far as it spun below this share of its peers' rate over the span.
    (Counted sample by sample at their full rate, a healthy stage 1.26x its peers per
    layer, spinning at 0.93x their rate over the span, had the wait of every sample that
    spun a little less counted and none taken back from those that spun more: named at
    1.39x. A stage stopped 2 ms of every 4 spins at 0.6-0.75x.)"""
    starved: float = 0.6
    """A stage spinning through its waits at this share of its peers' rate or less, in
    each half of the window, is starved or stopped whatever its work per layer says
    (healthy stages on two busy cores spun at 0.76x their peer's or more over 20 s, 19
    times in 20)."""
    clear: float = 1.2
    """A named stage stays named while its work per layer is this many times its peers',
    over the window and over the newest `glance` alike (above the 1.1x healthy stages
    often stray apart, so it clears once back in line)."""


def judge_stages(
    histories: Sequence[PaceHistory | None],
    layers: Sequence[int],
    now: float,
    limits: StageLimits,
    named: frozenset[int] = frozenset(),
    strays: Callable[[int], float] | None = None,
) -> Straggle | None:
    """The stages (each rank's pace history and the layers it holds, in stage order)
    compared over the newest `limits.window` seconds as of `now`; None when they cannot be
    (fewer than two stages, a stage holding no layer, too few steps or seconds). `named`:
    stages an open finding names, held to the `clear` bar; `strays`: how far a stage's
    own work strays by nature over such a span, where known (`pace.strays`; asked only of a
    stage out of line at the naming bar): a stage whose work wanders (sharing a core with a
    busy neighbour) is named only beyond that, or beyond `limits.beyond`."""
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
    raw, taken = taken, _stalls_as_work(taken, layers, limits)
    whole = _compared(taken, layers, since, now, limits)
    newest = _newest(raw, taken, layers, now, limits)
    glance = _compared(newest, layers, now - limits.glance, now, limits)

    def beyond_own(stage: int) -> bool:
        """Whether `stage` is out of line beyond how far its own work strays by nature."""
        own = strays(stage) if strays is not None else 0.0
        bar = max(limits.apart, min(own if own < math.inf else 0.0, limits.beyond))
        return whole.out_of_line(stage, bar)

    sharply = [
        i for i in range(len(taken)) if glance.out_of_line(i, limits.sharp) and glance.costs(i)
    ]
    stragglers = [
        i
        for i in range(len(taken))
        if (whole.out_of_line(i, limits.apart) and whole.costs(i) and beyond_own(i))
        or i in sharply
        or (i in named and min(whole.ratios[i], glance.ratios[i]) >= limits.clear)
    ]
    shown = glance if any(glance.ratios[i] > whole.ratios[i] for i in sharply) else whole
    work = [typical(samples, 2) for samples in shown.samples]
    return Straggle(
        steps=min(sum(s[1] for s in samples) for samples in shown.samples),
        since=shown.since,
        waited_on=shown.waited_on,
        last=[count / shown.slices if shown.slices else 0.0 for count in shown.most],
        work_ms=[1000 * w for w in work],
        wait_ms=[1000 * typical(samples, 3) for samples in shown.samples],
        stragglers=sorted(stragglers, key=lambda i: -shown.waited_on[i]),
        layers=list(layers),
    )


@dataclass(frozen=True, slots=True)
class _Span:
    """The stages compared over one span of their samples."""

    samples: list[list[Sample]]
    since: float
    ratios: list[float]
    """Each stage's work per layer against its peers' median."""
    halves: list[list[float]]
    """The same over each half of the span: out of line throughout, not by a burst."""
    most: list[int]
    """In how many slices of the span each stage worked the most per layer..."""
    slices: int
    often: float
    """...of how many, and how many are more than chance."""
    waited_on: list[float]
    """The share of the pipeline's work a step lost to each stage."""
    share: float

    def out_of_line(self, stage: int, bar: float) -> bool:
        """Whether `stage` worked `bar` times its peers per layer throughout the span, the
        most per layer more often than chance."""
        throughout = min(self.ratios[stage], *(half[stage] for half in self.halves))
        return throughout >= bar and self.most[stage] >= self.often

    def costs(self, stage: int) -> bool:
        """Whether the pipeline loses `share` of its work a step to `stage`, at least."""
        return self.waited_on[stage] >= self.share


def _compared(
    samples: list[list[Sample]],
    layers: Sequence[int],
    since: float,
    now: float,
    limits: StageLimits,
) -> _Span:
    """The stages compared over `samples`, `since`..`now`."""
    work = [typical(held, 2) for held in samples]
    ratios = _vs_peers(samples, layers)
    lost = [w - w / ratio if ratio > 1 else 0.0 for w, ratio in zip(work, ratios, strict=True)]
    total = sum(work)
    middle = (since + now) / 2
    most, slices = _most_per_layer(samples, layers, now, limits)
    chance = slices / len(samples)
    return _Span(
        samples=samples,
        since=since,
        ratios=ratios,
        halves=[
            _vs_peers([[s for s in held if (s[0] <= middle) == first] for held in samples], layers)
            for first in (True, False)
        ],
        most=most,
        slices=slices,
        often=chance + limits.certainty * math.sqrt(chance * (1 - 1 / len(samples))),
        waited_on=[seconds / total if total > 0 else 0.0 for seconds in lost],
        share=limits.share,
    )


def vs_peers(
    histories: Sequence[PaceHistory],
    layers: Sequence[int],
    now: float,
    span: float,
    limits: StageLimits,
) -> list[float]:
    """Each stage's work per layer over the newest `span` seconds as of `now` (the wait it
    did not spin through counted as work), against its peers' median (0.0 for every stage
    when one took no step in it)."""
    taken = [[s for s in h.samples if now - span < s[0] <= now and s[1]] for h in histories]
    return _vs_peers(_stalls_as_work(taken, layers, limits), layers)


def _stalls_as_work(
    taken: list[list[Sample]], layers: Sequence[int], limits: StageLimits
) -> list[list[Sample]]:
    """The samples with the wait a stage did not spin through, as its peers spun through
    theirs (within their `spread`), moved into its work, where in each half of the span its
    work per layer is out of line with its peers' already (at the `clear` bar: a stage
    stopped or starved is so in its work too) or it spun `starved` (a stage holding few
    layers waits so long that a wobble in how fast it spins would outweigh its work, and a
    rank descheduled a moment while it waits, as a busy machine's scheduler does to spinning
    ranks, loses nothing); as they are where a stage does not say its CPU time or its peers
    wait blocked."""
    spun = _spun(taken)
    if spun is None or min(spun) < 0:
        return taken
    first = min((samples[0][0] for samples in taken if samples), default=0.0)
    last = max((samples[-1][0] for samples in taken if samples), default=0.0)
    halves = [
        [[s for s in samples if (s[0] <= (first + last) / 2) == early] for samples in taken]
        for early in (True, False)
    ]
    judged = [(_vs_peers(half, layers), _spun(half)) for half in halves]
    moved: list[list[Sample]] = []
    for i, samples in enumerate(taken):
        peers = statistics.median(spun[:i] + spun[i + 1 :])
        if peers < limits.spins:
            return taken
        throughout = all(
            ratios[i] >= limits.clear
            or (
                rates is not None
                and 0 <= rates[i] <= limits.starved * statistics.median(rates[:i] + rates[i + 1 :])
            )
            for ratios, rates in judged
        )
        idle = max(0.0, 1 - spun[i] / (peers * limits.spread)) if throughout else 0.0
        moved.append([_moved(s, idle) for s in samples] if idle else samples)
    return moved


def _newest(
    raw: list[list[Sample]],
    moved: list[list[Sample]],
    layers: Sequence[int],
    now: float,
    limits: StageLimits,
) -> list[list[Sample]]:
    """Each stage's samples of the newest `glance` seconds, the wait it did not spin through
    counted as its work where the window's samples (`moved`, from `raw`) have it so, or else
    where the glance's own have: a stage stopped mid-run shows so in each half of the glance
    long before it does in each half of the window."""
    cut = [[s for s in samples if s[0] > now - limits.glance] for samples in raw]
    alone = _stalls_as_work(cut, layers, limits)
    return [
        [s for s in whole if s[0] > now - limits.glance] if whole is not held else own
        for held, whole, own in zip(raw, moved, alone, strict=True)
    ]  # `_stalls_as_work` hands back a stage's samples themselves where it moved nothing


def _spun(taken: list[list[Sample]]) -> list[float] | None:
    """The share of its waits each stage spent on a CPU over `taken` (-1.0 for a stage
    that waited not at all); None where a stage does not say its CPU time."""
    spun: list[float] = []
    for samples in taken:
        if any(s[4] < 0 for s in samples):
            return None
        wait, cpu = sum(s[3] for s in samples), sum(s[4] for s in samples)
        spun.append(cpu / wait if wait else -1.0)
    return spun


def _moved(sample: Sample, idle: float) -> Sample:
    """`sample` with the share `idle` of its wait counted as work."""
    at, steps, work, wait, cpu = sample
    return (at, steps, work + idle * wait, (1 - idle) * wait, cpu)


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
