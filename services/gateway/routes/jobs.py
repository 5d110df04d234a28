"""Jobs and their rank tables, as JSON and as server-sent events."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends
from nats.aio.msg import Msg
from sse_starlette import EventSourceResponse, ServerSentEvent

from rankscope.services.gateway.deps import Nats, reader
from rankscope.services.gateway.responses import SSE_PING_S, Json, fail, schema_ref
from rankscope.shared.headers import VERSION_HEADER
from rankscope.shared.wire import RankTable, RankTableStream, decode, encode

__all__ = ["router"]

router = APIRouter(dependencies=[Depends(reader)], tags=["jobs"])


@router.get("/v1/jobs", response_class=Json)
async def jobs(nats: Nats) -> Json:
    """Every job with its rank table's status and version."""
    found = []
    for job_id in await nats.jobs():
        latest = await nats.ranktable(job_id)
        if latest is not None:
            version, wire = latest
            found.append(
                {
                    "jobId": job_id,
                    "status": decode(wire.rankTable, RankTable).status,
                    "version": version,
                }
            )
    return Json({"jobs": found})


@router.get(
    "/v1/jobs/{jobId}/ranktable", response_class=Json, responses={200: schema_ref(RankTableStream)}
)
async def ranktable(jobId: str, nats: Nats) -> Json:  # noqa: N803
    """The job's global rank table (ClusterD `RankTableStream`); its version is the ETag."""
    latest = await nats.ranktable(jobId)
    if latest is None:
        raise fail(404, f"job {jobId!r} has no rank table")
    version, wire = latest
    return Json(wire, headers={"ETag": f'"{version}"'})


def _event(version: int, wire: RankTableStream) -> ServerSentEvent:
    return ServerSentEvent(data=encode(wire).decode(), event="ranktable", id=str(version))


@router.get("/v1/jobs/{jobId}/ranktable/stream")
async def ranktable_stream(jobId: str, nats: Nats) -> EventSourceResponse:  # noqa: N803
    """Server-sent events: the current table on connect (when there is one), then every
    change, with a comment line as heartbeat every 15 s."""
    changes: asyncio.Queue[Msg] = asyncio.Queue()
    subscription = await nats.nc.subscribe(nats.layout.subjects.ranktable(jobId), cb=changes.put)
    latest = await nats.ranktable(jobId)

    async def events() -> AsyncIterator[ServerSentEvent]:
        seen = 0
        try:
            if latest is not None:
                seen = latest[0]
                yield _event(*latest)
            while True:
                msg = await changes.get()
                version = int((msg.headers or {}).get(VERSION_HEADER, "0"))
                if version > seen:
                    seen = version
                    yield _event(version, decode(msg.data, RankTableStream))
        finally:
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()

    return EventSourceResponse(events(), ping=SSE_PING_S, sep="\n")
