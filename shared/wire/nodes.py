"""Node inventory entries, kept alive by each agent's heartbeat in `rankscope_nodes`."""

from __future__ import annotations

import msgspec

from rankscope.shared.timestamps import check_ts
from rankscope.shared.wire.base import CamelStruct

__all__ = ["NodeInfo"]


class NodeInfo(CamelStruct, kw_only=True, frozen=True):
    """One node as its agent last described it.

    `memoryAvailableBytes` is what rankscope runners may use: memory that is free, plus
    what the agent's own runners hold, so placement does not count a loaded shard twice.
    `address` is where peers reach this node (ring connections, rank tables).
    """

    nodeId: str
    friendlyName: str
    address: str
    memoryTotalBytes: int
    memoryAvailableBytes: int
    labels: list[str] = []
    nodepool: str = ""
    agentVersion: str = ""
    lastHeartbeat: str

    def __post_init__(self) -> None:
        if (fixed := check_ts(self.lastHeartbeat)) != self.lastHeartbeat:
            msgspec.structs.force_setattr(self, "lastHeartbeat", fixed)
