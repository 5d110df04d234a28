"""Each rank's MLX memory over a span of time, from the samples runners send every second,
cut down to a number of points a page can draw."""

from __future__ import annotations

from collections.abc import Iterable

from rankscope.shared.timestamps import micros
from rankscope.shared.wire import MemoryPoint, MemorySampled, MemorySeries

__all__ = ["series"]


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
    span = max(until_us - since_us, 1)
    kept: dict[str, dict[int, MemoryPoint]] = {}
    who: dict[str, MemorySampled] = {}
    for sample in samples:
        at = micros(sample.snapshot.generatedAt)
        if not since_us <= at <= until_us:
            continue
        slot = min((at - since_us) * points // span, points - 1)
        point = _point(sample)
        slots = kept.setdefault(sample.runner.runnerId, {})
        held = slots.get(slot)
        if held is None or (point.active or 0) > (held.active or 0):
            slots[slot] = point
        who[sample.runner.runnerId] = sample
    ranks = sorted(
        who.values(),
        key=lambda s: (s.runner.instanceId, s.runner.deviceRank, s.runner.runnerId),
    )
    return [
        MemorySeries(
            runnerId=s.runner.runnerId,
            nodeId=s.runner.nodeId,
            instanceId=s.runner.instanceId,
            deviceRank=s.runner.deviceRank,
            samples=[kept[s.runner.runnerId][k] for k in sorted(kept[s.runner.runnerId])],
        )
        for s in ranks
    ]
