"""Reducers of the rank-table service: idempotent, and counting what users see."""

from __future__ import annotations

from rankscope.services.ranktable.state import (
    PlacementState,
    Readiness,
    apply_placement,
    apply_status,
)
from rankscope.services.ranktable.tables import rank_table
from rankscope.shared.timestamps import now
from rankscope.shared.wire import (
    InstanceCreated,
    InstanceReleased,
    RankTableStatus,
    ReleaseCause,
    RunnerAssignment,
    RunnerRef,
    RunnerStatusChanged,
    RunnerStatusKind,
)


def _assignment(rank: int, node: str, start: int, end: int) -> RunnerAssignment:
    return RunnerAssignment(
        runnerId=f"j-a0-r{rank}",
        nodeId=node,
        deviceRank=rank,
        worldSize=3,
        startLayer=start,
        endLayer=end,
        nLayers=8,
        host=f"10.0.0.{node[-1]}",
        port=52000 + rank,
    )


CREATED = InstanceCreated(
    at=now(),
    instanceId="j",
    runnerSpecId="s",
    modelId="m",
    assignments=[
        _assignment(0, "n1", 0, 3),
        _assignment(1, "n1", 3, 5),
        _assignment(2, "n2", 5, 8),
    ],
)


def _status(rank: int, seq: int, kind: RunnerStatusKind, alive: bool = True) -> RunnerStatusChanged:
    ref = RunnerRef(
        runnerId=f"j-a0-r{rank}",
        nodeId="n1",
        instanceId="j",
        modelId="m",
        deviceRank=rank,
        worldSize=3,
    )
    return RunnerStatusChanged(runner=ref, seq=seq, at=now(), statusKind=kind, processAlive=alive)


def test_redelivered_placement_changes_nothing() -> None:
    once = apply_placement(PlacementState(), CREATED, seq=1)
    assert apply_placement(once, CREATED, seq=1) is once
    assert once.attempts == {"j": 1}


def test_preemption_counts_pods_per_spec() -> None:
    state = apply_placement(PlacementState(), CREATED, seq=1)
    released = InstanceReleased(at=now(), instanceId="j", cause=ReleaseCause.PREEMPTED, reason="x")
    state = apply_placement(state, released, seq=2)
    assert state.instances == {}
    assert state.preempted_pods == {"s": 3}


def test_readiness_follows_the_latest_status() -> None:
    ready = apply_status(Readiness(), _status(0, 5, RunnerStatusKind.READY))
    assert ready.is_ready("j-a0-r0")
    assert apply_status(ready, _status(0, 4, RunnerStatusKind.FAILED)).is_ready("j-a0-r0")
    failed = apply_status(ready, _status(0, 6, RunnerStatusKind.FAILED, alive=False))
    assert not failed.is_ready("j-a0-r0")
    assert "j-a0-r0" not in failed.ready_since


def test_rank_table_groups_ranks_by_node() -> None:
    table = rank_table(CREATED, lambda runner_id: False)
    (group,) = table.server_group_list
    assert group.server_count == "2"
    assert [(s.server_id, [d.rank_id for d in s.device]) for s in group.server_list] == [
        ("n1", ["0", "1"]),
        ("n2", ["2"]),
    ]
    assert [d.device_id for d in group.server_list[0].device] == ["0", "1"]
    assert group.server_list[1].device[0].device_ip == "10.0.0.2"
    assert table.status is RankTableStatus.INITIALIZING


def test_rank_table_completes_when_every_rank_is_ready() -> None:
    assert rank_table(CREATED, lambda runner_id: True).status is RankTableStatus.COMPLETED
    assert rank_table(CREATED, lambda r: r != "j-a0-r2").status is RankTableStatus.INITIALIZING


def test_unplaced_job_has_an_empty_initializing_table() -> None:
    table = rank_table(None, lambda runner_id: True)
    assert table.status is RankTableStatus.INITIALIZING
    assert table.server_group_list[0].server_list == []
