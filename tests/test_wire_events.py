"""rankscope's own events are tagged unions that round-trip and refuse nonsense."""

from __future__ import annotations

import json

import msgspec
import pytest

from rankscope.shared.timestamps import now, to_epoch
from rankscope.shared.wire import (
    TASK_HORIZON_S,
    ChatMessage,
    FlightEntry,
    GenerationRequest,
    InstanceCreated,
    InstanceReleased,
    InstanceState,
    Memory,
    MemorySampled,
    MlxMemorySnapshot,
    Phase,
    PhaseEntries,
    PlacementEvent,
    RankState,
    ReleaseCause,
    RunnerAssignment,
    RunnerRef,
    RunnerStatusChanged,
    RunnerStatusKind,
    RunnerTelemetry,
    TaskCreated,
    TaskEvent,
    TaskKind,
    TaskStatus,
    TaskStatusChanged,
    WireError,
    decode,
    encode,
)

RUNNER = RunnerRef(
    runnerId="r-0", nodeId="node-a", instanceId="i-1", modelId="tiny", deviceRank=0, worldSize=2
)
SNAPSHOT = MlxMemorySnapshot(generatedAt=now(), active=Memory(inBytes=1024), source="mlx.core")
ASSIGNMENT = RunnerAssignment(
    runnerId="r-0",
    nodeId="node-a",
    deviceRank=0,
    worldSize=2,
    startLayer=0,
    endLayer=2,
    nLayers=4,
    host="127.0.0.1",
    port=5000,
)

TELEMETRY = [
    PhaseEntries(
        runner=RUNNER,
        entries=[
            FlightEntry(seq=0, at=now(), phase=Phase.CREATED, event="started", mlxMemory=SNAPSHOT),
            FlightEntry(
                seq=1,
                at=now(),
                phase=Phase.DECODE_STREAM,
                event="recv",
                attrs={"step": 7, "src": 1},
                taskId="t",
                commandId="c",
            ),
        ],
    ),
    MemorySampled(runner=RUNNER, seq=2, snapshot=SNAPSHOT),
    RunnerStatusChanged(
        runner=RUNNER,
        seq=3,
        at=now(),
        statusKind=RunnerStatusKind.FAILED,
        pid=42,
        processAlive=False,
        exitCode=-9,
        signal="SIGKILL",
    ),
]
PLACEMENT = [
    InstanceCreated(
        at=now(), instanceId="i-1", runnerSpecId="spec", modelId="tiny", assignments=[ASSIGNMENT]
    ),
    InstanceReleased(
        at=now(), instanceId="i-1", cause=ReleaseCause.NODE_LOST, reason="node node-b lost"
    ),
]
TASKS = [
    TaskCreated(
        at=now(),
        taskId="t",
        instanceId="i-1",
        taskKind=TaskKind.TEXT_GENERATION,
        commandId="c",
        request=GenerationRequest(messages=[ChatMessage(role="user", content="hi")], maxTokens=8),
    ),
    TaskStatusChanged(at=now(), taskId="t", instanceId="i-1", taskStatus=TaskStatus.COMPLETE),
]


@pytest.mark.parametrize("event", TELEMETRY, ids=lambda e: type(e).__name__)
def test_telemetry_round_trips_through_its_union(event: object) -> None:
    assert decode(encode(event), RunnerTelemetry) == event


@pytest.mark.parametrize("event", PLACEMENT, ids=lambda e: type(e).__name__)
def test_placement_round_trips_through_its_union(event: object) -> None:
    assert decode(encode(event), PlacementEvent) == event


@pytest.mark.parametrize("event", TASKS, ids=lambda e: type(e).__name__)
def test_task_events_round_trip_through_their_union(event: object) -> None:
    assert decode(encode(event), TaskEvent) == event


def test_variant_is_named_by_type_and_fields_are_camel_case() -> None:
    wire = json.loads(encode(TELEMETRY[2]))
    assert wire["type"] == "RunnerStatusChanged"
    assert {"statusKind", "processAlive", "exitCode"} <= set(wire)
    assert wire["runner"]["deviceRank"] == 0


def test_unknown_variant_is_refused() -> None:
    with pytest.raises(WireError, match=r"Invalid value 'Bogus' - at `\$\.type`"):
        decode(b'{"type": "Bogus"}', RunnerTelemetry)


def test_negative_rank_is_refused() -> None:
    wire = json.loads(encode(TELEMETRY[1]))
    wire["runner"]["deviceRank"] = -1
    with pytest.raises(WireError, match=r"`\$\.runner\.deviceRank`"):
        decode(json.dumps(wire), RunnerTelemetry)


def test_assignment_port_must_be_a_port() -> None:
    wire = json.loads(encode(PLACEMENT[0]))
    wire["assignments"][0]["port"] = 70000
    with pytest.raises(WireError, match=r"`\$\.assignments\[0\]\.port`"):
        decode(json.dumps(wire), PlacementEvent)


def test_terminal_task_statuses() -> None:
    assert not TaskStatus.RUNNING.is_final
    assert TaskStatus.TIMED_OUT.is_final


def test_an_instance_is_ready_only_with_every_rank_ready() -> None:
    def rank(n: int, ready: bool) -> RankState:
        return RankState(runnerId=f"r-{n}", nodeId="node-a", deviceRank=n, ready=ready, lost=False)

    def instance(*ranks: RankState) -> InstanceState:
        return InstanceState(instanceId="i-1", modelId="tiny", ranks=list(ranks))

    assert instance(rank(0, True), rank(1, True)).ready
    assert not instance(rank(0, True), rank(1, False)).ready
    assert not instance().ready  # no rank can serve nothing


def test_a_task_expires_at_its_deadline_or_its_horizon_without_one() -> None:
    at = "2026-11-25T12:00:00.000000Z"
    noon = to_epoch(at)
    with_deadline = TaskCreated(
        at=at,
        deadline="2026-11-25T12:00:10.000000Z",
        taskId="t",
        instanceId="i",
        taskKind=TaskKind.TEXT_GENERATION,
    )
    assert not with_deadline.expired(noon + 9)
    assert with_deadline.expired(noon + 11)
    without = msgspec.structs.replace(with_deadline, deadline=None)
    assert not without.expired(noon + TASK_HORIZON_S - 1)
    assert without.expired(noon + TASK_HORIZON_S + 1)


def test_a_task_deadline_that_is_no_timestamp_is_refused() -> None:
    wire = {
        "type": "TaskCreated",
        "at": now(),
        "deadline": "soon",
        "taskId": "t",
        "instanceId": "i",
        "taskKind": "TextGeneration",
    }
    with pytest.raises(WireError, match="timestamp 'soon'"):
        decode(json.dumps(wire), TaskEvent)
