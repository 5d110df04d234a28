"""The diagnosis names the rank at fault, and says 'cannot decide' when it cannot."""

from __future__ import annotations

from services.aggregator.diagnosis import Thresholds, diagnose
from services.aggregator.store import EntryStore
from services.aggregator.views import ClusterState
from shared.wire import (
    Finding,
    FindingKind,
    MemorySampled,
    MlxMemorySnapshot,
    Phase,
    RunnerStatusKind,
)
from tests.aggregator.builders import at, entries, placed, rank, status

LIMITS = Thresholds(working=10, loading=300, no_data=30, silent=5)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _setup(world: int = 2) -> tuple[ClusterState, Clock]:
    clock = Clock()
    state = ClusterState(store=EntryStore(), clock=clock)
    state.apply_placement(placed(world=world))
    return state, clock


def _run(state: ClusterState, clock: Clock) -> list[Finding]:
    return diagnose(
        state, now=clock.now, since=lambda i, k: at(0), placed_at=lambda i: 990.0, thresholds=LIMITS
    )


def test_a_rank_held_a_step_behind_is_named_once_nobody_progresses() -> None:
    state, clock = _setup()
    state.apply_telemetry(entries(rank(0), (0, 1, Phase.PREFILL_PIPELINE, 7)))
    state.apply_telemetry(entries(rank(1), (0, 1, Phase.DECODE_BARRIER, 8)))
    clock.now += 9
    assert _run(state, clock) == []  # within the threshold: just busy
    clock.now += 2
    (finding,) = _run(state, clock)
    assert finding.kind is FindingKind.RANK_DISAGREEMENT
    assert finding.culpritRanks == [0]
    assert finding.culpritRunnerIds == ["i-r0"]
    assert finding.waitingRanks == [1]
    assert "rank 0 (node-0) held in prefill_pipeline at step 7" in finding.summary
    assert "rank 1 (node-1) waiting in decode_barrier at step 8" in finding.summary
    assert {e.step for e in finding.evidence} == {7, 8}


def test_the_finding_clears_when_the_rank_catches_up() -> None:
    state, clock = _setup()
    state.apply_telemetry(entries(rank(0), (0, 1, Phase.PREFILL_PIPELINE, 7)))
    state.apply_telemetry(entries(rank(1), (0, 1, Phase.DECODE_BARRIER, 8)))
    clock.now += 11
    assert _run(state, clock)
    _sample(state, 1, 1)  # rank 1 is alive all along, waiting
    state.apply_telemetry(entries(rank(0), (1, 12, Phase.DECODE_BARRIER, 8)))
    assert _run(state, clock) == []


def test_same_step_different_collective_phase_names_the_earlier_phase() -> None:
    state, clock = _setup()
    state.apply_telemetry(entries(rank(0), (0, 1, Phase.DECODE_STREAM, 9)))
    state.apply_telemetry(entries(rank(1), (0, 1, Phase.PREFILL_BARRIER, 9)))
    clock.now += 11
    (finding,) = _run(state, clock)
    assert finding.culpritRanks == [1]


def test_a_frozen_rank_is_told_from_the_one_waiting_on_it() -> None:
    state, clock = _setup()
    for r in (0, 1):
        state.apply_telemetry(entries(rank(r), (0, 1, Phase.DECODE_STREAM, 5)))
    clock.now += 11
    memory = MlxMemorySnapshot(generatedAt=at(11), source="mlx.core")
    state.apply_telemetry(MemorySampled(runner=rank(1), seq=1, snapshot=memory))  # still alive
    (finding,) = _run(state, clock)
    assert finding.kind is FindingKind.STALLED_RANK
    assert finding.culpritRanks == [0]
    assert finding.waitingRanks == [1]
    assert "rank 0 (node-0) went silent in decode_stream at step 5 11s ago" in finding.summary


def _sample(state: ClusterState, r: int, seq: int) -> None:
    memory = MlxMemorySnapshot(generatedAt=at(seq), source="mlx.core")
    state.apply_telemetry(MemorySampled(runner=rank(r), seq=seq, snapshot=memory))


