"""Skulk's diagnostics bundles made from what rankscope knows: an agent's live view of its
node and the placements. Pure: the routes fetch, this shapes."""

from __future__ import annotations

from collections.abc import Sequence

from rankscope.shared.wire import InstanceState, NodeDiagnostics, Phase, PlacementRunnerDiagnostics
from rankscope.shared.wire.node_diagnostics import RunnerSupervisorDiagnostics
from rankscope.shared.wire.skulk import (
    InstancePlacementDiagnostics,
    NodeRuntimeDiagnostics,
    RunnerDiagnosticContext,
    RunnerFlightRecorderEntry,
    SkulkNodeDiagnostics,
    SkulkRunnerDiagnostics,
)

__all__ = ["node_bundle"]


def _runner(live: RunnerSupervisorDiagnostics, generated: str) -> SkulkRunnerDiagnostics:
    context = RunnerDiagnosticContext(
        nodeId=live.nodeId,
        runnerId=live.runnerId,
        pid=live.pid,
        instanceId=live.instanceId,
        modelId=live.modelId,
        rank=live.deviceRank,
        worldSize=live.worldSize,
        startLayer=live.startLayer,
        endLayer=live.endLayer,
        nLayers=live.nLayers,
    )
    status_since = live.statusSince or generated
    return SkulkRunnerDiagnostics(
        runnerId=live.runnerId,
        instanceId=live.instanceId,
        nodeId=live.nodeId,
        modelId=live.modelId,
        deviceRank=live.deviceRank,
        worldSize=live.worldSize,
        startLayer=live.startLayer,
        endLayer=live.endLayer,
        nLayers=live.nLayers,
        pid=live.pid,
        processAlive=live.processAlive,
        exitCode=live.exitCode,
        statusKind=live.statusKind,
        statusSince=status_since,
        secondsInStatus=live.secondsInStatus,
        phase=live.phase or Phase.CREATED,  # no entry yet: just created
        phaseStartedAt=live.phaseStartedAt or status_since,
        secondsInPhase=live.secondsInPhase,
        lastProgressAt=live.lastProgressAt,
        activeTaskId=live.activeTaskId,
        activeCommandId=live.activeCommandId,
        phaseDetail=live.phaseDetail,
        lastMlxMemory=live.lastMlxMemory,
        flightRecorder=[
            RunnerFlightRecorderEntry(
                at=e.at,
                phase=e.phase,
                event=e.event,
                detail=e.detail,
                attrs=e.attrs,
                context=context,
                taskId=e.taskId,
                commandId=e.commandId,
                mlxMemory=e.mlxMemory,
            )
            for e in live.entries
        ],
        completedTaskCount=live.completedTaskCount,
    )


def _placements(
    node_id: str, instances: Sequence[InstanceState], placed: Sequence[PlacementRunnerDiagnostics]
) -> list[InstancePlacementDiagnostics]:
    by_runner = {p.runnerId: p for p in placed}
    return [
        InstancePlacementDiagnostics(
            instanceId=instance.instanceId,
            modelId=instance.modelId,
            localNodeIsPlacementNode=any(r.nodeId == node_id for r in instance.ranks),
            placementNodeIds=sorted({r.nodeId for r in instance.ranks}),
            runners=[
                by_runner[r.runnerId].as_seed() for r in instance.ranks if r.runnerId in by_runner
            ],
        )
        for instance in instances
    ]


def node_bundle(
    live: NodeDiagnostics,
    instances: Sequence[InstanceState],
    placed: Sequence[PlacementRunnerDiagnostics],
    generated: str,
) -> SkulkNodeDiagnostics:
    """Skulk's bundle of one node: `live` is its agent's answer, `placed` every rank's
    placement as seen from that node (`isLocal` relative to it)."""
    return SkulkNodeDiagnostics(
        generatedAt=generated,
        runtime=NodeRuntimeDiagnostics(
            nodeId=live.nodeId,
            hostname=live.hostname,
            friendlyName=live.friendlyName,
            cwd=live.cwd,
            configPath="",
            skulkVersion=live.agentVersion,
            pythonUnbuffered=live.pythonUnbuffered,
            structuredLoggingConfigured=live.structuredLogging,
        ),
        supervisorRunners=[_runner(r, generated) for r in live.runners],
        placements=_placements(live.nodeId, instances, placed),
    )
