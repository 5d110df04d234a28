"""MLX memory snapshots (seed 001 `MlxMemorySnapshot`, `Memory`), each rank's memory over
a span of time (`ClusterMemory`), and each rank's pace: its work and its wait per step
(`StepPace`, `ClusterPace`)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from rankscope.shared.wire.base import CamelStruct

__all__ = [
    "MAX_SAMPLED_STEPS",
    "ClusterMemory",
    "ClusterPace",
    "Memory",
    "MemoryPoint",
    "MemorySeries",
    "MlxMemorySnapshot",
    "PacePoint",
    "PaceSeries",
    "SampledStep",
    "StepPace",
]


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


MAX_SAMPLED_STEPS = 256
"""Sampled steps one pace sample may list (a rank samples at most ten a second)."""


class SampledStep(msgspec.Struct, array_like=True, frozen=True):
    """One sampled step of a rank, as `[step, workSeconds, waitSeconds, gapSeconds]`:
    `step` names it alike on every rank (the number of the first collective it waits on,
    in the world group), so ranks are compared step by step; `gapSeconds` is the time
    from the end of its previous step to the start of this one (loading data, logging,
    anything the program does between steps): the step's whole time is the three."""

    step: Annotated[int, msgspec.Meta(ge=0)]
    workSeconds: Annotated[float, msgspec.Meta(ge=0)]
    waitSeconds: Annotated[float, msgspec.Meta(ge=0)]
    gapSeconds: Annotated[float, msgspec.Meta(ge=0)] = 0.0


class StepPace(CamelStruct, kw_only=True, frozen=True):
    """What a rank's sampled steps took since its previous sample: `workSeconds` computing
    its own part with its inputs at hand, `waitSeconds` waiting for its inputs (a peer's
    transfer, a collective's other ranks). Steps are sampled (one every few milliseconds
    at most), so the figures are sums over `steps` steps, not over every step."""

    steps: Annotated[int, msgspec.Meta(ge=0)]
    workSeconds: Annotated[float, msgspec.Meta(ge=0)]
    waitSeconds: Annotated[float, msgspec.Meta(ge=0)]
    waitCpuSeconds: Annotated[float, msgspec.Meta(ge=0)] | None = None
    """CPU time the rank's process took during those waits, where it says (a rank waits
    spinning: one stopped or starved while it waits takes less CPU in its wait than its
    peers in theirs)."""
    sampled: Annotated[list[SampledStep], msgspec.Meta(max_length=MAX_SAMPLED_STEPS)] = []
    """Each sampled step on its own, where the rank samples the steps its peers sample
    (a recorded rank does): the time the job lost waiting for a rank is read by comparing
    ranks on the same step."""


class PacePoint(CamelStruct, kw_only=True, frozen=True):
    """A rank's pace over one slice of time: sampled steps, and per step the mean work and
    wait in milliseconds."""

    at: str
    steps: int
    workMs: float
    waitMs: float


class PaceSeries(CamelStruct, kw_only=True, frozen=True):
    """One rank's pace over the span asked for, oldest first (slices without steps left
    out)."""

    runnerId: str
    nodeId: str
    instanceId: str
    deviceRank: int
    points: list[PacePoint] = []


class ClusterPace(CamelStruct, kw_only=True, frozen=True):
    """Every rank's work and wait per step over a span of time, read from the stored
    samples: the rank out of line with its peers shows at a glance."""

    generatedAt: str
    since: str
    until: str
    runners: list[PaceSeries] = []
