"""MLX memory snapshots (seed 001 `MlxMemorySnapshot`, `Memory`)."""

from __future__ import annotations

from shared.wire.base import CamelStruct

__all__ = ["Memory", "MlxMemorySnapshot"]


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
