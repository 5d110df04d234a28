"""PyTorch Flight Recorder dumps put into rankscope (`rankscope fr load`)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request

from rankscope.services.gateway.bodies import strict
from rankscope.services.gateway.deps import Nats, writer
from rankscope.services.gateway.responses import Json, fail, schema_ref
from rankscope.shared.specs import id_problem
from rankscope.shared.timestamps import parse_ts
from rankscope.shared.wire.fr import FrLoad

__all__ = ["router"]

router = APIRouter(tags=["dumps"])


async def _body(request: Request) -> bytes:
    return await request.body()


@router.post(
    "/v1/fr/loads",
    response_class=Json,
    status_code=202,
    dependencies=[Depends(writer)],
    openapi_extra={"requestBody": schema_ref(FrLoad)},
)
async def load_dumps(nats: Nats, body: Annotated[bytes, Depends(_body)]) -> Json:
    """A job's Flight Recorder dumps as `rankscope fr load` judged them: its ranks shown
    as instance `jobId` (a job loaded again replaces its ranks), the verdict as an
    incident of it (the same dumps loaded twice make one incident)."""
    load = strict(body, FrLoad)
    if (problem := id_problem(load.jobId)) is not None:
        raise fail(422, f"invalid body: `$.jobId`: {problem}")
    try:
        parse_ts(load.loadedAt)
    except ValueError as exc:
        raise fail(422, f"invalid body: `$.loadedAt`: {exc}") from None
    subject = nats.layout.subjects.fr_load(load.jobId)
    await nats.publish(subject, body, msg_id=f"fr:{load.jobId}:{load.loadedAt}")
    return Json({"jobId": load.jobId, "culprits": load.verdict.culprits}, status_code=202)
