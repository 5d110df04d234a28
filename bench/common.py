"""Pieces every benchmark uses: a free loopback port and the runners of a synthetic cluster,
with the placements that make them (telemetry counts only for a runner a placement made)."""

from __future__ import annotations

import socket
from typing import Any

from nats.js import JetStreamContext

from rankscope.shared.jetstream import Layout
from rankscope.shared.wire import (
    FlightEntry,
    InstanceCreated,
    Phase,
    RunnerAssignment,
    RunnerRef,
    encode,
)

__all__ = ["free_port", "placements", "publish_placements", "runner_ref", "token_entry"]

RANKS = 8
"""Ranks of each synthetic instance."""


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def runner_ref(index: int) -> RunnerRef:
    """Runner `index` of a synthetic cluster of 8-rank instances, one node per runner."""
    return RunnerRef(
        runnerId=f"i{index // RANKS}-r{index % RANKS}",
        nodeId=f"node-{index}",
        instanceId=f"i{index // RANKS}",
        modelId="m",
        deviceRank=index % RANKS,
        worldSize=RANKS,
    )


def placements(runners: int) -> list[InstanceCreated]:
    """The placements that make runners 0 to `runners` - 1 of `runner_ref`."""
    return [
        InstanceCreated(
            at="2026-11-21T00:00:00.000000Z",
            instanceId=f"i{instance}",
            runnerSpecId="spec",
            modelId="m",
            assignments=[
                RunnerAssignment(
                    runnerId=ref.runnerId,
                    nodeId=ref.nodeId,
                    deviceRank=ref.deviceRank,
                    worldSize=RANKS,
                    startLayer=ref.deviceRank,
                    endLayer=ref.deviceRank + 1,
                    nLayers=RANKS,
                    host="127.0.0.1",
                    port=50_000 + ref.deviceRank,
                )
                for ref in map(runner_ref, range(instance * RANKS, (instance + 1) * RANKS))
            ],
        )
        for instance in range((runners + RANKS - 1) // RANKS)
    ]


async def publish_placements(js: JetStreamContext, layout: Layout, runners: int) -> None:
    """Store the placements of runners 0 to `runners` - 1, before any of their telemetry."""
    for created in placements(runners):
        await js.publish(layout.subjects.placement(created.instanceId), encode(created))


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
