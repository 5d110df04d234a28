"""One answer from the aggregators of every partition: the same answer one aggregator of
all instances would give, or a partial one that says which partitions are missing.

A partial answer carries the header `Rankscope-Missing-Partitions` (their indexes, comma
separated) and, when it is a JSON object, a field `missingPartitions` naming each with why.
"""

from __future__ import annotations

import contextvars
from typing import Any

import msgspec
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rankscope.shared.headers import MISSING_PARTITIONS_HEADER
from rankscope.shared.timestamps import now
from rankscope.shared.views import DIAGNOSIS, HEALTH, View
from rankscope.shared.wire import (
    AggregatorHealth,
    MissingPartition,
    TimelineQuery,
    decode,
    encode,
)
from rankscope.shared.wire.base import CamelStruct

__all__ = ["MissingPartitions", "merge", "missing", "with_missing"]

_missing: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    "missing_partitions", default=None
)


class _Key(msgspec.Struct, rename="camel", frozen=True):
    """The fields an entry, a synopsis, a node or a finding is ordered or matched by."""

    at: str = ""
    node_id: str = ""
    device_rank: int = 0
    model_id: str = ""
    runner_id: str = ""
    instance_id: str = ""
    kind: str = ""


class _Timeline(msgspec.Struct, rename="camel", frozen=True):
    """A `ClusterTimeline` with its parts still as JSON (re-ordered, never re-encoded)."""

    generated_at: str
    local_node_id: str
    master_node_id: str | None = None
    runners: list[msgspec.Raw] = []
    timeline: list[msgspec.Raw] = []
    unreachable_nodes: list[msgspec.Raw] = []


class _Diagnosis(msgspec.Struct, rename="camel", frozen=True):
    generated_at: str
    findings: list[msgspec.Raw] = []
    omitted: int = 0


_keys = msgspec.json.Decoder(_Key)
_lists = msgspec.json.Decoder(list[msgspec.Raw])


def _keyed(raw: msgspec.Raw) -> _Key:
    return _keys.decode(raw)


def _timeline(answers: list[bytes], limit: int) -> bytes:
    """Entries merged in time order, the newest `limit` kept after the merge (each
    partition's newest `limit` hold them); synopses in the one aggregator's order."""
    parts = [decode(a, _Timeline) for a in answers]
    entries = sorted(
        (e for p in parts for e in p.timeline),
        key=lambda e: ((k := _keyed(e)).at, k.node_id, k.device_rank),
    )
    runners = sorted(
        (r for p in parts for r in p.runners),
        key=lambda r: ((k := _keyed(r)).model_id, k.device_rank, k.runner_id),
    )
    unreachable = {_keyed(u).node_id: u for p in reversed(parts) for u in p.unreachable_nodes}
    merged = msgspec.structs.replace(
        parts[0],
        generated_at=now(),
        runners=runners,
        timeline=entries[-limit:],
        unreachable_nodes=[unreachable[n] for n in sorted(unreachable)],
    )
    return encode(merged)


def _diagnosis(answers: list[bytes]) -> bytes:
    """Findings of every partition; the installation's own (NATS out), which every
    partition sees, once each."""
    findings: list[msgspec.Raw] = []
    told: set[str] = set()
    omitted = 0
    for answer in answers:
        part = decode(answer, _Diagnosis)
        omitted += part.omitted
        for finding in part.findings:
            key = _keyed(finding)
            if not key.instance_id:
                if key.kind in told:
                    continue
                told.add(key.kind)
            findings.append(finding)
    return encode(_Diagnosis(generated_at=now(), findings=findings, omitted=omitted))


def _health(answers: list[bytes]) -> bytes:
    """Counters summed, maps joined, ready only when every partition is, the first
    storage problem said."""
    merged: dict[str, Any] = {}
    for health in (decode(answer, AggregatorHealth) for answer in answers):
        for key, value in msgspec.structs.asdict(health).items():
            held = merged.get(key)
            if held is None:
                merged[key] = value
            elif key == "partition":
                merged[key] = f"{held},{value}"
            elif isinstance(value, bool):
                merged[key] = held and value
            elif isinstance(value, dict):
                merged[key] = held | value
            elif isinstance(value, int | float | list):
                merged[key] = held + value
            elif not held:
                merged[key] = value
    return encode(msgspec.convert(merged, AggregatorHealth))


def _concatenated(answers: list[bytes]) -> bytes:
    return encode([item for answer in answers for item in _lists.decode(answer)])


def merge(view: View[Any], request: CamelStruct, answers: list[bytes]) -> bytes:
    """The answers of the partitions that gave one to `request`, as one."""
    if isinstance(request, TimelineQuery):
        return _timeline(answers, request.limit)
    if view is DIAGNOSIS:
        return _diagnosis(answers)
    if view is HEALTH:
        return _health(answers)
    return _concatenated(answers)


def with_missing(answer: bytes, missing: dict[int, str]) -> bytes:
    """`answer`, when a JSON object, with a `missingPartitions` field naming the partitions
    in `missing` and why each is; the HTTP response being built gets the header too."""
    if not missing:
        return answer
    held = _missing.get()
    if held is not None:
        held.extend(missing)
    if not answer.startswith(b"{"):
        return answer
    named = [MissingPartition(partition=i, reason=why) for i, why in sorted(missing.items())]
    return answer[:-1] + b',"missingPartitions":' + encode(named) + b"}"


def missing() -> list[int]:
    """The partitions missing from the answers the HTTP response being built used."""
    return sorted(set(_missing.get() or []))


class MissingPartitions:
    """Adds `Rankscope-Missing-Partitions` to a response built from a partial answer."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        missing: list[int] = []
        held = _missing.set(missing)

        async def sent(message: Message) -> None:
            if message["type"] == "http.response.start" and missing:
                shown = ",".join(str(i) for i in sorted(set(missing)))
                MutableHeaders(scope=message).append(MISSING_PARTITIONS_HEADER, shown)
            await send(message)

        try:
            await self._app(scope, receive, sent)
        finally:
            _missing.reset(held)
