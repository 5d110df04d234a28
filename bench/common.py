"""Pieces every benchmark uses: a free loopback port and the runners of a synthetic cluster."""

from __future__ import annotations

import socket

from shared.wire import RunnerRef

__all__ = ["free_port", "runner_ref"]


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def runner_ref(index: int) -> RunnerRef:
    """Runner `index` of a synthetic cluster of 8-rank instances, one node per runner."""
    return RunnerRef(
        runnerId=f"i{index // 8}-r{index % 8}",
        nodeId=f"node-{index}",
        instanceId=f"i{index // 8}",
        modelId="m",
        deviceRank=index % 8,
        worldSize=8,
    )
