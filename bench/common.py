"""Pieces every benchmark uses: a free loopback port and the runners of a synthetic cluster."""

from __future__ import annotations

import socket
from typing import Any

from shared.wire import FlightEntry, Phase, RunnerRef

__all__ = ["free_port", "runner_ref", "token_entry"]


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


def token_entry(seq: int, **attrs: Any) -> FlightEntry:
    """A `decode_stream` entry of one generated token, `seq` milliseconds into the day."""
    return FlightEntry(
        seq=seq,
        at=f"2026-11-21T{(seq // 3_600_000) % 24:02d}:{(seq // 60_000) % 60:02d}:"
        f"{(seq // 1000) % 60:02d}.{seq % 1000:03d}000Z",
        phase=Phase.DECODE_STREAM,
        event="token",
        taskId="task-1",
        commandId="cmpl-1",
        attrs={"step": seq, **attrs},
    )
