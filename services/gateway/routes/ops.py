"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from starlette.responses import PlainTextResponse

from services.gateway.bus import Bus, BusError
from services.gateway.deps import bus, reader
from services.gateway.metrics import cluster_lines
from services.gateway.responses import Json
from shared.connection import slow_consumer_drops
from shared.wire import ClusterTimeline, Diagnosis, RunnerHistory, decode

__all__ = ["router"]

router = APIRouter(tags=["operations"])
Nats = Annotated[Bus, Depends(bus)]


@router.get("/healthz", response_class=Json)
async def healthz() -> Json:
    """The gateway process is up."""
    return Json({"status": "ok"})


@router.get("/readyz", response_class=Json)
async def readyz(nats: Nats) -> Json:
    """NATS connected and the aggregator answering with its views built; 503 says which not."""
    if not nats.connected:
        reason = nats.lost or "NATS is not connected"
        return Json({"status": "unavailable", "reason": reason}, status_code=503)
    if not await nats.reach.check():
        return Json({"status": "unavailable", "reason": nats.reach.why()}, status_code=503)
    try:
        health = json.loads(await nats.query("health"))
    except BusError as exc:
        return Json({"status": "unavailable", "reason": exc.detail}, status_code=503)
    if not health.get("natsReachable", True):
        return Json(
            {"status": "unavailable", "reason": "the aggregator cannot reach NATS"},
            status_code=503,
        )
    if health.get("storageProblem"):
        return Json({"status": "unavailable", "reason": health["storageProblem"]}, status_code=503)
    if not health.get("ready"):
        return Json(
            {"status": "unavailable", "reason": "the aggregator is rebuilding its views"},
            status_code=503,
        )
    return Json({"status": "ready"})


@router.get("/metrics", response_class=PlainTextResponse, dependencies=[Depends(reader)])
async def metrics(request: Request, nats: Nats) -> PlainTextResponse:
    """Prometheus text: requests and latencies, NATS state, and cluster gauges (runner,
    instance and node ids among them: closed like every read when reads need the token)."""
    lines = request.app.state.metrics.lines()
    lines += [
        "# TYPE rankscope_nats_connected gauge",
        f"rankscope_nats_connected {int(nats.connected)}",
        "# TYPE rankscope_nats_reachable gauge",
        f"rankscope_nats_reachable {int(nats.reach.reachable)}",
        "# TYPE rankscope_gateway_slow_consumer_drops_total counter",
        f"rankscope_gateway_slow_consumer_drops_total {slow_consumer_drops()}",
    ]
    try:
        health = json.loads(await nats.query("health"))
        timeline = decode(await nats.query("timeline", {"limit": 1}), ClusterTimeline)
        diagnosis = decode(await nats.query("diagnosis"), Diagnosis)
        history = decode(await nats.query("history"), list[RunnerHistory])
    except BusError:
        lines += ["# TYPE rankscope_aggregator_up gauge", "rankscope_aggregator_up 0"]
    else:
        lines += ["# TYPE rankscope_aggregator_up gauge", "rankscope_aggregator_up 1"]
        lines += cluster_lines(health, timeline, diagnosis, history)
    return PlainTextResponse(
        "\n".join(lines) + "\n", media_type="text/plain; version=0.0.4; charset=utf-8"
    )
