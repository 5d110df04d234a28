"""Each rank's pace (work and wait per step, as its samples say) and the rule that names a
rank working slower than it usually does while its peers do not: `slow_rank`.

In a pipeline or data-parallel job every rank runs at the slowest one's pace, so step
times cannot name it: the victims' steps take as long, and they wait longer. A rank's
work per step can: the culprit's grows, its peers' does not (their wait does). Work per
step differs between ranks by design (layers held, the embedding, the head), so each rank
is measured against its own history, and the culprit is the rank whose work grew out of
line with how its peers' did: a machine-wide slowdown moves every rank alike and names
none. A rank slow from its first step has no history to differ from and is not named.

Pure: samples come in with the time NATS stored them, and the rules take the time now.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import msgspec

from rankscope.services.aggregator.arrivals import Arrivals
from rankscope.shared.settings import default
from rankscope.shared.wire import PaceHistogram, RankPace, StepPace

__all__ = [
    "BOUNDS",
    "PaceHistory",
    "PaceImage",
    "PaceLimits",
    "Sample",
    "SlowVerdict",
    "judge_pace",
    "strays",
]

BOUNDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Bucket bounds of the work and wait histograms, in seconds a step."""
_USUAL_EVERY_S = 5.0
"""How often a rank's usual work per step (and its spread) is worked out again (it moves
slowly): asked before a moment, they are worked out before the start of its slice of
time this long, once a slice."""
_WORKED_OUT_KEPT = 32
"""Worked-out usuals (and spreads) a rank keeps: a few spans, a few slices each."""
HISTORY_S = 900.0
"""Seconds of a rank's samples kept: its usual pace is the median over them of its work
per step in each `PaceLimits.glance` of time, the span judged left out, so a slowdown
lasting more than half of it becomes its usual."""
_CHUNK_STEPS = 3
_LEARN_CHUNKS = 5
"""Sampled steps a stretch of time needs to count towards a rank's usual."""
UNSAID = -1.0
"""A sample's CPU time in its waits when the rank does not say it."""
_SPANS_KEPT = 4
"""Spans whose windows a rank keeps read for its next spread."""
_Key = TypeVar("_Key", int, tuple[float, int])
_MAD_TO_SD = 1.4826
"""The median absolute deviation of normal values, times this, is their deviation."""


@dataclass(frozen=True, slots=True)
class PaceLimits:
    """When a rank counts as slow: its work per step over a span of its newest samples,
    against its usual (`ratio`) and against how far its peers' moved from theirs
    (`apart`)."""

    ratio: float = default("slow_ratio")
    """Its work per step over `window` this many times its usual..."""
    window: float = default("slow_window")
    apart: float = 1.1
    """...and this many times its peers' median ratio: a machine-wide slowdown moves
    every rank alike and names none."""
    sharp: float = 1.5
    """Or: its work per step over `glance` this many times its usual and `sharp_apart`
    times its peers' ratio: a rank much slower is named sooner."""
    sharp_apart: float = 1.3
    glance: float = 8.0
    beside: float = 1.3
    """A rank out of line is named beside the worst one only if its ratio is within this
    factor of the worst's: while one rank is much slower its peers wait on it, and some of
    that wait shows as their work (a collective's input waiting on the last one)."""
    clear: float = default("slow_clear")
    """A rank named slow stays named until its ratio over `window` falls under this (or
    under `clear_apart` times its peers'); over a `glance`, only while it is over the
    bars that name a rank: a glance strays further, and a rank back in line whose pace
    wobbles after would stay named glance after glance."""
    clear_apart: float = 1.0
    hold: float = default("slow_hold")
    """Seconds a named rank must stay back in line before its finding clears: a pace
    hovering at the bars keeps one incident (and one page), not one each time it crosses."""
    reach: float = 90.0
    """How far back a span reaches for `steps` sampled steps when steps are sparse."""
    steps: int = 12
    """Sampled steps each rank needs in a span to be judged."""
    learn: float = default("slow_learn")
    """Seconds of samples a rank needs before its usual counts (and `glance`s of them
    with steps: at least five): sooner, its usual and its own spread rest on too few
    spans, and a healthy rank strays past them."""
    excess: float = 0.0001
    """Seconds a step a slow rank's work must exceed its usual by, besides the ratio: at a
    millisecond a step, the scheduler's jitter alone moves the ratio."""
    noise: float = default("slow_noise")
    """...and by this many times its own spread over spans as long: how far its work per
    step strays from its usual when nothing is wrong (1.4826 times the median absolute
    deviation of its `typical` work per step over every such span it holds). A rank
    sharing its core with others strays far, and only a slowdown beyond that names it."""


