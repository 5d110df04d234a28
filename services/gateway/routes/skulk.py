"""Skulk's diagnostics routes, so its dashboard and scripts work against rankscope
unchanged: the cross-rank timeline where Skulk serves it, each node's and the whole
cluster's diagnostics bundles, and the tracing switch."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Literal

import msgspec
from fastapi import APIRouter, Depends, Request

from rankscope.services.gateway.bodies import strict
from rankscope.services.gateway.bus import Bus, BusError
from rankscope.services.gateway.deps import Nats, reader, writer
from rankscope.services.gateway.responses import Json, fail, schema_ref
from rankscope.services.gateway.routes.cluster import Filters, timeline
from rankscope.services.gateway.skulk import node_bundle
from rankscope.shared.timestamps import now
from rankscope.shared.views import INSTANCES, PLACEMENT
from rankscope.shared.wire import (
    ClusterTimeline,
    InstanceState,
    PlacementQuery,
    PlacementRunnerDiagnostics,
    TaskStatus,
    decode,
)
from rankscope.shared.wire.skulk import (
    ClusterDiagnostics,
    ClusterNodeDiagnostics,
    DiagnosticCaptureRequest,
    DiagnosticCaptureResponse,
    DiagnosticProcessSample,
    RunnerTaskCancelRequest,
    RunnerTaskCancelResponse,
    SkulkNodeDiagnostics,
)

CancelStatus = Literal["cancel_requested", "already_cancelled", "already_completed"]
TASK_STATUSES = frozenset(TaskStatus)

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
        nats.query(INSTANCES),
        nats.query(PLACEMENT, PlacementQuery(localNodeId=node_id)),
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
    placed: list[PlacementRunnerDiagnostics] = await nats.ask(PLACEMENT)
    beating = await nats.values(nats.layout.nodes_bucket.bucket)
    expected = sorted(set(beating) | {p.nodeId for p in placed})
    found = await asyncio.gather(*(_bundle(nats, n) for n in expected), return_exceptions=True)
    nodes = [
        ClusterNodeDiagnostics(nodeId=node_id, ok=True, diagnostics=bundle)
        if isinstance(bundle, SkulkNodeDiagnostics)
        else ClusterNodeDiagnostics(nodeId=node_id, ok=False, error=_why(bundle))
        for node_id, bundle in zip(expected, found, strict=True)
    ]
    return Json(ClusterDiagnostics(generatedAt=now(), localNodeId=nats.local_node, nodes=nodes))


@router.post(
    "/v1/diagnostics/cluster/{nodeId}/runners/{runnerId}/cancel",
    response_class=Json,
    dependencies=[Depends(writer)],
    openapi_extra={"requestBody": schema_ref(RunnerTaskCancelRequest)},
    responses={200: schema_ref(RunnerTaskCancelResponse)},
)
async def cancel_runner_task(
    nodeId: str,  # noqa: N803 - Skulk's names
    runnerId: str,  # noqa: N803
    nats: Nats,
    body: Annotated[bytes, Depends(_body)],
) -> Json:
    """Stop a task of a runner (every rank of its instance stops it, as a chat's cancel
    does); what became of it, if it had ended already."""
    task_id = strict(body, RunnerTaskCancelRequest).taskId
    live = next((r for r in (await nats.node(nodeId)).runners if r.runnerId == runnerId), None)
    if live is None:
        raise fail(404, f"node {nodeId!r} supervises no runner {runnerId!r}")
    placed = decode(
        await nats.query(PLACEMENT, PlacementQuery(runnerId=runnerId)), PlacementRunnerDiagnostics
    )
    known = next((t for t in placed.tasks if t.taskId == task_id), None)
    if live.activeTaskId != task_id and known is None:
        raise fail(404, f"runner {runnerId!r} knows no task {task_id!r}")
    ended = TaskStatus(known.taskStatus) if known and known.taskStatus in TASK_STATUSES else None
    if ended is TaskStatus.CANCELLED:
        status: CancelStatus = "already_cancelled"
        message = f"task {task_id!r} was cancelled already"
    elif ended is not None and ended.is_final and live.activeTaskId != task_id:
        status, message = "already_completed", f"task {task_id!r} ended: {ended.value}"
    else:
        await nats.cancel(live.instanceId, task_id)
        status = "cancel_requested"
        message = f"every rank of {live.instanceId!r} was asked to stop task {task_id!r}"
    answer = RunnerTaskCancelResponse(
        nodeId=nodeId, runnerId=runnerId, taskId=task_id, status=status, message=message
    )
    return Json(answer)


@router.post(
    "/v1/diagnostics/cluster/{nodeId}/capture",
    response_class=Json,
    dependencies=[Depends(writer)],  # it signals the node's runners: not a read
    openapi_extra={"requestBody": schema_ref(DiagnosticCaptureRequest)},
    responses={200: schema_ref(DiagnosticCaptureResponse)},
)
async def capture(
    nodeId: str,  # noqa: N803 - Skulk's name
    nats: Nats,
    http: Request,
    body: Annotated[bytes, Depends(_body)],
) -> Json:
    """A node's bundle, the runner asked for (by id or by a task it runs) and, unless
    told not to, every runner's Python stacks at the start and the end of the sample
    duration (or the matched runner's alone): where each thread stood, and whether it
    moved. One capture of a node at a time: another meanwhile is a 429."""
    asked = strict(body or b"{}", DiagnosticCaptureRequest)
    capturing: set[str] = http.app.state.capturing
    if nodeId in capturing:
        raise fail(429, f"a capture of node {nodeId!r} is under way; ask again once it is done")
    capturing.add(nodeId)
    try:
        return await _capture(nodeId, nats, asked)
    finally:
        capturing.discard(nodeId)


async def _capture(node_id: str, nats: Bus, asked: DiagnosticCaptureRequest) -> Json:
    """The capture itself (see `capture`)."""
    bundle = await _bundle(nats, node_id)
    warnings: list[str] = []
    matched = next(
        (
            r
            for r in bundle.supervisorRunners
            if r.runnerId == asked.runnerId
            or (asked.taskId is not None and r.activeTaskId == asked.taskId)
        ),
        None,
    )
    if (asked.runnerId or asked.taskId) and matched is None:
        warnings.append(
            f"no runner of node {node_id!r} matches runnerId {asked.runnerId!r} or taskId "
            f"{asked.taskId!r}: stacks of every runner instead"
        )
    samples: list[DiagnosticProcessSample] = []
    if asked.includeProcessSamples:
        wanted = [matched.runnerId] if matched else [r.runnerId for r in bundle.supervisorRunners]
        samples += await _stacks(nats, node_id, wanted, "at the start")
        await asyncio.sleep(asked.sampleDurationSeconds)
        samples += await _stacks(nats, node_id, wanted, f"after {asked.sampleDurationSeconds:g}s")
    answer = DiagnosticCaptureResponse(
        generatedAt=now(),
        nodeId=node_id,
        nodeDiagnostics=bundle,
        runner=matched,
        flightRecorder=matched.flightRecorder if matched else [],
        mlxMemory=matched.lastMlxMemory if matched else None,
        processSamples=samples,
        warnings=warnings,
    )
    return Json(answer)


async def _stacks(
    nats: Bus, node_id: str, runner_ids: list[str], when: str
) -> list[DiagnosticProcessSample]:
    """One capture of the runners' stacks, a sample each."""
    started = time.monotonic()
    captured = await nats.evidence(node_id, runner_ids)
    took = round(time.monotonic() - started, 3)
    return [
        DiagnosticProcessSample(
            name=f"stacks of {runner.runnerId} {when}",
            command=["kill", "-USR1", str(runner.pid)],  # faulthandler writes every thread
            ok=runner.stack is not None,
            durationSeconds=took,
            stdout=runner.stack,
            error=None if runner.stack else f"no stack: the process is {runner.process.value}",
        )
        for runner in captured.runners
    ]


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
