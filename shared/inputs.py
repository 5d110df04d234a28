"""Decode what the services consume from the bus and refuse nonsense, with a reason per kind."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from rankscope.shared.subjects import IdTooLongError, Subjects, TelemetryKind, token
from rankscope.shared.timestamps import micros, second_micros, stamp_micros
from rankscope.shared.wire import (
    FlightRecord,
    InstanceCreated,
    MemorySampled,
    PhaseRecords,
    PlacementEvent,
    ReceivedTelemetry,
    RunnerStatusChanged,
    TaskEvent,
    WireError,
    decode,
)

__all__ = ["BadInputError", "entry_times", "parse_placement", "parse_task", "parse_telemetry"]


class BadInputError(ValueError):
    """A message that cannot be applied; `kind` groups it for counting and logging."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


_token = functools.lru_cache(maxsize=1 << 14)(token)
"""`token`, remembering the ids it took (ingest checks three a message; errors are not
remembered)."""


def _named(*ids: str) -> None:
    """Refuse ids that cannot name a subject (the aggregator publishes and probes by them)."""
    try:
        for value in ids:
            _token(value)
    except IdTooLongError as exc:
        raise BadInputError("id_too_long", str(exc)) from None
    except ValueError as exc:
        raise BadInputError("id_empty", str(exc)) from None


_KIND: dict[type, TelemetryKind] = {
    PhaseRecords: "phase",
    MemorySampled: "memory",
    RunnerStatusChanged: "status",
}


_SAID: dict[str, tuple[str, str, str, str, int, TelemetryKind]] = {}
"""Each telemetry subject a message passed on, with its prefix and the runner and kind the
message said: a runner's next message saying the same needs no ids checked again (three
ids escaped and its subject built, a message)."""
_SAID_MOST = 1 << 16


FIELD_LIMIT = 16 << 10
"""The longest text of one telemetry field (a detail, an attribute, a memory source)."""
ATTRS_LIMIT = 64
"""The most attributes one entry of a large message may carry."""


def _bounded(event: ReceivedTelemetry) -> None:
    """Refuse telemetry whose fields are past the limits: one huge field would make every
    timeline that shows it huge, and the aggregator hold it."""
    texts: list[tuple[str, str]] = []
    if isinstance(event, PhaseRecords):
        for index, entry in enumerate(event.entries):
            where = f"entries[{index}]"
            if len(entry.attrs) > ATTRS_LIMIT:
                raise BadInputError(
                    "telemetry_oversize",
                    f"{where} has {len(entry.attrs)} attributes, more than {ATTRS_LIMIT}",
                )
            texts += [(f"{where}.event", entry.event), (f"{where}.detail", entry.detail or "")]
            for key, value in entry.attrs.items():
                values = value if isinstance(value, list) else [value]
                texts += [(f"{where}.attrs.{key[:40]}", str(v)) for v in (key, *values)]
    elif isinstance(event, RunnerStatusChanged):
        texts.append(("detail", event.detail or ""))
    else:
        texts.append(("snapshot.source", event.snapshot.source))
    for where, text in texts:
        if len(text) > FIELD_LIMIT:
            raise BadInputError(
                "telemetry_oversize",
                f"`{where}` is {len(text):,} characters, more than {FIELD_LIMIT:,}",
            )


def entry_times(entries: Sequence[FlightRecord]) -> list[int]:
    """Each entry's time in µs since the epoch, checked as decoding `FlightEntry`s checks
    them one by one (one given with an offset is put in the wire's form), but a batch
    within one second at once: the most of what decoding a batch cost.

    Raises:
        BadInputError: one is no RFC 3339 date-time with an offset.
    """
    if len(entries) == 1:  # most messages of a runner streaming its entries as they come
        at = stamp_micros(entries[0].at)
        if at is not None:
            return [at]
    elif (times := second_micros([entry.at for entry in entries])) is not None:
        return times
    times = []
    for index, entry in enumerate(entries):
        try:
            entry.check_time()
        except ValueError as exc:
            where = f"{exc} - at `$.entries[{index}]`"
            raise BadInputError("telemetry_undecodable", where) from None
        times.append(micros(entry.at))
    return times


def parse_telemetry(data: bytes, subject: str, subjects: Subjects) -> ReceivedTelemetry:
    """A runner telemetry message received on `subject` (a batch's times are checked
    where they are filed: `entry_times`).

    Raises:
        BadInputError: it does not decode, names a rank outside its world, or names a
            runner other than the one its subject does (a node's user may publish only
            its own node's subjects, so a payload naming another node's runner is a lie).
    """
    try:
        event: ReceivedTelemetry = decode(data, ReceivedTelemetry)
    except WireError as exc:
        raise BadInputError("telemetry_undecodable", str(exc)) from None
    if event.runner.deviceRank >= event.runner.worldSize:
        raise BadInputError(
            "telemetry_rank_outside_world",
            f"deviceRank {event.runner.deviceRank} >= worldSize {event.runner.worldSize}",
        )
    if len(data) > FIELD_LIMIT:  # a message no larger holds no field past the limits
        _bounded(event)
    ref = event.runner
    kind = _KIND[type(event)]
    said = (subjects.prefix, ref.nodeId, ref.instanceId, ref.runnerId, ref.deviceRank, kind)
    if _SAID.get(subject) == said:
        return event
    _named(ref.nodeId, ref.instanceId, ref.runnerId)
    named = subjects.runner(ref.nodeId, ref.instanceId, ref.deviceRank, kind)
    if subject != named:
        raise BadInputError(
            "telemetry_identity", f"received on {subject!r}, but its runner's subject is {named!r}"
        )
    if len(_SAID) >= _SAID_MOST:
        _SAID.clear()
    _SAID[subject] = said
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
