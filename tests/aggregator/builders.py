"""Events for aggregator tests: a 2-rank instance and its telemetry."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta

from prometheus_client.core import Metric

from rankscope.services.aggregator.answers import history
from rankscope.services.aggregator.core import Core
from rankscope.services.aggregator.diagnosis import Incident, Thresholds, diagnose
from rankscope.services.aggregator.silence import Silence
from rankscope.services.aggregator.views import ClusterState
from rankscope.services.gateway.metrics import cluster_families
from rankscope.shared.partitions import Partition, partition_of
from rankscope.shared.subjects import token
from rankscope.shared.timestamps import format_ts
from rankscope.shared.wire import (
    AggregatorHealth,
    ClusterTimeline,
    Diagnosis,
    FlightEntry,
    InstanceCreated,
    Phase,
    PhaseEntries,
    RunnerAssignment,
    RunnerRef,
    RunnerStatusChanged,
    RunnerStatusKind,
)

T0 = datetime(2026, 11, 21, 12, 0, 0, tzinfo=UTC)


def at(seconds: float) -> str:
    """A wire timestamp `seconds` after T0."""
    return format_ts(T0 + timedelta(seconds=seconds))


def rank(index: int, instance: str = "i", world: int = 2) -> RunnerRef:
    """Rank `index` of `instance`, on node `node-<index>`."""
    return RunnerRef(
        runnerId=f"{instance}-r{index}",
        nodeId=f"node-{index}",
        instanceId=instance,
        modelId="tiny",
        deviceRank=index,
        worldSize=world,
    )


def placed(
    instance: str = "i", world: int = 2, layers: int = 8, split: Sequence[int] = ()
) -> InstanceCreated:
    """An instance of `world` ranks splitting `layers` evenly, or holding `split[r]` layers
    each."""
    held = list(split) or [layers // world] * world
    starts = [sum(held[:r]) for r in range(len(held))]
    return InstanceCreated(
        at=at(0),
        instanceId=instance,
        runnerSpecId="spec",
        modelId="tiny",
        assignments=[
            RunnerAssignment(
                runnerId=f"{instance}-r{r}",
                nodeId=f"node-{r}",
                deviceRank=r,
                worldSize=len(held),
                startLayer=starts[r],
                endLayer=starts[r] + held[r],
                nLayers=sum(held) if split else layers,
                host="127.0.0.1",
                port=50000 + r,
            )
            for r in range(len(held))
        ],
    )


def entries(
    ref: RunnerRef, *items: tuple[int, float, Phase, int | None], task: str | None = "t1"
) -> PhaseEntries:
    """A batch of (seq, seconds after T0, phase, step) entries."""
    return PhaseEntries(
        runner=ref,
        entries=[
            FlightEntry(
                seq=seq,
                at=at(t),
                phase=phase,
                event="e",
                attrs={} if step is None else {"step": step},
                taskId=None if phase is Phase.IDLE else task,
            )
            for seq, t, phase, step in items
        ],
    )


def status(
    ref: RunnerRef, seq: int, kind: RunnerStatusKind, alive: bool = True, detail: str | None = None
) -> RunnerStatusChanged:
    """A status change."""
    return RunnerStatusChanged(
        runner=ref, seq=seq, at=at(seq), statusKind=kind, processAlive=alive, pid=100, detail=detail
    )


def instances_by_partition(count: int, per: int) -> dict[int, list[str]]:
    """`per` instance ids of each of `count` partitions, of more than one alphabet."""
    found: dict[int, list[str]] = {p: [] for p in range(count)}
    for n in range(1000):
        name = f"llm.{n} ü*"
        owner = partition_of(token(name), count)
        if len(found[owner]) < per:
            found[owner].append(name)
    return found


def judged(
    state: ClusterState,
    now: float,
    incidents: dict[str, Incident],
    thresholds: Thresholds,
    unsettled: dict[str, float] | None = None,
) -> dict[str, Incident]:
    """The diagnosis of `state` at `now` on the aggregator's clock (the wall clock `now -
    1000` seconds after T0), every instance placed at 1000."""
    return diagnose(
        state,
        now=now,
        wall=at(now - 1000),
        incidents=incidents,
        placed_at=lambda _: 1000.0,
        thresholds=thresholds,
        unsettled=unsettled,
    )


def core_of(
    state: ClusterState, thresholds: Thresholds, placed_at: Mapping[str, float] | None = None
) -> Core:
    """The judging core of `state`, one partition, probes every 2 s (1 s deadline), the
    heartbeat TTL 10 s."""
    return Core(
        state,
        thresholds,
        placed_at=placed_at or {},
        partition=Partition(),
        silence=Silence(ttl_s=10.0, probe_interval=2.0, probe_timeout=1.0),
        placed_elsewhere={},
    )


def metric_families(state: ClusterState) -> list[Metric]:
    """The Prometheus families of `state` alone: a ready aggregator, no timeline or
    finding, every runner's history."""
    return cluster_families(
        AggregatorHealth(ready=True, partition="0"),
        ClusterTimeline(generatedAt=at(0), localNodeId="node-0"),
        Diagnosis(generatedAt=at(0)),
        history(state, Thresholds()),
    )
