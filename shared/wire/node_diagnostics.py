"""What an agent answers on `rankscope.node.<nodeId>.diagnostics`: each supervisor's live
view of its runner, with the last flight-recorder entries."""

from __future__ import annotations

from shared.wire.base import CamelStruct
from shared.wire.enums import Phase
from shared.wire.memory import MlxMemorySnapshot
from shared.wire.timeline import TimelineEntry

__all__ = ["NodeDiagnostics", "RunnerSupervisorDiagnostics"]


class RunnerSupervisorDiagnostics(CamelStruct, kw_only=True, frozen=True):
    """One runner as its supervisor sees it now."""

    runnerId: str
    nodeId: str
    instanceId: str
    modelId: str
    deviceRank: int
    worldSize: int
    startLayer: int
    endLayer: int
    nLayers: int
    pid: int | None = None
    processAlive: bool
    statusKind: str
    phase: Phase | None = None
    phaseDetail: str | None = None
    secondsInPhase: float = 0.0
    lastProgressAt: str | None = None
    activeTaskId: str | None = None
    activeCommandId: str | None = None
    lastMlxMemory: MlxMemorySnapshot | None = None
    restarts: int = 0
    droppedEntries: int = 0
    acknowledgedSeq: int | None = None
    """The newest telemetry seq of this runner that JetStream acknowledged."""
    entries: list[TimelineEntry] = []


class NodeDiagnostics(CamelStruct, kw_only=True, frozen=True):
    """One node's agent and every runner it supervises."""

    nodeId: str
    friendlyName: str
    address: str
    generatedAt: str
    runners: list[RunnerSupervisorDiagnostics] = []
