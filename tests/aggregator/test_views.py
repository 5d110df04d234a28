"""Views folded from events: the seed-001 timeline and the seed-000 placement."""

from __future__ import annotations

import random
import time
from typing import Any

from rankscope.services.aggregator import answers
from rankscope.services.aggregator.store import EntryStore
from rankscope.services.aggregator.views import ClusterState, Held
from rankscope.shared.inputs import BadInputError
from rankscope.shared.wire import (
    Breadcrumb,
    FlightEntry,
    FlightRecord,
    GenerationRequest,
    InstanceReleased,
    Phase,
    PhaseEntries,
    PhaseRecords,
    ReceivedTelemetry,
    ReleaseCause,
    RunnerRef,
    RunnerStatusKind,
    TaskCreated,
    TaskKind,
    TaskStatus,
    TaskStatusChanged,
    TimelineQuery,
    UnreachableNode,
)
from tests.aggregator.builders import at, entries, placed, rank, status


def _state() -> ClusterState:
    state = ClusterState(store=EntryStore())
    state.arrive(100.0, time.time())
    state.apply_placement(placed())
    return state


def test_timeline_merges_ranks_by_time_with_ties_by_node_then_rank() -> None:
    state = _state()
    state.apply_telemetry(entries(rank(1), (0, 2, Phase.CREATED, None), (1, 3, Phase.IDLE, None)))
    state.apply_telemetry(entries(rank(0), (0, 1, Phase.CREATED, None), (1, 3, Phase.IDLE, None)))
    timeline = answers.timeline(state, TimelineQuery(), local_node_id="agg", now=time.time())
    assert [(e.at, e.deviceRank) for e in timeline.timeline] == [
        (at(1), 0),
        (at(2), 1),
        (at(3), 0),
        (at(3), 1),
    ]
    assert [r.deviceRank for r in timeline.runners] == [0, 1]
    assert timeline.localNodeId == "agg"


def test_redelivered_telemetry_changes_nothing() -> None:
    state = _state()
    batch = entries(rank(0), (0, 1, Phase.CREATED, None), (1, 2, Phase.IDLE, None))
    assert state.apply_telemetry(batch) == 2
    assert state.apply_telemetry(batch) == 0
    assert state.store.size == 2
    assert state.duplicates == 2


def test_limit_keeps_the_newest_in_ascending_order_and_filters_apply() -> None:
    state = _state()
    state.apply_telemetry(entries(rank(0), *[(i, i, Phase.DECODE_STREAM, i) for i in range(10)]))
    state.apply_telemetry(
        entries(rank(1), *[(i, i + 0.5, Phase.DECODE_STREAM, i) for i in range(10)])
    )
    newest = answers.timeline(
        state, TimelineQuery(limit=3), local_node_id="a", now=time.time()
    ).timeline
    assert [e.at for e in newest] == [at(8.5), at(9), at(9.5)]
    only = answers.timeline(
        state, TimelineQuery(nodeId="node-1", since=at(8)), local_node_id="a", now=time.time()
    )
    assert [e.at for e in only.timeline] == [at(8.5), at(9.5)]
    assert [r.runnerId for r in only.runners] == ["i-r1"]
    assert (
        answers.timeline(
            state, TimelineQuery(modelId="other"), local_node_id="a", now=time.time()
        ).runners
        == []
    )


def test_filters_by_instance_and_node_find_exactly_their_runners() -> None:
    state = _state()
    state.apply_placement(placed("j", world=1))  # its rank 0 shares node-0 with i's
    for ref in (rank(0), rank(1), rank(0, "j", world=1)):
        state.apply_telemetry(entries(ref, (0, 1, Phase.IDLE, None)))

    def found(**filters: str) -> list[str]:
        query = TimelineQuery(**filters)  # type: ignore[arg-type]
        timeline = answers.timeline(state, query, local_node_id="a", now=time.time())
        assert {e.runnerId for e in timeline.timeline} == {r.runnerId for r in timeline.runners}
        return [r.runnerId for r in timeline.runners]

    assert found(instanceId="j") == ["j-r0"]
    assert found(instanceId="i") == ["i-r0", "i-r1"]
    assert sorted(found(nodeId="node-0")) == ["i-r0", "j-r0"]
    assert found(instanceId="i", nodeId="node-0") == ["i-r0"]
    assert found(instanceId="j", nodeId="node-1") == []
    assert found(instanceId="nowhere") == []
    assert found(nodeId="node-1", modelId="other") == []


