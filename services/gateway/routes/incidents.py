"""Past incidents: the history (each with the fault it was and how often that was seen
before), the faults by count, and one incident as one file."""

from __future__ import annotations

import importlib.metadata
from datetime import timedelta
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Response

from rankscope.services.gateway.bundle import Bundle
from rankscope.services.gateway.bus import Bus, last_words
from rankscope.services.gateway.deps import Nats, reader
from rankscope.services.gateway.responses import Json, fail, schema_ref
from rankscope.services.gateway.routes.cluster import moment
from rankscope.services.gateway.trace import to_trace
from rankscope.shared.signatures import seen_before
from rankscope.shared.subjects import token
from rankscope.shared.timestamps import format_ts, now, parse_ts
from rankscope.shared.views import PLACEMENT, TIMELINE
from rankscope.shared.wire import (
    ClusterTimeline,
    Diagnosis,
    FaultSignature,
    Finding,
    NodeInfo,
    PlacementRunnerDiagnostics,
    TimelineQuery,
    WireError,
    decode,
)

__all__ = ["BEFORE_S", "router"]

EVERY = 10**9
"""No limit: signatures count over everything the diagnosis stream holds."""

router = APIRouter(dependencies=[Depends(reader)], tags=["cluster"])

BEFORE_S = 60.0
"""How much of the timeline before an incident opened its bundle holds."""


@router.get(
    "/v1/cluster/diagnosis/history",
    response_class=Json,
    responses={200: schema_ref(Diagnosis)},
)
async def diagnosis_history(
    nats: Nats,
    since: Annotated[str | None, Query(description="RFC 3339")] = None,
    instanceId: Annotated[str | None, Query(min_length=1)] = None,  # noqa: N803
    limit: Annotated[int, Query(ge=1, le=10_000)] = 200,
) -> Json:
    """Every incident since `since` (of one instance, or all), open or cleared, in its
    last word, oldest first: the newest `limit` of them; each with its `signature` and
    how often the same fault was seen before it (`seenBefore`)."""
    start = moment(since, "since")
    if instanceId is not None:
        token(instanceId)  # an id no subject can carry is a 422, as everywhere
    told = seen_before(await nats.findings(since=None, instance_id=None, limit=EVERY))
    found = [
        f
        for f in told
        if (start is None or f.since >= format_ts(parse_ts(start)))
        and (instanceId is None or f.instanceId == instanceId)
    ]
    return Json(Diagnosis(generatedAt=now(), findings=found[-limit:]))


@router.get(
    "/v1/cluster/diagnosis/signatures",
    response_class=Json,
    responses={200: schema_ref(list[FaultSignature])},
)
async def fault_signatures(nats: Nats) -> Json:
    """The faults the incident history holds, most often seen first: each with how many
    incidents it was, first and last when, and the latest of them."""
    faults: dict[str, list[Finding]] = {}
    for finding in seen_before(await nats.findings(since=None, instance_id=None, limit=EVERY)):
        faults.setdefault(finding.signature or "", []).append(finding)
    listed = [
        FaultSignature(
            signature=mark,
            kind=seen[-1].kind,
            count=len(seen),
            first=seen[0].since,
            last=seen[-1].since,
            incidentIds=[f.incidentId for f in seen[-20:] if f.incidentId],
            summary=seen[-1].summary,
        )
        for mark, seen in faults.items()
    ]
    return Json(sorted(listed, key=lambda s: (-s.count, s.last)))


@router.get(
    "/v1/cluster/diagnosis/history/{incidentId}/bundle",
    responses={200: {"content": {"application/gzip": {}}}, 404: {}},
)
async def incident_bundle(incidentId: str, nats: Nats) -> Response:  # noqa: N803
    """A gzipped tar of the incident: every word published of it (with the evidence
    captured: stacks, process state, MLX memory), its instance's timeline from a minute
    before it opened to its close (JSON and Perfetto trace), the placement and the rank
    table, the versions known, and a README saying what it could not hold."""
    published = await nats.published()  # one read: the incident and what was seen before
    updates = [f for f in published if f.key == incidentId]
    if not updates:
        raise fail(
            404, f"no incident {incidentId!r} in the diagnosis stream (or past its retention)"
        )
    last = updates[-1]
    bundle = Bundle(incidentId)
    bundle.add("incident.json", updates)
    for finding in seen_before(last_words(published)):
        if finding.key == incidentId:
            bundle.add(
                "seen_before.json",
                {"signature": finding.signature, "seenBefore": finding.seenBefore},
            )
    if last.instanceId:
        await _timeline(nats, bundle, last.instanceId, last.since, last.clearedAt)
        await _placement(nats, bundle, last.instanceId)
        if (dumps := await nats.fr_load(last.instanceId)) is not None:  # `rankscope fr load`
            bundle.add("fr_verdict.json", dumps.verdict)
    else:
        bundle.lacks("a timeline: the incident is of the installation (NATS), not of one instance")
    await _versions(nats, bundle, {e.nodeId for f in updates for e in f.evidence})
    return Response(
        bundle.archive(),
        media_type="application/gzip",
        headers={"Content-Disposition": f'attachment; filename="incident-{incidentId}.tar.gz"'},
    )


async def _timeline(
    nats: Bus, bundle: Bundle, instance_id: str, since: str, cleared: str | None
) -> None:
    start = format_ts(parse_ts(since) - timedelta(seconds=BEFORE_S))
    asked = TimelineQuery(
        instanceId=instance_id, since=start, until=cleared or now(), limit=100_000
    )
    raw = await nats.query(TIMELINE, asked)
    try:
        found = decode(raw, ClusterTimeline)
    except WireError as exc:
        bundle.lacks(f"the timeline: the aggregator answered nonsense ({exc})")
        return
    bundle.add("timeline.json", raw)
    bundle.add("trace.json", to_trace(found))
    if not found.timeline:
        bundle.lacks(f"timeline entries from {start}: none held (evicted, or past retention)")
    elif found.timeline[0].at > since:
        bundle.lacks(f"timeline entries from {start} to {found.timeline[0].at}: none held")


async def _placement(nats: Bus, bundle: Bundle, instance_id: str) -> None:
    placed: list[PlacementRunnerDiagnostics] = await nats.ask(PLACEMENT)
    ranks = [p for p in placed if p.runnerId.startswith(f"{instance_id}-")]
    if ranks:
        bundle.add("placement.json", ranks)
    else:
        bundle.lacks("the placement: the instance is no longer placed")
    table = await nats.ranktable(instance_id)
    if table is None:
        bundle.lacks("the rank table: the job has none now")
    else:
        version, stream = table
        bundle.add("ranktable.json", {"version": version, "rankTable": stream.rankTable})
        bundle.lacks(f"the rank table as it was at open: the one held is version {version}, now")


async def _versions(nats: Bus, bundle: Bundle, nodes: set[str]) -> None:
    known = await nats.values(nats.layout.nodes_bucket.bucket)
    agents = {}
    for node_id in sorted(nodes):
        raw = known.get(node_id)
        agents[node_id] = decode(raw, NodeInfo).agentVersion if raw else None
    here = {name: _version(name) for name in ("rankscope", "mlx", "mlx-lm")}
    bundle.add("versions.json", {"gateway": here, "agents": agents})
    bundle.lacks("the MLX and mlx-lm versions of each node: agents report their own only")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
