"""Cross-rank views: timeline (JSON and trace), diagnosis, placement."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated

import msgspec
from fastapi import APIRouter, Depends, Query

from rankscope.services.gateway.bus import Bus, BusError
from rankscope.services.gateway.deps import Nats, reader
from rankscope.services.gateway.memory import pace_series, series
from rankscope.services.gateway.responses import Json, fail, schema_ref
from rankscope.services.gateway.trace import to_trace
from rankscope.shared.timestamps import format_ts, micros, now, parse_ts
from rankscope.shared.views import DIAGNOSIS, HISTORY, PLACEMENT, TIMELINE
from rankscope.shared.wire import (
    ClusterMemory,
    ClusterPace,
    ClusterTimeline,
    Diagnosis,
    DiagnosisQuery,
    Finding,
    FindingKind,
    MemorySampled,
    PlacementQuery,
    PlacementRunnerDiagnostics,
    RunnerHistory,
    TimelineQuery,
)

__all__ = ["Filters", "moment", "router", "timeline"]

router = APIRouter(dependencies=[Depends(reader)], tags=["cluster"])


def moment(value: str | None, name: str) -> str | None:
    if value is None:
        return None
    try:
        parse_ts(value)
    except ValueError:
        raise fail(
            422, f"query parameter {name!r} is not an RFC 3339 timestamp: {value!r}"
        ) from None
    return value


async def _filters(
    instanceId: Annotated[str | None, Query(min_length=1)] = None,  # noqa: N803
    nodeId: Annotated[str | None, Query(min_length=1)] = None,  # noqa: N803
    modelId: Annotated[str | None, Query(min_length=1)] = None,  # noqa: N803
    since: Annotated[str | None, Query(description="RFC 3339")] = None,
    until: Annotated[str | None, Query(description="RFC 3339")] = None,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 1000,
) -> TimelineQuery:
    return TimelineQuery(
        instanceId=instanceId,
        nodeId=nodeId,
        modelId=modelId,
        since=moment(since, "since"),
        until=moment(until, "until"),
        limit=limit,
    )


Filters = Annotated[TimelineQuery, Depends(_filters)]


@router.get(
    "/v1/cluster/timeline", response_class=Json, responses={200: schema_ref(ClusterTimeline)}
)
async def timeline(filters: Filters, nats: Nats) -> Json:
    """Every rank's synopsis and flight-recorder entries, merged and sorted by `at`."""
    asked = msgspec.structs.replace(filters, localNodeId=nats.local_node)
    return Json(await nats.query(TIMELINE, asked))


@router.get("/v1/cluster/timeline/trace", response_class=Json)
async def timeline_trace(filters: Filters, nats: Nats) -> Json:
    """The timeline as Chrome trace-event JSON (open it in Perfetto)."""
    found: ClusterTimeline = await nats.ask(TIMELINE, filters)
    return Json(
        to_trace(found), headers={"Content-Disposition": 'inline; filename="rankscope.trace.json"'}
    )


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_DEFAULT_SPAN = timedelta(minutes=5)
MEMORY_SAMPLES = 200_000
"""The most memory samples one query reads (about 55 rank-hours at one a second)."""


class Span:
    """The samples of one instance or all over a span of time, as a query asks for them."""

    def __init__(
        self,
        instanceId: Annotated[str | None, Query(min_length=1)] = None,  # noqa: N803
        since: Annotated[str | None, Query(description="RFC 3339; default 5 minutes ago")] = None,
        until: Annotated[str | None, Query(description="RFC 3339; default now")] = None,
        points: Annotated[int, Query(ge=2, le=2000)] = 300,
    ) -> None:
        # nothing is older than the epoch: a year-1 time means "from the first"
        end = max(parse_ts(moment(until, "until") or now()), _EPOCH)
        given = moment(since, "since")
        start = max(parse_ts(given) if given else end - _DEFAULT_SPAN, _EPOCH)
        if start >= end:
            raise fail(422, "`since` must come before `until`")
        self.instance_id, self.start, self.points = instanceId, start, points
        self.since, self.until = format_ts(start), format_ts(end)

    async def samples(self, nats: Bus) -> list[MemorySampled]:
        """The samples stored within the span."""
        return await nats.memory_samples(
            instance_id=self.instance_id, since=self.start, limit=MEMORY_SAMPLES
        )


