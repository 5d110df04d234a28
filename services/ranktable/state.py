"""Event-sourced state of the rank-table service: placements from placement events,
readiness from runner status events. Pure reducers, applied in stream order."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from rankscope.shared.wire import (
    InstanceCreated,
    PlacementEvent,
    ReleaseCause,
    RunnerRef,
    RunnerStatusChanged,
    RunnerStatusKind,
)

__all__ = ["PlacementState", "Readiness", "apply_placement", "apply_status", "misplaced"]

_READY = frozenset({RunnerStatusKind.READY, RunnerStatusKind.RUNNING})


@dataclass(frozen=True, slots=True)
class PlacementState:
    """Live instances, placements made per instance, and pods preempted per spec."""

    instances: dict[str, InstanceCreated] = field(default_factory=dict)
    attempts: dict[str, int] = field(default_factory=dict)
    preempted_pods: dict[str, int] = field(default_factory=dict)
    last_seqs: dict[str, int] = field(default_factory=dict)
    """The last sequence applied of each stream (the placed instances', the recorded
    jobs')."""


def apply_placement(
    state: PlacementState, event: PlacementEvent, seq: int, stream: str = ""
) -> PlacementState:
    """Apply one placement event at sequence `seq` of `stream`; a sequence already applied
    changes nothing, so redelivery is harmless."""
    if seq <= state.last_seqs.get(stream, 0):
        return state
    last_seqs = state.last_seqs | {stream: seq}
    instances = dict(state.instances)
    if isinstance(event, InstanceCreated):
        instances[event.instanceId] = event
        attempts = state.attempts | {event.instanceId: event.attempt + 1}
        return replace(state, instances=instances, attempts=attempts, last_seqs=last_seqs)
    released = instances.pop(event.instanceId, None)
    preempted = state.preempted_pods
    if released is not None and event.cause is ReleaseCause.PREEMPTED:
        spec_id = released.runnerSpecId
        pods = len(released.assignments)
        preempted = preempted | {spec_id: preempted.get(spec_id, 0) + pods}
    return replace(state, instances=instances, preempted_pods=preempted, last_seqs=last_seqs)


def misplaced(state: PlacementState, ref: RunnerRef) -> str | None:
    """Why a live instance's runner `ref` names is not where `ref` says it runs (a node
    speaking for another node's runner), or None when it is, or is in no live instance."""
    instance = state.instances.get(ref.instanceId)
    ranks = instance.assignments if instance is not None else []
    placed = next((a for a in ranks if a.runnerId == ref.runnerId), None)
    if placed is None or (placed.nodeId, placed.deviceRank) == (ref.nodeId, ref.deviceRank):
        return None
    return (
        f"runner {ref.runnerId!r} is rank {placed.deviceRank} on node {placed.nodeId!r}; this "
        f"message says rank {ref.deviceRank} on node {ref.nodeId!r}"
    )


@dataclass(frozen=True, slots=True)
class Readiness:
    """Latest status per runner id, and since when each ready runner has been ready."""

    status: dict[str, RunnerStatusChanged] = field(default_factory=dict)
    ready_since: dict[str, str] = field(default_factory=dict)

    def is_ready(self, runner_id: str) -> bool:
        """Whether the runner last reported itself ready (or serving)."""
        latest = self.status.get(runner_id)
        return latest is not None and latest.processAlive and latest.statusKind in _READY


def apply_status(readiness: Readiness, event: RunnerStatusChanged) -> Readiness:
    """Apply one runner status event; older `seq`s than the latest known are ignored."""
    runner_id = event.runner.runnerId
    latest = readiness.status.get(runner_id)
    if latest is not None and event.seq <= latest.seq:
        return readiness
    status = readiness.status | {runner_id: event}
    since = dict(readiness.ready_since)
    if event.processAlive and event.statusKind in _READY:
        since.setdefault(runner_id, event.at)
    else:
        since.pop(runner_id, None)
    return Readiness(status=status, ready_since=since)
