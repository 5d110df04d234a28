"""Event-sourced placement details per runner assignment (seed 000)."""

from __future__ import annotations

import msgspec

from rankscope.shared.wire.base import CamelStruct

__all__ = ["PlacementRunnerDiagnostics", "PlacementTaskDiagnostics"]


class PlacementTaskDiagnostics(CamelStruct, kw_only=True, frozen=True):
    """A task that concerns one runner assignment."""

    taskId: str
    taskKind: str
    taskStatus: str
    instanceId: str
    commandId: str | None = None
    runnerId: str | None = None
    modelId: str | None = None


class PlacementRunnerDiagnostics(CamelStruct, kw_only=True, frozen=True):
    """Placement of one runner: its node, rank and layer shard `[startLayer, endLayer)`."""

    runnerId: str
    nodeId: str
    friendlyName: str | None = None
    statusKind: str | None = None
    deviceRank: int
    worldSize: int
    startLayer: int
    endLayer: int
    nLayers: int
    isLocal: bool
    isMaster: bool
    tasks: list[PlacementTaskDiagnostics] = []
    instanceId: str | msgspec.UnsetType = msgspec.UNSET
    """The instance (job) the runner is a rank of (rankscope's, beyond the seed: left
    out where unknown)."""
    pid: int | msgspec.UnsetType | None = msgspec.UNSET
    """Its process id on its node, as its last status said (rankscope's, beyond the seed:
    null until it said one)."""

    def as_seed(self) -> PlacementRunnerDiagnostics:
        """The row as seed 000 has it, rankscope's own fields left out (for Skulk)."""
        return msgspec.structs.replace(self, instanceId=msgspec.UNSET, pid=msgspec.UNSET)
