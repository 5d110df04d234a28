"""Skulk's diagnostics routes, so its dashboard and scripts work against rankscope
unchanged: the cross-rank timeline where Skulk serves it, and the tracing switch."""

from __future__ import annotations

from typing import Annotated

import msgspec
from fastapi import APIRouter, Depends, Request

from services.gateway.bodies import strict
from services.gateway.deps import reader, writer
from services.gateway.responses import Json, fail, schema_ref
from services.gateway.routes.cluster import Filters, Nats, timeline
from shared.wire import ClusterTimeline

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
