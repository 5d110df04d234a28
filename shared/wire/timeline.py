"""The cross-rank `ClusterTimeline` view and its parts (seed 001)."""

from __future__ import annotations

import msgspec

from rankscope.shared.wire.base import CamelStruct
from rankscope.shared.wire.enums import Phase
from rankscope.shared.wire.memory import MlxMemorySnapshot

__all__ = [
    "AttrValue",
    "Attrs",
    "ClusterTimeline",
    "RunnerSynopsis",
    "TimelineEntry",
    "UnreachableNode",
]

AttrValue = str | int | float | bool | list[str]
"""A structured, low-cardinality diagnostic attribute value."""

Attrs = dict[str, AttrValue]


class TimelineEntry(CamelStruct, kw_only=True, frozen=True):
    """One flight-recorder entry of one runner, as shown in the merged timeline."""

    at: str
    nodeId: str
    runnerId: str
    deviceRank: int
    worldSize: int
    phase: Phase
    event: str
    detail: str | None = None
    attrs: Attrs = {}
    taskId: str | None = None
    commandId: str | None = None
    mlxMemory: MlxMemorySnapshot | None = None


class RunnerSynopsis(CamelStruct, kw_only=True, frozen=True):
    """Where one rank is right now."""

    nodeId: str
    runnerId: str
    instanceId: str
    modelId: str
    deviceRank: int
    worldSize: int
    pid: int | None = None
    processAlive: bool
    statusKind: str
    phase: Phase
    phaseDetail: str | None = None
    secondsInPhase: float
    lastProgressAt: str | None = None
    activeTaskId: str | None = None
    activeCommandId: str | None = None
    lastMlxMemory: MlxMemorySnapshot | None = None
    recorded: bool | msgspec.UnsetType = msgspec.UNSET
    """True for a rank of a program rankscope did not start (`rankscope record`): its
    entries tell collectives and steps, not a runner's phases (rankscope's, beyond the
    seed: left out for rankscope's own runners)."""


class UnreachableNode(CamelStruct, kw_only=True, frozen=True):
    """A peer node that could not be reached for this timeline, and why."""

    nodeId: str
    url: str | None = None
    error: str


class ClusterTimeline(CamelStruct, kw_only=True, frozen=True):
    """Every runner's synopsis plus every flight-recorder entry, merged and sorted by `at`."""

    generatedAt: str
    localNodeId: str
    masterNodeId: str | None = None
    runners: list[RunnerSynopsis] = []
    timeline: list[TimelineEntry] = []
    unreachableNodes: list[UnreachableNode] = []
