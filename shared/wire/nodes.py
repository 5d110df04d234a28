"""Node inventory entries, kept alive by each agent's heartbeat in `rankscope_nodes`."""

from __future__ import annotations

from shared.wire.base import CamelStruct

__all__ = ["NodeInfo"]


class NodeInfo(CamelStruct, kw_only=True, frozen=True):
    """One node as its agent last described it."""

    nodeId: str
    friendlyName: str
    address: str
    memoryTotalBytes: int
    memoryAvailableBytes: int
    labels: list[str] = []
    nodepool: str = ""
    agentVersion: str = ""
    lastHeartbeat: str
