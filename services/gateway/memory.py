"""Each rank's MLX memory and pace over a span of time, from the samples runners send
every second, cut down to a number of points a page can draw."""

from __future__ import annotations

from collections.abc import Iterable

from rankscope.shared.timestamps import micros
from rankscope.shared.wire import (
    MemoryPoint,
    MemorySampled,
    MemorySeries,
    PacePoint,
    PaceSeries,
)

__all__ = ["pace_series", "series"]


def _point(sample: MemorySampled) -> MemoryPoint:
    snapshot = sample.snapshot
    return MemoryPoint(
        at=snapshot.generatedAt,
        active=snapshot.active.inBytes if snapshot.active else None,
        peak=snapshot.peak.inBytes if snapshot.peak else None,
        cache=snapshot.cache.inBytes if snapshot.cache else None,
    )


def series(
    samples: Iterable[MemorySampled], since_us: int, until_us: int, points: int
) -> list[MemorySeries]:
    """The samples of each rank between `since_us` and `until_us` (microseconds since the
    epoch), at most `points` per rank: of each of `points` equal slices of the span, the
    sample with the most active memory, so a short peak is never averaged away.

    Ranks come in the order (instance, rank, runner)."""
    kept: dict[str, dict[int, MemoryPoint]] = {}
    who: dict[str, MemorySampled] = {}
    for sample in samples:
        slot = _slot(micros(sample.snapshot.generatedAt), since_us, until_us, points)
        if slot is None:
            continue
        point = _point(sample)
        slots = kept.setdefault(sample.runner.runnerId, {})
        held = slots.get(slot)
        if held is None or (point.active or 0) > (held.active or 0):
            slots[slot] = point
        who[sample.runner.runnerId] = sample
    return [
        MemorySeries(
            runnerId=s.runner.runnerId,
            nodeId=s.runner.nodeId,
            instanceId=s.runner.instanceId,
            deviceRank=s.runner.deviceRank,
            samples=[kept[s.runner.runnerId][k] for k in sorted(kept[s.runner.runnerId])],
        )
        for s in _ranked(who)
    ]


def _slot(at: int, since_us: int, until_us: int, points: int) -> int | None:
    if not since_us <= at <= until_us:
        return None
    return min((at - since_us) * points // max(until_us - since_us, 1), points - 1)


def _ranked(who: dict[str, MemorySampled]) -> list[MemorySampled]:
    return sorted(
        who.values(),
        key=lambda s: (s.runner.instanceId, s.runner.deviceRank, s.runner.runnerId),
    )


def pace_series(
    samples: Iterable[MemorySampled], since_us: int, until_us: int, points: int
) -> list[PaceSeries]:
    """The pace of each rank that keeps one between `since_us` and `until_us`, at most
    `points` per rank: each of `points` equal slices of the span sums the steps, work and
    wait of its samples. Ranks come in the order (instance, rank, runner)."""
    sums: dict[str, dict[int, tuple[str, int, float, float]]] = {}
    who: dict[str, MemorySampled] = {}
    for sample in samples:
        pace, at = sample.pace, sample.snapshot.generatedAt
        slot = _slot(micros(at), since_us, until_us, points)
        if pace is None or slot is None:
            continue
        slots = sums.setdefault(sample.runner.runnerId, {})
        _, steps, work, wait = slots.get(slot, (at, 0, 0.0, 0.0))
        slots[slot] = (at, steps + pace.steps, work + pace.workSeconds, wait + pace.waitSeconds)
        who[sample.runner.runnerId] = sample
    return [
        PaceSeries(
            runnerId=s.runner.runnerId,
            nodeId=s.runner.nodeId,
            instanceId=s.runner.instanceId,
            deviceRank=s.runner.deviceRank,
            points=[
                PacePoint(
                    at=at,
                    steps=steps,
                    workMs=round(1000 * work / steps, 3),
                    waitMs=round(1000 * wait / steps, 3),
                )
                for at, steps, work, wait in (
                    sums[s.runner.runnerId][k] for k in sorted(sums[s.runner.runnerId])
                )
                if steps
            ],
        )
        for s in _ranked(who)
    ]