def test_synopsis_tracks_phase_status_and_task() -> None:
    state = _state()
    state.apply_telemetry(status(rank(0), 0, RunnerStatusKind.RUNNING))
    state.apply_telemetry(
        entries(rank(0), (1, 1, Phase.PREFILL_PIPELINE, 3), (2, 2, Phase.PREFILL_PIPELINE, 4))
    )
    (synopsis,) = answers.timeline(
        state, TimelineQuery(nodeId="node-0"), local_node_id="a", now=time.time()
    ).runners
    assert synopsis.phase is Phase.PREFILL_PIPELINE
    assert synopsis.lastProgressAt == at(2)
    assert synopsis.activeTaskId == "t1"
    assert synopsis.statusKind == "RunnerRunning"
    assert synopsis.processAlive
    assert synopsis.secondsInPhase > 0  # since at(1), measured now


def test_a_status_or_sample_that_overtook_older_entries_does_not_hide_them() -> None:
    state = _state()
    state.apply_telemetry(entries(rank(0), (1, 1, Phase.PREFILL_PIPELINE, 3)))
    state.apply_telemetry(status(rank(0), 9, RunnerStatusKind.READY))  # published sooner
    state.apply_telemetry(
        entries(rank(0), (5, 5, Phase.DECODE_STREAM, 4), (6, 6, Phase.IDLE, None))
    )
    (synopsis,) = answers.timeline(
        state, TimelineQuery(nodeId="node-0"), local_node_id="a", now=time.time()
    ).runners
    assert synopsis.phase is Phase.IDLE  # not left in prefill for good
    assert synopsis.lastProgressAt == at(6)
    assert synopsis.activeTaskId is None
    state.apply_telemetry(entries(rank(0), (2, 2, Phase.PREFILL_PIPELINE, 3)))  # late
    (late,) = answers.timeline(
        state, TimelineQuery(nodeId="node-0"), local_node_id="a", now=time.time()
    ).runners
    assert late.phase is Phase.IDLE


def test_placement_lists_each_rank_with_only_its_own_task_status() -> None:
    state = _state()
    request = GenerationRequest(prompt="hi")
    state.apply_task(
        TaskCreated(
            at=at(5),
            taskId="t1",
            instanceId="i",
            commandId="c1",
            taskKind=TaskKind.TEXT_GENERATION,
            request=request,
        )
    )
    state.apply_task(
        TaskStatusChanged(
            at=at(6), taskId="t1", instanceId="i", taskStatus=TaskStatus.COMPLETE, runnerId="i-r1"
        )
    )
    state.apply_telemetry(status(rank(1), 0, RunnerStatusKind.READY))
    found = answers.placement(state, local_node_id="node-0")
    assert [(p.runnerId, p.startLayer, p.endLayer, p.isLocal) for p in found] == [
        ("i-r0", 0, 4, True),
        ("i-r1", 4, 8, False),
    ]
    assert [(t.runnerId, t.taskStatus) for p in found for t in p.tasks] == [
        ("i-r0", "Pending"),
        ("i-r1", "Complete"),
    ]
    assert found[1].statusKind == "RunnerReady"


def test_released_instances_leave_placement_but_keep_their_history() -> None:
    state = _state()
    state.apply_telemetry(entries(rank(0), (0, 1, Phase.CREATED, None)))
    state.apply_placement(
        InstanceReleased(at=at(9), instanceId="i", cause=ReleaseCause.SPEC_DELETED, reason="gone")
    )
    assert answers.placement(state, local_node_id="a") == []
    assert (
        len(answers.timeline(state, TimelineQuery(), local_node_id="a", now=time.time()).timeline)
        == 1
    )