def test_a_frozen_idle_rank_is_named_while_its_peer_still_talks() -> None:
    state, clock = _setup()
    for r in (0, 1):  # both idle; then rank 1 is SIGSTOPped and only rank 0 keeps sampling
        state.apply_telemetry(entries(rank(r), (0, 1, Phase.IDLE, None)))
    clock.now += 6
    _sample(state, 0, 1)
    (finding,) = _run(state, clock)
    assert finding.kind is FindingKind.STALLED_RANK
    assert finding.culpritRanks == [1]
    assert finding.waitingRanks == [0]
    assert "rank 1 (node-1) went silent in idle 6s ago" in finding.summary


def test_an_idle_rank_while_its_peer_waits_in_a_collective_is_behind() -> None:
    state, clock = _setup()
    state.apply_telemetry(entries(rank(1), (0, 1, Phase.IDLE, None)))
    state.apply_telemetry(entries(rank(0), (0, 1, Phase.TASK_AGREEMENT, None)))
    clock.now += 11
    (finding,) = _run(state, clock)
    assert finding.kind is FindingKind.RANK_DISAGREEMENT
    assert finding.culpritRanks == [1]


def test_stalled_ranks_with_no_way_to_tell_them_apart_are_all_named() -> None:
    state, clock = _setup()
    for r in (0, 1):
        state.apply_telemetry(entries(rank(r), (0, 1, Phase.DECODE_STREAM, 5)))
    clock.now += 11
    (finding,) = _run(state, clock)
    assert finding.kind is FindingKind.STALLED_RANK
    assert finding.culpritRanks == [0, 1]


def test_loading_has_its_own_longer_threshold() -> None:
    state, clock = _setup()
    state.apply_telemetry(entries(rank(0), (0, 1, Phase.LOAD_MODEL, None), task=None))
    state.apply_telemetry(entries(rank(1), (0, 1, Phase.IDLE, None)))
    clock.now += 60
    assert _run(state, clock) == []


def test_idle_ranks_are_not_stuck() -> None:
    state, clock = _setup()
    for r in (0, 1):
        state.apply_telemetry(entries(rank(r), (0, 1, Phase.IDLE, None)))
    clock.now += 1000
    assert _run(state, clock) == []


def test_a_dead_process_is_named_with_its_cause_and_the_waiting_peers() -> None:
    state, clock = _setup()
    for r in (0, 1):
        state.apply_telemetry(entries(rank(r), (0, 1, Phase.DECODE_STREAM, 5)))
    state.apply_telemetry(
        status(rank(1), 1, RunnerStatusKind.FAILED, alive=False, detail="killed by SIGKILL")
    )
    (finding,) = _run(state, clock)
    assert finding.kind is FindingKind.DEAD_RANK
    assert finding.culpritRanks == [1]
    assert finding.waitingRanks == [0]
    assert "process not alive (killed by SIGKILL)" in finding.summary


def test_an_unreachable_node_makes_its_ranks_dead() -> None:
    from shared.wire import UnreachableNode

    state, clock = _setup()
    for r in (0, 1):
        state.apply_telemetry(entries(rank(r), (0, 1, Phase.DECODE_STREAM, 5)))
    state.unreachable = {"node-0": UnreachableNode(nodeId="node-0", error="silent")}
    (finding,) = _run(state, clock)
    assert (finding.kind, finding.culpritRanks) == (FindingKind.DEAD_RANK, [0])
    assert "node unreachable" in finding.summary


def test_ranks_without_any_data_mean_cannot_decide() -> None:
    state, clock = _setup(world=3)
    state.apply_telemetry(entries(rank(0, world=3), (0, 1, Phase.DECODE_STREAM, 5)))
    clock.now = 990 + 31
    (finding,) = _run(state, clock)
    assert finding.kind is FindingKind.MISSING_DATA
    assert finding.summary == "cannot decide: no data from rank 1 (node-1), rank 2 (node-2)"
