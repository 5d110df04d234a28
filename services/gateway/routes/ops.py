"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, Metric
from starlette.responses import PlainTextResponse, Response

from rankscope.services.gateway.bus import Bus, BusError
from rankscope.services.gateway.deps import NOT_YET, Nats, reader
from rankscope.services.gateway.metrics import cluster_families, exposition, gauge
from rankscope.services.gateway.responses import Json
from rankscope.shared.connection import slow_consumer_drops
from rankscope.shared.views import DIAGNOSIS, HEALTH, HISTORY, TIMELINE
from rankscope.shared.wire import (
    AggregatorHealth,
    ClusterTimeline,
    Diagnosis,
    RunnerHistory,
    TimelineQuery,
    WireError,
)

__all__ = ["router"]

router = APIRouter(tags=["operations"])


@router.get("/healthz", response_class=Json)
async def healthz() -> Json:
    """The gateway process is up."""
    return Json({"status": "ok"})


@router.get("/readyz", response_class=Json)
async def readyz(request: Request) -> Json:
    """NATS connected and the aggregator answering with its views built; 503 says which not."""
    nats: Bus | None = request.app.state.bus
    if nats is None:
        return Json({"status": "unavailable", "reason": NOT_YET}, status_code=503)
    if not nats.connected:
        reason = nats.lost or "NATS is not connected"
        return Json({"status": "unavailable", "reason": reason}, status_code=503)
    if not await nats.reach.check():
        return Json({"status": "unavailable", "reason": nats.reach.why()}, status_code=503)
    try:
        health: AggregatorHealth = await nats.ask(HEALTH)
    except (BusError, WireError) as exc:
        reason = exc.detail if isinstance(exc, BusError) else f"a bad health answer: {exc}"
        return Json({"status": "unavailable", "reason": reason}, status_code=503)
    if missing := health.missingPartitions:
        reason = "; ".join(f"partition {m.partition}: {m.reason}" for m in missing)
        return Json({"status": "unavailable", "reason": reason}, status_code=503)
    if not health.natsReachable:
        return Json(
            {"status": "unavailable", "reason": "the aggregator cannot reach NATS"},
            status_code=503,
        )
    if health.storageProblem:
        return Json({"status": "unavailable", "reason": health.storageProblem}, status_code=503)
    if not health.ready:
        return Json(
            {"status": "unavailable", "reason": "the aggregator is rebuilding its views"},
            status_code=503,
        )
    return Json({"status": "ready"})


@router.get("/metrics", response_class=PlainTextResponse, dependencies=[Depends(reader)])
async def metrics(request: Request, nats: Nats) -> Response:
    """Prometheus text: requests and latencies, NATS state, and cluster gauges (runner,
    instance and node ids among them: closed like every read when reads need the token)."""
    families: list[Metric] = [
        gauge("rankscope_nats_connected", "Whether the gateway's NATS link is up.", nats.connected),
        gauge(
            "rankscope_nats_reachable",
            "Whether NATS answered the gateway's last ping.",
            nats.reach.reachable,
        ),
        CounterMetricFamily(
            "rankscope_gateway_slow_consumer_drops",
            "Messages the gateway's NATS client dropped (always 0 unless something is wrong).",
            value=slow_consumer_drops(),
        ),
    ]
    try:
        health: AggregatorHealth = await nats.ask(HEALTH)
        timeline: ClusterTimeline = await nats.ask(TIMELINE, TimelineQuery(limit=1))
        diagnosis: Diagnosis = await nats.ask(DIAGNOSIS)
        history: list[RunnerHistory] = await nats.ask(HISTORY)
    except (BusError, WireError):
        families.append(gauge("rankscope_aggregator_up", "Whether the aggregator answered.", 0))
    else:
        families.append(gauge("rankscope_aggregator_up", "Whether the aggregator answered.", 1))
        families.append(
            gauge(
                "rankscope_aggregator_partitions_missing",
                "Aggregator partitions that did not answer (their instances are not shown).",
                len(health.missingPartitions),
            )
        )
        families += cluster_families(health, timeline, diagnosis, history)
    return Response(exposition(request.app.state.metrics, families), media_type=CONTENT_TYPE_LATEST)
