"""Decode what the services consume from the bus and refuse nonsense, with a reason per kind."""

from __future__ import annotations

import functools

from shared.subjects import IdTooLongError, Subjects, TelemetryKind, token
from shared.wire import (
    InstanceCreated,
    MemorySampled,
    PhaseEntries,
    PlacementEvent,
    RunnerStatusChanged,
    RunnerTelemetry,
    TaskEvent,
    WireError,
    decode,
)

__all__ = ["BadInputError", "parse_placement", "parse_task", "parse_telemetry"]


class BadInputError(ValueError):
    """A message that cannot be applied; `kind` groups it for counting and logging."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


def _named(*ids: str) -> None:
    """Refuse ids that cannot name a subject (the aggregator publishes and probes by them)."""
    try:
        for value in ids:
            token(value)
    except IdTooLongError as exc:
        raise BadInputError("id_too_long", str(exc)) from None
    except ValueError as exc:
        raise BadInputError("id_empty", str(exc)) from None


_KIND: dict[type, TelemetryKind] = {
    PhaseEntries: "phase",
    MemorySampled: "memory",
    RunnerStatusChanged: "status",
}


@functools.lru_cache(maxsize=1 << 16)
def _subject(
    subjects: Subjects, node_id: str, instance_id: str, rank: int, kind: TelemetryKind
) -> str:
    return subjects.runner(node_id, instance_id, rank, kind)


def parse_telemetry(data: bytes, subject: str, subjects: Subjects) -> RunnerTelemetry:
    """A runner telemetry message received on `subject`.

    Raises:
        BadInputError: it does not decode, names a rank outside its world, or names a
            runner other than the one its subject does (a node's user may publish only
            its own node's subjects, so a payload naming another node's runner is a lie).
    """
    try:
        event: RunnerTelemetry = decode(data, RunnerTelemetry)
    except WireError as exc:
        raise BadInputError("telemetry_undecodable", str(exc)) from None
    if event.runner.deviceRank >= event.runner.worldSize:
        raise BadInputError(
            "telemetry_rank_outside_world",
            f"deviceRank {event.runner.deviceRank} >= worldSize {event.runner.worldSize}",
        )
    ref = event.runner
    _named(ref.nodeId, ref.instanceId, ref.runnerId)
    named = _subject(subjects, ref.nodeId, ref.instanceId, ref.deviceRank, _KIND[type(event)])
    if subject != named:
        raise BadInputError(
            "telemetry_identity", f"received on {subject!r}, but its runner's subject is {named!r}"
        )
    return event


def parse_placement(data: bytes) -> PlacementEvent:
    """A placement event.

    Raises:
        BadInputError: it does not decode, or its shards are not a partition of the layers.
    """
    try:
        event: PlacementEvent = decode(data, PlacementEvent)
    except WireError as exc:
        raise BadInputError("placement_undecodable", str(exc)) from None
    _named(event.instanceId)
    if isinstance(event, InstanceCreated):
        _named(*(rank.nodeId for rank in event.assignments))
        if not event.assignments:
            raise BadInputError("placement_nonsense", "an instance with no ranks")
        for rank in event.assignments:
            if rank.endLayer <= rank.startLayer or rank.endLayer > rank.nLayers:
                raise BadInputError(
                    "placement_nonsense",
                    f"rank {rank.deviceRank} has layers [{rank.startLayer}, "
                    f"{rank.endLayer}) of {rank.nLayers}",
                )
            if rank.deviceRank >= rank.worldSize:
                raise BadInputError(
                    "placement_nonsense",
                    f"deviceRank {rank.deviceRank} >= worldSize {rank.worldSize}",
                )
    return event


def parse_task(data: bytes) -> TaskEvent:
    """A task or task status event.

    Raises:
        BadInputError: it does not decode.
    """
    try:
        event: TaskEvent = decode(data, TaskEvent)
    except WireError as exc:
        raise BadInputError("task_undecodable", str(exc)) from None
    _named(event.instanceId)
    return event