def test_instance_state_says_ready_and_lost() -> None:
    state = _state()
    state.apply_telemetry(status(rank(0), 0, RunnerStatusKind.READY))
    state.apply_telemetry(status(rank(1), 0, RunnerStatusKind.FAILED, alive=False))
    (instance,) = answers.instance_states(state)
    assert [(r.ready, r.lost) for r in instance.ranks] == [(True, False), (False, True)]


def test_a_runner_its_agent_no_longer_lists_is_not_alive() -> None:
    state = _state()
    state.apply_telemetry(status(rank(0), 0, RunnerStatusKind.READY))
    runners = [state.runners["i-r0"]]

    def alive() -> tuple[bool, bool]:
        found = answers.timeline(state, TimelineQuery(), local_node_id="a", now=time.time()).runners
        (synopsis,) = [r for r in found if r.runnerId == "i-r0"]
        (instance,) = answers.instance_states(state)
        return synopsis.processAlive, instance.ranks[0].lost

    state.note_listed(set(), runners)  # once: it may not be started yet
    assert alive() == (True, False)
    state.note_listed(set(), runners)  # its agent restarted without it
    assert alive() == (False, True)
    state.note_listed({"i-r0"}, runners)
    assert alive() == (True, False)


def test_queue_depth_counts_generations_not_yet_over_on_every_rank() -> None:
    state = _state()
    for task_id in ("t1", "t2", "t3"):
        state.apply_task(
            TaskCreated(
                at=at(5),
                taskId=task_id,
                instanceId="i",
                taskKind=TaskKind.TEXT_GENERATION,
                request=GenerationRequest(prompt="hi"),
            )
        )

    def report(task_id: str, runner_id: str, status: TaskStatus) -> None:
        state.apply_task(
            TaskStatusChanged(
                at=at(6), taskId=task_id, instanceId="i", taskStatus=status, runnerId=runner_id
            )
        )

    report("t1", "i-r0", TaskStatus.COMPLETE)
    report("t1", "i-r1", TaskStatus.COMPLETE)  # over on both ranks
    report("t2", "i-r0", TaskStatus.CANCELLED)  # over on one rank only
    report("t3", "i-r0", TaskStatus.RUNNING)
    assert state.queued() == {"i": 2}


def test_what_changes_an_instance_touches_it_for_the_next_diagnosis() -> None:
    state = _state()
    state.apply_placement(placed("other"))
    assert state.take_touched() == {"i", "other"}
    assert state.take_touched() == set()
    state.apply_telemetry(entries(rank(0), (0, 1, Phase.IDLE, None)))
    assert state.take_touched() == {"i"}
    lost = {"node-1": UnreachableNode(nodeId="node-1", error="silent")}
    state.set_unreachable(lost)
    assert state.take_touched() == {"i", "other"}  # both have a rank on node-1
    state.set_unreachable({"node-1": UnreachableNode(nodeId="node-1", error="still silent")})
    assert state.take_touched() == set()  # still unreachable: nothing the judge sees changed
    state.set_unreachable({})
    assert state.take_touched() == {"i", "other"}


def test_a_rank_heard_after_its_node_was_found_unreachable_is_not_lost() -> None:
    state = _state()
    ready = status(rank(1), 1, RunnerStatusKind.READY)
    state.apply_telemetry(ready, stored_ns=1_000)
    silent = {"node-1": UnreachableNode(nodeId="node-1", error="no agent answers")}
    state.set_unreachable(silent, asked_ns=2_000)  # asked as its agent restarted
    assert [r.lost for r in answers.instance_states(state)[0].ranks] == [False, True]
    state.apply_telemetry(status(rank(1), 2, RunnerStatusKind.READY), stored_ns=3_000)
    assert [r.lost for r in answers.instance_states(state)[0].ranks] == [False, False]


