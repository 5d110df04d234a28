"""Skulk's node and cluster diagnostics bundles (`skulk.shared.types.diagnostics`), so its
dashboard and scripts read rankscope's nodes unchanged. Built from what rankscope knows:
the agent's live view and the placements. Parts of Skulk that rankscope does not have
(its gossip data plane, media lanes, providers, Tailscale) are omitted where Skulk allows
it and zero where it requires them; rankscope has no master."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from rankscope.shared.wire.base import CamelStruct
from rankscope.shared.wire.enums import Phase
from rankscope.shared.wire.memory import MlxMemorySnapshot
from rankscope.shared.wire.placement import PlacementRunnerDiagnostics
from rankscope.shared.wire.timeline import Attrs

__all__ = [
    "ClusterDiagnostics",
    "ClusterNodeDiagnostics",
    "DiagnosticCaptureRequest",
    "DiagnosticCaptureResponse",
    "DiagnosticProcessSample",
    "InstancePlacementDiagnostics",
    "NodeResourceDiagnostics",
    "NodeRuntimeDiagnostics",
    "RunnerDiagnosticContext",
    "RunnerFlightRecorderEntry",
    "RunnerTaskCancelRequest",
    "RunnerTaskCancelResponse",
    "SkulkNodeDiagnostics",
    "SkulkRunnerDiagnostics",
]


class NodeRuntimeDiagnostics(CamelStruct, kw_only=True, frozen=True):
    """The node's agent: where it runs and how it is set up."""

    nodeId: str
    hostname: str
    friendlyName: str | None = None
    isMaster: bool = False
    masterNodeId: str | None = None
    cwd: str
    configPath: str
    """rankscope is configured by `RANKSCOPE_*` variables: empty, with no file."""
    configFileExists: bool = False
    skulkVersion: str
    """The rankscope agent's version."""
    skulkCommit: str = ""
    pythonUnbuffered: bool
    tracingEnabled: bool = True
    structuredLoggingConfigured: bool
    loggingIngestUrl: str | None = None


class NodeResourceDiagnostics(CamelStruct, kw_only=True, frozen=True):
    """Resource readings (every one optional in Skulk; rankscope reports its own in the
    node inventory and the runners' MLX memory)."""


class RunnerDiagnosticContext(CamelStruct, kw_only=True, frozen=True):
    """A runner's identity on each of its flight-recorder entries."""

    nodeId: str
    runnerId: str
    pid: int | None = None
    instanceId: str
    modelId: str
    rank: int
    worldSize: int
    startLayer: int
    endLayer: int
    nLayers: int


class RunnerFlightRecorderEntry(CamelStruct, kw_only=True, frozen=True):
    """One flight-recorder entry a supervisor keeps."""

    at: str
    phase: Phase
    event: str
    detail: str | None = None
    attrs: Attrs = {}
    context: RunnerDiagnosticContext
    taskId: str | None = None
    commandId: str | None = None
    mlxMemory: MlxMemorySnapshot | None = None


class SkulkRunnerDiagnostics(CamelStruct, kw_only=True, frozen=True):
    """One runner as its supervisor sees it (Skulk's `RunnerSupervisorDiagnostics`)."""

    runnerId: str
    instanceId: str
    nodeId: str
    modelId: str
    deviceRank: int
    worldSize: int
    startLayer: int
    endLayer: int
    nLayers: int
    pid: int | None = None
    processAlive: bool
    exitCode: int | None = None
    statusKind: str
    statusSince: str
    secondsInStatus: float
    phase: Phase
    phaseStartedAt: str
    secondsInPhase: float
    lastProgressAt: str | None = None
    activeTaskId: str | None = None
    activeCommandId: str | None = None
    phaseDetail: str | None = None
    lastMlxMemory: MlxMemorySnapshot | None = None
    flightRecorder: list[RunnerFlightRecorderEntry] = []
    completedTaskCount: int


class InstancePlacementDiagnostics(CamelStruct, kw_only=True, frozen=True):
    """Where one instance's ranks are, as seen from the answering node."""

    instanceId: str
    modelId: str
    masterNodeId: str | None = None
    masterIsPlacementNode: bool = False
    localNodeIsPlacementNode: bool
    placementNodeIds: list[str] = []
    runners: list[PlacementRunnerDiagnostics] = []
    warnings: list[str] = []


class SkulkNodeDiagnostics(CamelStruct, kw_only=True, frozen=True):
    """One node's bundle (Skulk's `NodeDiagnostics`)."""

    generatedAt: str
    runtime: NodeRuntimeDiagnostics
    resources: NodeResourceDiagnostics = NodeResourceDiagnostics()
    supervisorRunners: list[SkulkRunnerDiagnostics] = []
    placements: list[InstancePlacementDiagnostics] = []
    warnings: list[str] = []


class ClusterNodeDiagnostics(CamelStruct, kw_only=True, frozen=True):
    """One node's result in the cluster bundle: its diagnostics, or why not."""

    nodeId: str
    url: str | None = None
    ok: bool
    diagnostics: SkulkNodeDiagnostics | None = None
    error: str | None = None


class ClusterDiagnostics(CamelStruct, kw_only=True, frozen=True):
    """Every expected node's bundle, asked at once under one deadline (Skulk's
    `ClusterDiagnostics`)."""

    generatedAt: str
    localNodeId: str
    masterNodeId: str | None = None
    nodes: list[ClusterNodeDiagnostics] = []


class RunnerTaskCancelRequest(CamelStruct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Stop one task of one runner (its whole instance stops it)."""

    taskId: str


class RunnerTaskCancelResponse(CamelStruct, kw_only=True, frozen=True):
    """What became of a cancel request."""

    nodeId: str
    runnerId: str
    taskId: str
    status: Literal["cancel_requested", "already_cancelled", "already_completed"]
    message: str


class DiagnosticCaptureRequest(CamelStruct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """What to capture of one node: one runner (by id, or by a task it runs), or all."""

    runnerId: str | None = None
    taskId: str | None = None
    includeProcessSamples: bool = True
    sampleDurationSeconds: Annotated[float, msgspec.Meta(ge=1.0, le=10.0)] = 3.0


class DiagnosticProcessSample(CamelStruct, kw_only=True, frozen=True):
    """One capture of a runner's Python stacks (every thread, via `faulthandler`)."""

    name: str
    command: list[str]
    ok: bool
    exitCode: int | None = None
    durationSeconds: float
    stdout: str | None = None
    stderr: str | None = None
    error: str | None = None


class DiagnosticCaptureResponse(CamelStruct, kw_only=True, frozen=True):
    """A node's bundle with the runner asked for and its stacks at the start and the end
    of the sample duration."""

    generatedAt: str
    nodeId: str
    nodeDiagnostics: SkulkNodeDiagnostics
    runner: SkulkRunnerDiagnostics | None = None
    flightRecorder: list[RunnerFlightRecorderEntry] = []
    mlxMemory: MlxMemorySnapshot | None = None
    processSamples: list[DiagnosticProcessSample] = []
    warnings: list[str] = []