@router.get("/v1/cluster/memory", response_class=Json, responses={200: schema_ref(ClusterMemory)})
async def memory(nats: Nats, span: Annotated[Span, Depends()]) -> Json:
    """Each rank's MLX memory (active, peak, cache) from `since` to `until`, at most
    `points` per rank (of each slice of the span, its sample with the most active
    memory), from the samples runners send every second."""
    found = series(await span.samples(nats), micros(span.since), micros(span.until), span.points)
    return Json(ClusterMemory(generatedAt=now(), since=span.since, until=span.until, runners=found))


@router.get("/v1/cluster/pace", response_class=Json, responses={200: schema_ref(ClusterPace)})
async def pace(nats: Nats, span: Annotated[Span, Depends()]) -> Json:
    """Each rank's work and wait per step from `since` to `until`, at most `points` per
    rank (each slice of the span sums its samples), from the samples runners send every
    second: a rank slower than its peers works longer a step, its peers wait longer."""
    samples = await span.samples(nats)
    found = pace_series(samples, micros(span.since), micros(span.until), span.points)
    return Json(ClusterPace(generatedAt=now(), since=span.since, until=span.until, runners=found))


@router.get("/v1/cluster/diagnosis", response_class=Json, responses={200: schema_ref(Diagnosis)})
async def diagnosis(
    nats: Nats,
    instanceId: Annotated[str | None, Query(min_length=1, max_length=1024)] = None,  # noqa: N803
    kind: FindingKind | None = None,
) -> Json:
    """Open findings, each naming the rank at fault and the ranks waiting on it; while
    NATS does not answer, the one finding that says so. At most 2 MB: past it stacks, then
    whole findings are left out (`omitted` counts them); `instanceId` and `kind` narrow it."""
    try:
        return Json(await nats.query(DIAGNOSIS, DiagnosisQuery(instanceId=instanceId, kind=kind)))
    except BusError:
        if nats.reach.reachable:
            raise
    outage = Finding(
        instanceId="",
        kind=FindingKind.NATS_UNREACHABLE,
        culpritRanks=[],
        culpritRunnerIds=[],
        summary=f"{nats.reach.why()}; nothing is known of the ranks until it answers",
        since=nats.reach.down_since_wall or now(),
    )
    return Json(Diagnosis(generatedAt=now(), findings=[outage]))


@router.get(
    "/v1/cluster/history",
    response_class=Json,
    responses={200: schema_ref(list[RunnerHistory])},
)
async def history(nats: Nats) -> Json:
    """How much of each runner's history is held: the oldest seq and entry kept, seqs
    that never arrived, and entries evicted by retention."""
    return Json(await nats.query(HISTORY))


@router.get(
    "/v1/placement/runners",
    response_class=Json,
    responses={200: schema_ref(list[PlacementRunnerDiagnostics])},
)
async def placement(nats: Nats) -> Json:
    """Where every rank of every live instance runs and which layers it holds."""
    return Json(await nats.query(PLACEMENT, PlacementQuery(localNodeId=nats.local_node)))


@router.get(
    "/v1/placement/runners/{runnerId}",
    response_class=Json,
    responses={200: schema_ref(PlacementRunnerDiagnostics)},
)
async def placement_of(runnerId: str, nats: Nats) -> Json:  # noqa: N803
    """One rank's placement."""
    asked = PlacementQuery(runnerId=runnerId, localNodeId=nats.local_node)
    return Json(await nats.query(PLACEMENT, asked))
