"""Skulk's diagnostics routes, so its dashboard and scripts work against rankscope
unchanged: the cross-rank timeline where Skulk serves it, each node's and the whole
cluster's diagnostics bundles, and the tracing switch."""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

import msgspec
from fastapi import APIRouter, Depends, Request

from services.gateway.bodies import strict
from services.gateway.bus import Bus, BusError
from services.gateway.deps import reader, writer
from services.gateway.responses import Json, fail, schema_ref
from services.gateway.routes.cluster import Filters, Nats, timeline
from services.gateway.skulk import node_bundle
from shared.timestamps import now
from shared.wire import ClusterTimeline, InstanceState, PlacementRunnerDiagnostics, decode
from shared.wire.skulk import ClusterDiagnostics, ClusterNodeDiagnostics, SkulkNodeDiagnostics

__all__ = ["router"]

router = APIRouter(tags=["skulk"])


class Tracing(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Skulk's tracing switch."""

    enabled: bool


@router.get(
    "/v1/diagnostics/cluster/timeline",
    response_class=Json,
    dependencies=[Depends(reader)],
    responses={200: schema_ref(ClusterTimeline)},
)
async def skulk_timeline(filters: Filters, nats: Nats) -> Json:
    """The cross-rank timeline (as `/v1/cluster/timeline`) at Skulk's route."""
    return await timeline(filters, nats)


async def _bundle(nats: Bus, node_id: str) -> SkulkNodeDiagnostics:
    live, instances, placed = await asyncio.gather(
        nats.node(node_id),
        nats.query("instances"),
        nats.query("placement", {"localNodeId": node_id}),
    )
    return node_bundle(
        live,
        decode(instances, list[InstanceState]),
        decode(placed, list[PlacementRunnerDiagnostics]),
        now(),
    )


@router.get(
    "/v1/diagnostics/cluster/{nodeId}",
    response_class=Json,
    dependencies=[Depends(reader)],
    responses={200: schema_ref(SkulkNodeDiagnostics)},
)
async def node_diagnostics(nodeId: str, nats: Nats) -> Json:  # noqa: N803 - Skulk's name
    """One node's bundle, from its agent's live view and the placements (404 when no
    agent of that node listens, 503 when it does not answer in time)."""
    return Json(await _bundle(nats, nodeId))


@router.get(
    "/v1/diagnostics/cluster",
    response_class=Json,
    dependencies=[Depends(reader)],
    responses={200: schema_ref(ClusterDiagnostics)},
)
async def cluster_diagnostics(nats: Nats) -> Json:
    """Every node's bundle, asked at once under one deadline: every node with a heartbeat
    and every node a placement names, each `ok` with its bundle or with why not."""
    placed = decode(await nats.query("placement"), list[PlacementRunnerDiagnostics])
    beating = await nats.values(nats.layout.nodes_bucket.bucket)
    expected = sorted(set(beating) | {p.nodeId for p in placed})
    found = await asyncio.gather(*(_bundle(nats, n) for n in expected), return_exceptions=True)
    nodes = [
        ClusterNodeDiagnostics(nodeId=node_id, ok=True, diagnostics=bundle)
        if isinstance(bundle, SkulkNodeDiagnostics)
        else ClusterNodeDiagnostics(nodeId=node_id, ok=False, error=_why(bundle))
        for node_id, bundle in zip(expected, found, strict=True)
    ]
    versions = {n.diagnostics.runtime.skulkVersion for n in nodes if n.diagnostics}
    status: Literal["consistent", "mixed", "unknown"] = "consistent"
    if len(versions) > 1:
        status = "mixed"
    elif not all(n.ok for n in nodes):
        status = "unknown"
    return Json(
        ClusterDiagnostics(
            generatedAt=now(), localNodeId=nats.local_node, versionStatus=status, nodes=nodes
        )
    )


def _why(error: BaseException) -> str:
    if isinstance(error, BusError):
        return error.detail
    return f"{type(error).__name__}: {error}"


@router.get("/v1/tracing", response_class=Json, dependencies=[Depends(reader)])
async def tracing() -> Json:
    """Always on: every runner records its flight recorder, which the diagnosis reads."""
    return Json({"enabled": True})


async def _body(request: Request) -> bytes:
    return await request.body()


@router.put("/v1/tracing", response_class=Json, dependencies=[Depends(writer)])
async def set_tracing(body: Annotated[bytes, Depends(_body)]) -> Json:
    """Turning it on is a no-op; off is refused (409): without the flight recorder no
    stuck rank could be named."""
    if not strict(body, Tracing).enabled:
        raise fail(409, "tracing cannot be turned off: the diagnosis reads the flight recorder")
    return Json({"enabled": True})