Sample = tuple[float, int, float, float, float]
"""(when NATS stored it, steps, work seconds, wait seconds, CPU seconds in the waits or
`UNSAID`)."""


class PaceImage(msgspec.Struct, array_like=True):
    """A `PaceHistory` as a snapshot keeps it."""

    samples: list[Sample]
    work_counts: list[int]
    wait_counts: list[int]
    totals: tuple[int, float, float]
    steps: list[tuple[int, float, float, float, float]] = []
    """The sampled steps said one by one: (step, stored at, work, wait, gap)."""


class PaceHistory:
    """One rank's pace samples over `history` seconds, and its histograms since the
    aggregator started.

    Args:
        history: seconds of samples kept.
    """

    def __init__(self, history: float = HISTORY_S) -> None:
        self._history = history
        self.samples: deque[Sample] = deque()
        """Oldest first."""
        self._work_counts = [0] * (len(BOUNDS) + 1)
        self._wait_counts = [0] * (len(BOUNDS) + 1)
        self._totals = (0, 0.0, 0.0)
        self._usual: dict[int, float | None] = {}
        """The usual worked out, per `_USUAL_EVERY_S` slice of time it was asked before."""
        self._spreads: dict[tuple[float, int], float | None] = {}
        """The spread worked out, per span and slice of time it was asked before."""
        self._windows: dict[float, dict[tuple[float, float, int], float]] = {}
        """The typical work per step of each span the last spread read (first and last
        sample's time, samples after the first): the next reads most of them again."""
        self.arrivals = Arrivals()
        """Its sampled steps one by one, where it says them (compared with its peers')."""

    def add(self, at: float, pace: StepPace) -> None:
        """A sample stored at `at` (seconds since the epoch); one older than the newest
        held goes in its place, so the samples stay in time order."""
        cpu = UNSAID if pace.waitCpuSeconds is None else pace.waitCpuSeconds
        sample = (at, pace.steps, pace.workSeconds, pace.waitSeconds, cpu)
        if self.samples and at < self.samples[-1][0]:
            self.samples.insert(bisect.bisect(self.samples, sample), sample)
        else:
            self.samples.append(sample)
        while self.samples and self.samples[0][0] < self.samples[-1][0] - self._history:
            self.samples.popleft()
        if pace.sampled:
            self.arrivals.add(at, pace.sampled)
        if pace.steps:
            for counts, seconds in (
                (self._work_counts, pace.workSeconds),
                (self._wait_counts, pace.waitSeconds),
            ):
                counts[bisect.bisect_left(BOUNDS, seconds / pace.steps)] += pace.steps
            steps, work, wait = self._totals
            self._totals = (steps + pace.steps, work + pace.workSeconds, wait + pace.waitSeconds)

    def stepping(self, now: float, within: float) -> bool:
        """Whether, as of `now`, its newest sampled step is at most `within` seconds old,
        or at most twice as old as the gap before it (a job stepping slowly)."""
        newest: float | None = None
        for at, count, *_ in reversed(self.samples):
            if not count or at > now:
                continue
            if newest is not None:
                return now - newest <= 2 * (newest - at)
            if now - at <= within:
                return True
            newest = at
        return False

    def recent(
        self, now: float, span: float, limits: PaceLimits
    ) -> tuple[float, int, float, float]:
        """(since when, steps, work per step, wait per step: their `typical`) of the newest
        samples, back `span` seconds from `now`, further (up to `reach`) until they hold
        `steps` steps."""
        taken: list[Sample] = []
        steps, since = 0, now
        for sample in reversed(self.samples):
            at, count = sample[0], sample[1]
            if at > now:
                continue
            if now - at > limits.reach or (now - at > span and steps >= limits.steps):
                break
            taken.append(sample)
            steps, since = steps + count, at
        return since, steps, typical(taken, 2), typical(taken, 3)

    def usual(self, before: float, limits: PaceLimits) -> float | None:
        """Its usual work per step, from its samples before `before`: the median of its
        `typical` work per step in each `glance` of time; None until `learn` seconds are
        held."""
        key = _slice(before)
        if key in self._usual:
            return self._usual[key]
        before = key * _USUAL_EVERY_S
        chunks: dict[int, list[Sample]] = {}
        first: float | None = None
        for sample in self.samples:
            if sample[0] >= before or not sample[1]:
                continue
            first = sample[0] if first is None else first
            chunks.setdefault(int(sample[0] // limits.glance), []).append(sample)
        typicals = [
            typical(chunk, 2)
            for chunk in chunks.values()
            if sum(sample[1] for sample in chunk) >= _CHUNK_STEPS
        ]
        value = None
        if len(typicals) >= _LEARN_CHUNKS and first is not None and before - first >= limits.learn:
            value = statistics.median(typicals)
        _keep(self._usual, key, value)
        return value

    def spread(self, before: float, span: float, limits: PaceLimits) -> float | None:
        """How far its work per step over `span` seconds strays from its usual, from its
        samples before `before`: 1.4826 times the median absolute deviation of its
        `typical` work per step over every `span` ending at one of them. Over shorter spans
        (down to a `glance`) while it holds fewer than five spans' worth, as those stray
        further; None while it has no usual or holds fewer than five glances' worth (too
        few to tell by)."""
        key = (span, _slice(before))
        if key in self._spreads:
            return self._spreads[key]
        before = key[1] * _USUAL_EVERY_S
        usual, value = self.usual(before, limits), None
        held = [sample for sample in self.samples if sample[0] < before]
        seconds = held[-1][0] - held[0][0] if held else 0.0
        if seconds < _LEARN_CHUNKS * limits.glance:
            held = []
        span = max(limits.glance, min(span, seconds / _LEARN_CHUNKS))
        typicals: list[float] = []
        steps, first = 0, 0
        known, kept = self._windows.get(span, {}), {}
        for last, (at, count, *_) in enumerate(held):
            steps += count
            while held[first][0] <= at - span:
                steps, first = steps - held[first][1], first + 1
            if first and steps >= _CHUNK_STEPS:  # a whole span: one began before it
                window = (held[first][0], at, last - first)
                found = known.get(window)
                kept[window] = typical(held[first : last + 1], 2) if found is None else found
                typicals.append(kept[window])
        self._windows[span] = kept
        while len(self._windows) > _SPANS_KEPT:  # spans grow while it learns: the oldest
            del self._windows[next(iter(self._windows))]
        if usual is not None and typicals:
            value = _MAD_TO_SD * statistics.median(abs(found - usual) for found in typicals)
        _keep(self._spreads, key, value)
        return value

    def histogram(self) -> PaceHistogram | None:
        """Its work and wait per step as histograms, None before its first step."""
        steps, work, wait = self._totals
        if not steps:
            return None
        return PaceHistogram(
            bounds=list(BOUNDS),
            workCounts=_cumulative(self._work_counts),
            waitCounts=_cumulative(self._wait_counts),
            steps=steps,
            workSeconds=work,
            waitSeconds=wait,
        )

    def image(self) -> PaceImage:
        return PaceImage(
            samples=list(self.samples),
            work_counts=list(self._work_counts),
            wait_counts=list(self._wait_counts),
            totals=self._totals,
            steps=[(step, *held) for step, held in self.arrivals.steps.items()],
        )

    @classmethod
    def from_image(cls, image: PaceImage) -> PaceHistory:
        """The history `image` holds.

        Raises:
            ValueError: its histograms do not have one count a bucket.
        """
        buckets = len(BOUNDS) + 1
        if len(image.work_counts) != buckets or len(image.wait_counts) != buckets:
            raise ValueError(f"pace histograms of {len(image.work_counts)} buckets, not {buckets}")
        history = cls()
        history.samples = deque(sorted(image.samples))
        history._work_counts, history._wait_counts = image.work_counts, image.wait_counts
        history._totals = image.totals
        history.arrivals.steps = {s[0]: (s[1], s[2], s[3], s[4]) for s in image.steps}
        return history


def _slice(before: float) -> int:
    """The `_USUAL_EVERY_S` slice of time `before` falls in."""
    return math.floor(before / _USUAL_EVERY_S)


def _keep(worked_out: dict[_Key, float | None], key: _Key, value: float | None) -> None:
    """`value` kept under `key`, the oldest kept dropped past `_WORKED_OUT_KEPT`."""
    worked_out[key] = value
    while len(worked_out) > _WORKED_OUT_KEPT:
        del worked_out[next(iter(worked_out))]


def typical(samples: Sequence[Sample], field: int) -> float:
    """The interquartile mean per step of the seconds at `field` (2: work, 3: wait) of
    `samples`: the mean of the middle half of their values per step, each sample weighing
    its steps (0.0 when they hold none). A sampled step preempted on a busy core (ten times
    its usual work, now and then) moves a plain mean over a span of them; a slowdown moves
    the middle half."""
    values = sorted((sample[field] / sample[1], sample[1]) for sample in samples if sample[1])
    total = sum(count for _, count in values)
    low, high = total / 4, 3 * total / 4
    passed, kept, summed = 0, 0.0, 0.0
    for value, count in values:
        inside = min(passed + count, high) - max(passed, low)
        if inside > 0:
            kept, summed = kept + inside, summed + inside * value
        passed += count
    return summed / kept if kept else 0.0


def _cumulative(counts: Sequence[int]) -> list[int]:
    total, out = 0, []
    for count in counts:
        total += count
        out.append(total)
    return out


@dataclass(frozen=True, slots=True)
class SlowVerdict:
    """The ranks working slower than usual (by index into the ranks judged), every rank's
    pace over the span that showed it, and per rank its peers' median ratio."""

    slow: list[int]
    paces: list[RankPace]
    peers_ratio: list[float]
    backed: list[float] | None = None
    """Where a pipeline's stages compared back it: each stage's work per layer over its
    peers' median."""


def paces_of(
    histories: Sequence[PaceHistory | None], now: float, span: float, limits: PaceLimits
) -> list[RankPace | None]:
    """Each rank's pace over its newest `span` seconds (None: it keeps none or took no
    step)."""
    return [found[0] if found else None for found in _spans(histories, now, span, limits)]


def _spans(
    histories: Sequence[PaceHistory | None], now: float, span: float, limits: PaceLimits
) -> list[tuple[RankPace, PaceHistory, float] | None]:
    """Each rank's pace over its newest `span` seconds, with its history and when the
    span began."""
    out: list[tuple[RankPace, PaceHistory, float] | None] = []
    for history in histories:
        found = history.recent(now, span, limits) if history is not None else None
        if history is None or found is None or not found[1]:
            out.append(None)
            continue
        since, steps, work, wait = found
        usual = history.usual(since, limits)
        pace = RankPace(
            steps=steps,
            workMs=round(1000 * work, 3),
            waitMs=round(1000 * wait, 3),
            usualWorkMs=round(1000 * usual, 3) if usual else None,
            ratio=round(work / usual, 3) if usual else None,
        )
        out.append((pace, history, since))
    return out


def strays(history: PaceHistory, since: float, span: float, limits: PaceLimits) -> float:
    """The ratio to its usual that a rank's own spread over spans of `span` seconds reaches
    (`PaceLimits.noise` deviations); infinite while it is not known."""
    usual, spread = history.usual(since, limits), history.spread(since, span, limits)
    return 1 + limits.noise * spread / usual if usual and spread is not None else math.inf


def judge_pace(
    histories: Sequence[PaceHistory | None],
    now: float,
    limits: PaceLimits,
    named: frozenset[int] = frozenset(),
) -> SlowVerdict | None:
    """The ranks working slower than usual while their peers do not, judged at `now`
    (`slow` empty: none is); None when no span can be judged (fewer than two ranks, or one
    with no pace kept, too few steps or too little history). `named`: ranks an open finding
    names, held to the `clear` bars. Of the two spans judged, the one that shows its
    slowest rank slowest is the evidence."""
    if len(histories) < 2:
        return None
    verdict: tuple[float, SlowVerdict] | None = None
    judged_none: SlowVerdict | None = None
    for span, bar, apart in (
        (limits.window, limits.ratio, limits.apart),
        (limits.glance, limits.sharp, limits.sharp_apart),
    ):
        found = [
            f
            for f in _spans(histories, now, span, limits)
            if f is not None and f[0].ratio and f[0].steps >= limits.steps
        ]
        if len(found) < len(histories):
            continue
        judged = [pace for pace, _, _ in found]
        ratios = [p.ratio or 0.0 for p in judged]
        peers = [statistics.median(ratios[:i] + ratios[i + 1 :]) for i in range(len(ratios))]
        held = [i in named and span == limits.window for i in range(len(found))]
        slow = [  # its spread worked out only for a rank over the bars (it reads the history)
            i
            for i, (pace, history, since) in enumerate(found)
            if _slow(pace, peers[i], limits, (bar, apart), named=held[i])
            and (held[i] or ratios[i] >= strays(history, since, span, limits))
        ]
        if not slow:
            judged_none = judged_none or SlowVerdict(slow=[], paces=judged, peers_ratio=peers)
            continue
        worst = max(ratios[i] for i in slow)
        if verdict is None or worst > verdict[0]:  # the evidence: the span showing it most
            slow = [i for i in slow if ratios[i] * limits.beside >= worst]
            verdict = worst, SlowVerdict(slow=slow, paces=judged, peers_ratio=peers)
    return verdict[1] if verdict else judged_none


def _slow(
    pace: RankPace, peers: float, limits: PaceLimits, bars: tuple[float, float], *, named: bool
) -> bool:
    """Whether `pace` is out of line: its ratio over the first of `bars` and over the
    second times its peers' median ratio (`peers`); for a rank already named, over the
    clearing bars."""
    ratio, usual = pace.ratio or 0.0, pace.usualWorkMs or 0.0
    if named:
        return ratio >= limits.clear and ratio >= limits.clear_apart * peers
    bar, apart = bars
    return ratio >= bar and ratio >= apart * peers and (pace.workMs - usual) / 1000 >= limits.excess
