"""What an agent answers on `rankscope.node.<nodeId>.diagnostics` (each supervisor's live
view of its runner, with the last flight-recorder entries) and on
`rankscope.node.<nodeId>.evidence` (the stacks and memory of the runners asked for)."""

from __future__ import annotations

from enum import StrEnum

from rankscope.shared.wire.base import CamelStruct
from rankscope.shared.wire.enums import Phase
from rankscope.shared.wire.memory import MlxMemorySnapshot
from rankscope.shared.wire.timeline import TimelineEntry

__all__ = [
    "EvidenceRequest",
    "ModelShapeAnswer",
    "ModelShapeRequest",
    "NodeDiagnostics",
    "NodeEvidence",
    "ProcessState",
    "RunnerEvidence",
    "RunnerSupervisorDiagnostics",
]


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
    exitCode: int | None = None
    statusKind: str
    statusSince: str | None = None
    secondsInStatus: float = 0.0
    phase: Phase | None = None
    phaseStartedAt: str | None = None
    phaseDetail: str | None = None
    secondsInPhase: float = 0.0
    completedTaskCount: int = 0
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
    hostname: str = ""
    cwd: str = ""
    agentVersion: str = ""
    structuredLogging: bool = False
    """Whether the agent logs JSON lines."""
    pythonUnbuffered: bool = False


class EvidenceRequest(CamelStruct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The runners of one node whose evidence to capture now."""

    runnerIds: list[str]


class ModelShapeRequest(CamelStruct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Ask an agent to read a model's shape where it lives on its node."""

    modelPath: str


class ModelShapeAnswer(CamelStruct, kw_only=True, frozen=True):
    """A model's layer count and weight bytes as one node read them, or why it could not."""

    nodeId: str
    modelPath: str
    nLayers: int | None = None
    modelBytes: int | None = None
    kvSharedLayers: int = 0
    error: str | None = None
    """Why this node could not read it (another node may)."""
    unsupported: str | None = None
    """Why the model, read, cannot run as asked on any node (an architecture mlx-lm does
    not know or cannot split)."""


class ProcessState(StrEnum):
    """What the kernel says a runner process is doing."""

    RUNNING = "running"
    SLEEPING = "sleeping"
    """Waiting on something (a socket of a collective, a lock, a timer)."""
    DISK_WAIT = "disk_wait"
    STOPPED = "stopped"
    """Stopped by a signal (SIGSTOP) or a debugger: it runs no code, not even to dump."""
    ZOMBIE = "zombie"
    GONE = "gone"
    UNKNOWN = "unknown"


class RunnerEvidence(CamelStruct, kw_only=True, frozen=True):
    """One runner as captured when a finding named it or its peers."""

    runnerId: str
    pid: int | None = None
    process: ProcessState
    stack: str | None = None
    """The Python stack of every thread, innermost call last, as `faulthandler` writes it:
    the line each thread is on, even inside a blocking collective."""
    mlxMemory: MlxMemorySnapshot | None = None
    capturedAt: str


class NodeEvidence(CamelStruct, kw_only=True, frozen=True):
    """What one agent captured of the runners asked for (those it supervises)."""

    nodeId: str
    runners: list[RunnerEvidence] = []
