"""MLX allocator snapshots of this process."""

from __future__ import annotations

import mlx.core as mx

from rankscope.shared.timestamps import now
from rankscope.shared.wire import Memory, MlxMemorySnapshot

__all__ = ["snapshot"]


def snapshot() -> MlxMemorySnapshot:
    """Active, cache and peak bytes now. `wiredLimit` stays unknown: runners do not set
    one, and MLX has no getter for it."""
    return MlxMemorySnapshot(
        generatedAt=now(),
        active=Memory(inBytes=mx.get_active_memory()),
        cache=Memory(inBytes=mx.get_cache_memory()),
        peak=Memory(inBytes=mx.get_peak_memory()),
        source="mlx.core",
    )
