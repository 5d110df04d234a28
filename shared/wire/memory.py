"""MLX memory snapshots (seed 001 `MlxMemorySnapshot`, `Memory`), and each rank's memory
over a span of time (`ClusterMemory`)."""

from __future__ import annotations

from rankscope.shared.wire.base import CamelStruct

__all__ = ["ClusterMemory", "Memory", "MemoryPoint", "MemorySeries", "MlxMemorySnapshot"]


class Memory(CamelStruct, kw_only=True, frozen=True):
    """An amount of memory."""

    inBytes: int


class MlxMemorySnapshot(CamelStruct, kw_only=True, frozen=True):
    """MLX allocator figures of one runner at one instant.

    `wiredLimit` is known only once the runner has set it: MLX has no getter for it.
    """

    generatedAt: str
    active: Memory | None = None
    cache: Memory | None = None
    peak: Memory | None = None
    wiredLimit: Memory | None = None
    source: str


class MemoryPoint(CamelStruct, kw_only=True, frozen=True):
    """A rank's MLX memory at `at`, in bytes (the sample of its time bucket with the most
    active memory)."""

    at: str
    active: int | None = None
    peak: int | None = None
    cache: int | None = None


class MemorySeries(CamelStruct, kw_only=True, frozen=True):
    """One rank's memory samples over the span asked for, oldest first."""

    runnerId: str
    nodeId: str
    instanceId: str
    deviceRank: int
    samples: list[MemoryPoint] = []


class ClusterMemory(CamelStruct, kw_only=True, frozen=True):
    """Every rank's MLX memory over a span of time, read from the stored samples."""

    generatedAt: str
    since: str
    until: str
    runners: list[MemorySeries] = []