def _stream(seed: int) -> list[ReceivedTelemetry]:
    """Two ranks' telemetry in an order a stream may hold: runs of single entries in
    order, one with a bad time in it, batches out of order and redelivered, a rank giving
    up then ready again, a failure after it was ready."""
    gave_up, ready = Breadcrumb.COLLECTIVE_TIMEOUT.value, Breadcrumb.RUNNER_READY.value

    def one(
        ref: RunnerRef, seq: int, event: str, phase: Phase = Phase.DECODE_STREAM
    ) -> PhaseEntries:
        entry = FlightEntry(
            seq=seq, at=at(seq * 7 / 100), phase=phase, event=event, attrs={"step": seq}
        )
        return PhaseEntries(runner=ref, entries=[entry])

    def bad(ref: RunnerRef, seq: int) -> PhaseRecords:
        entry = FlightRecord(
            seq=seq, at="2026-11-21T12:00:00.1\u0663Z", phase=Phase.IDLE, event="e"
        )
        return PhaseRecords(runner=ref, entries=[entry])

    shuffle = random.Random(seed).shuffle
    out: list[ReceivedTelemetry] = []
    for r in (rank(0), rank(1)):
        out += [one(r, s, "token") for s in range(20)]  # in order: filed at once
        out += [one(r, 20, "token"), bad(r, 21), one(r, 21, "token")]  # the bad one alone
        batches: list[ReceivedTelemetry] = [
            entries(r, *[(s, s, Phase.PREFILL_PIPELINE, s) for s in range(first, first + 3)])
            for first in range(22, 52, 3)
        ]
        shuffle(batches)
        out += [*batches, batches[2], one(r, 52, gave_up), one(r, 53, ready, Phase.IDLE)]
        out += [status(r, 54, RunnerStatusKind.FAILED, alive=False), one(r, 55, "e")]
    return out


def _same(alone: ClusterState, later: ClusterState) -> None:
    """Every view of `later` is what `alone` shows."""
    for ref in (rank(0), rank(1)):
        one, other = alone.runners[ref.runnerId], later.runners[ref.runnerId]
        assert other.synopsis == one.synopsis
        assert (other.gave_up, other.failure, other.waiting_in) == (
            one.gave_up,
            one.failure,
            one.waiting_in,
        )
        assert (other.seqs.starts, other.seqs.ends, other.seqs.seen) == (
            one.seqs.starts,
            one.seqs.ends,
            one.seqs.seen,
        )
    assert (later.duplicates, later.store.size) == (alone.duplicates, alone.store.size)
    query = TimelineQuery(limit=100_000)
    made = [answers.timeline(s, query, local_node_id="a", now=1.8e9) for s in (later, alone)]
    assert made[0] == made[1]


def test_a_run_of_messages_settled_at_once_leaves_what_one_at_a_time_leaves() -> None:
    """Ingest files a runner's batches of a run of messages at once and moves its synopsis
    once (`settle`): after each run every view is as if each message had been applied on
    its own, in the order they came, and the same batches are refused, for the same
    reason."""
    for seed in range(20):
        one_by_one, settled_later = (ClusterState(store=EntryStore()) for _ in "ab")
        for state in (one_by_one, settled_later):
            state.arrive(100.0, 1.8e9)
            state.apply_placement(placed())
        refused: list[tuple[ReceivedTelemetry, str]] = []
        refused_later: list[tuple[ReceivedTelemetry, str]] = []

        def later(held: Held, error: BadInputError, out: list[Any] = refused_later) -> None:
            out.append((held[0], error.kind))

        settled_later.refused = later
        for number, event in enumerate(_stream(seed)):
            try:
                one_by_one.apply_telemetry(event)
            except BadInputError as exc:
                refused.append((event, exc.kind))
            settled_later.apply_telemetry(event, settle=False)
            if number % 7 == 6:  # runs of messages of both ranks, cut anywhere
                settled_later.settle()
                _same(one_by_one, settled_later)
        settled_later.settle()
        _same(one_by_one, settled_later)
        assert refused == refused_later
        assert [kind for _, kind in refused] == ["telemetry_undecodable"] * 2
        for ref in (rank(0), rank(1)):
            alone = one_by_one.runners[ref.runnerId]
            assert alone.failure is not None  # ready at 53, failed at 54
            assert alone.synopsis.seq == 55
