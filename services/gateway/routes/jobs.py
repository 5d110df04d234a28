"""Jobs and their rank tables, as JSON and as server-sent events."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends
from nats.aio.msg import Msg
from starlette.responses import StreamingResponse

from services.gateway.bus import Bus
from services.gateway.deps import bus, reader
from services.gateway.responses import Json, fail, schema_ref
from shared.headers import VERSION_HEADER
from shared.wire import RankTable, RankTableStream, decode, encode

__all__ = ["HEARTBEAT_S", "router"]

router = APIRouter(dependencies=[Depends(reader)], tags=["jobs"])
Nats = Annotated[Bus, Depends(bus)]
HEARTBEAT_S = 15.0


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


def _event(version: int, wire: RankTableStream) -> bytes:
    return b"event: ranktable\nid: %d\ndata: %s\n\n" % (version, encode(wire))


@router.get("/v1/jobs/{jobId}/ranktable/stream")
async def ranktable_stream(jobId: str, nats: Nats) -> StreamingResponse:  # noqa: N803
    """Server-sent events: the current table on connect (when there is one), then every
    change, with a comment line as heartbeat every 15 s."""
    changes: asyncio.Queue[Msg] = asyncio.Queue()
    subscription = await nats.nc.subscribe(nats.layout.subjects.ranktable(jobId), cb=changes.put)
    latest = await nats.ranktable(jobId)

    async def events() -> AsyncIterator[bytes]:
        seen = 0
        try:
            if latest is not None:
                seen = latest[0]
                yield _event(*latest)
            while True:
                try:
                    msg = await asyncio.wait_for(changes.get(), HEARTBEAT_S)
                except TimeoutError:
                    yield b": heartbeat\n\n"
                    continue
                version = int((msg.headers or {}).get(VERSION_HEADER, "0"))
                if version > seen:
                    seen = version
                    yield _event(version, decode(msg.data, RankTableStream))
        finally:
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )
