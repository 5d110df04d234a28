"""The diagnosis names the rank at fault, and says 'cannot decide' when it cannot."""

from __future__ import annotations

import time

from rankscope.services.aggregator.diagnosis import Incident, Thresholds, diagnose
from rankscope.services.aggregator.store import EntryStore
from rankscope.services.aggregator.views import ClusterState
from rankscope.shared.wire import (
    AttrValue,
    Finding,
    FindingKind,
    FlightEntry,
    InstanceReleased,
    MemorySampled,
    MlxMemorySnapshot,
    Phase,
    PhaseEntries,
    RankRole,
    ReleaseCause,
    RunnerStatusChanged,
    RunnerStatusKind,
    UnreachableNode,
)
from tests.aggregator.builders import at, entries, placed, rank, status

LIMITS = Thresholds(working=10, loading=300, no_data=30, silent=5)


class Clock:
    """The aggregator's clock, which tells `state` when what it folds from then on arrives
    (as ingest does), and the incidents it has open (as its service keeps them)."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self.now = 1000.0
        self.incidents: dict[str, Incident] = {}

    @property
    def now(self) -> float:
        return self._now

    @now.setter
    def now(self, moment: float) -> None:
        self._now = moment
        self.state.arrive(moment, time.time())


def _setup(world: int = 2) -> tuple[ClusterState, Clock]:
    state = ClusterState(store=EntryStore())
    clock = Clock(state)
    state.apply_placement(placed(world=world))
    return state, clock


def _run(state: ClusterState, clock: Clock) -> list[Finding]:
    clock.incidents = diagnose(
        state,
        now=clock.now,
        wall=at(clock.now - 1000),
        incidents=clock.incidents,
        placed_at=lambda i: 990.0,
        thresholds=LIMITS,
    )
    return [i.finding for i in clock.incidents.values()]


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
    assert "rank 0 (node-0) went silent in decode_stream at step 5, last heard" in finding.summary
    assert finding.summary.endswith(
        f"last heard {at(0)[11:19]}Z; rank 1 (node-1) waiting in decode_stream at step 5"
    )


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
    assert f"rank 1 (node-1) went silent in idle, last heard {at(0)[11:19]}Z" in finding.summary


def test_a_rank_waiting_in_its_ring_s_connect_for_a_peer_still_starting_is_not_frozen() -> None:
    """MLX holds the interpreter's lock while a rank connects its ring, so the rank samples
    nothing until its peers come: silent there, it waits; it is not frozen."""
    state, clock = _setup()
    state.apply_telemetry(status(rank(0), 0, RunnerStatusKind.CONNECTING))
    state.apply_telemetry(entries(rank(0), (1, 1, Phase.CONNECT_GROUP, None)))
    state.apply_telemetry(entries(rank(1), (0, 1, Phase.CREATED, None)))
    clock.now += 20
    _sample(state, 1, 1)  # still importing, sampling as it does
    assert _run(state, clock) == []
    state.apply_telemetry(status(rank(0), 2, RunnerStatusKind.CONNECTED))  # then stopped
    clock.now += 6
    _sample(state, 1, 2)
    (finding,) = _run(state, clock)
    assert (finding.kind, finding.culpritRanks) == (FindingKind.STALLED_RANK, [0])


def test_a_rank_connecting_to_a_peer_never_heard_of_names_that_peer() -> None:
    state, clock = _setup()
    state.apply_telemetry(status(rank(0), 0, RunnerStatusKind.CONNECTING))
    state.apply_telemetry(entries(rank(0), (1, 1, Phase.CONNECT_GROUP, None)))
    clock.now += 10
    assert _run(state, clock) == []  # the peer may be starting yet
    clock.now += 11  # 31 s since its placement
    (finding,) = _run(state, clock)
    assert (finding.kind, finding.culpritRanks) == (FindingKind.MISSING_DATA, [1])


STORED = 1_800_000_000 * 10**9
"""When NATS stored the ranks' first messages (ns since the epoch)."""


def _sample_stored(state: ClusterState, r: int, seq: int, stored_s: float) -> None:
    memory = MlxMemorySnapshot(generatedAt=at(seq), source="mlx.core")
    event = MemorySampled(runner=rank(r), seq=seq, snapshot=memory)
    state.apply_telemetry(event, stored_ns=STORED + int(stored_s * 1e9))


def _idle_stored(state: ClusterState) -> None:
    for r in (0, 1):
        state.apply_telemetry(entries(rank(r), (0, 1, Phase.IDLE, None)), stored_ns=STORED)


def test_ranks_read_late_by_a_busy_aggregator_are_not_frozen() -> None:
    state, clock = _setup()
    _idle_stored(state)
    clock.now += 6  # busy: it read nothing for 6 s of its own clock
    _sample_stored(state, 0, 1, 0.2)  # stored a moment after rank 1's last, read only now
    assert _run(state, clock) == []


def test_a_rank_silent_by_nats_clock_while_its_peer_talks_is_frozen_however_late_read() -> None:
    state, clock = _setup()
    _idle_stored(state)
    _sample_stored(state, 0, 1, 6)  # rank 0 spoke 6 s after rank 1 last did: read at once
    (finding,) = _run(state, clock)
    assert finding.culpritRanks == [1]
    assert finding.kind is FindingKind.STALLED_RANK
    assert f"rank 1 (node-1) went silent in idle, last heard {at(-6)[11:19]}Z" in finding.summary


def test_an_idle_rank_while_its_peer_waits_in_a_collective_is_behind() -> None:
    state, clock = _setup()
    state.apply_telemetry(entries(rank(1), (0, 1, Phase.IDLE, None)))
    state.apply_telemetry(entries(rank(0), (0, 1, Phase.TASK_AGREEMENT, None)))
    clock.now += 11
    (finding,) = _run(state, clock)
    assert finding.kind is FindingKind.RANK_DISAGREEMENT
    assert finding.culpritRanks == [1]


def test_a_rank_held_behind_then_found_silent_is_the_same_incident_now_a_stall() -> None:
    state, clock = _setup()
    state.apply_telemetry(entries(rank(1), (0, 1, Phase.IDLE, None)), stored_ns=STORED)
    state.apply_telemetry(entries(rank(0), (0, 1, Phase.TASK_AGREEMENT, None)), stored_ns=STORED)
    clock.now += 11
    _sample_stored(state, 0, 2, 1)  # rank 0 waits, still talking; rank 1 quiet 1 s so far
    (held,) = _run(state, clock)
    assert (held.kind, held.culpritRanks) == (FindingKind.RANK_DISAGREEMENT, [1])
    clock.now += 5
    _sample_stored(state, 0, 3, 6)  # rank 1 now silent for 6 s by NATS's clock: frozen
    (frozen,) = _run(state, clock)
    assert (frozen.kind, frozen.culpritRanks) == (FindingKind.STALLED_RANK, [1])
    assert frozen.since == held.since


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


def test_a_rank_stopped_on_purpose_is_not_silent_while_its_peer_goes_on() -> None:
    state, clock = _setup()
    _idle_stored(state)
    # rank 1's agent stops it (Ctrl-C, a restart, a release) a moment before rank 0's
    state.apply_telemetry(entries(rank(1), (1, 2, Phase.SHUTDOWN_CLEANUP, None)), stored_ns=STORED)
    state.apply_telemetry(status(rank(1), 3, RunnerStatusKind.SHUTDOWN), stored_ns=STORED)
    _sample_stored(state, 0, 1, 6)
    clock.now += 6
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
    state, clock = _setup()
    for r in (0, 1):
        state.apply_telemetry(entries(rank(r), (0, 1, Phase.DECODE_STREAM, 5)))
    state.unreachable = {"node-0": UnreachableNode(nodeId="node-0", error="silent")}
    (finding,) = _run(state, clock)
    assert (finding.kind, finding.culpritRanks) == (FindingKind.DEAD_RANK, [0])
    assert "node unreachable" in finding.summary


def test_a_rank_that_speaks_after_its_node_was_found_unreachable_is_not_dead() -> None:
    state, clock = _setup()
    _idle_stored(state)
    silent = {"node-0": UnreachableNode(nodeId="node-0", error="no agent answers")}
    state.set_unreachable(silent, asked_ns=STORED + 10**9)  # asked as its agent restarted
    (finding,) = _run(state, clock)
    assert (finding.kind, finding.culpritRanks) == (FindingKind.DEAD_RANK, [0])
    _sample_stored(state, 0, 1, 2)  # its new agent relays its runner a moment later
    _sample_stored(state, 1, 1, 2)
    assert _run(state, clock) == []


def test_ranks_without_any_data_mean_cannot_decide() -> None:
    state, clock = _setup(world=3)
    state.apply_telemetry(entries(rank(0, world=3), (0, 1, Phase.DECODE_STREAM, 5)))
    clock.now = 990 + 31
    (finding,) = _run(state, clock)
    assert finding.kind is FindingKind.MISSING_DATA
    assert finding.summary == "cannot decide: no data from rank 1 (node-1), rank 2 (node-2)"


def _said(r: int, seq: int, t: float, phase: Phase, event: str, **attrs: AttrValue) -> PhaseEntries:
    return PhaseEntries(
        runner=rank(r),
        entries=[FlightEntry(seq=seq, at=at(t), phase=phase, event=event, attrs=dict(attrs))],
    )


class Hang:
    """Both ranks idle; then rank 1 freezes (SIGSTOP) and rank 0 waits on it in the task
    agreement, times out after 60 s, restarts and waits again in the ring connect."""

    def __init__(self) -> None:
        self.state, self.clock = _setup()
        self.seqs = [2, 2]
        for r in (0, 1):
            self.state.apply_telemetry(entries(rank(r), (0, 0, Phase.IDLE, None)))
            _sample(self.state, r, 1)

    def tell(self, r: int, event: PhaseEntries | RunnerStatusChanged | None = None) -> None:
        """Rank `r` samples its memory (it is alive), and says `event`."""
        if event is not None:
            self.state.apply_telemetry(event)
        _sample(self.state, r, self.seqs[r])
        self.seqs[r] += 1

    def seq(self, r: int) -> int:
        self.seqs[r] += 1
        return self.seqs[r] - 1

    def run(self, seconds: int) -> list[tuple[int, list[Finding]]]:
        """The hang's first `seconds`, diagnosed every second: (second, findings) each."""
        named = []
        for second in range(1, seconds + 1):
            self.clock.now = 1000.0 + second
            self.rank0(second)
            named.append((second, _run(self.state, self.clock)))
        return named

    def collective(self, t: float, phase: Phase, event: str, site: str, limit: float) -> None:
        """Rank 0 says `event` of the collective at `site`."""
        said = _said(0, self.seq(0), t, phase, event, site=site, timeoutSeconds=limit)
        self.state.apply_telemetry(said)

    def rank0(self, second: int) -> None:
        """What the waiting rank 0 says in `second` of the hang."""
        t = float(second)
        if second == 2:
            self.collective(t, Phase.TASK_AGREEMENT, "collective_wait", "task_agreement", 60)
        elif second == 60:  # its watchdog gives up: breadcrumb, exit 75, restart
            self.collective(t, Phase.TASK_AGREEMENT, "pipeline_eval_timeout", "task_agreement", 60)
            failed = status(
                rank(0),
                self.seq(0),
                RunnerStatusKind.FAILED,
                alive=False,
                detail="watchdog: a collective did not finish in time; restarting",
            )
            self.state.apply_telemetry(failed)
            return  # and not a word until the new process has imported mlx
        elif 60 < second < 68:
            return
        elif second == 68:
            self.state.apply_telemetry(status(rank(0), self.seq(0), RunnerStatusKind.CONNECTING))
            self.state.apply_telemetry(_said(0, self.seq(0), t, Phase.CONNECT_GROUP, "init"))
        elif second == 70:
            self.collective(t, Phase.CONNECT_GROUP, "collective_wait", "connect_group", 120)
        self.tell(0)


def test_a_hang_longer_than_the_collective_timeout_keeps_naming_the_silent_rank() -> None:
    hang = Hang()
    named = hang.run(150)  # sampled every second for 150 s
    quiet = [s for s, findings in named if not findings]
    assert quiet == [1, 2, 3, 4, 5]  # silent for 5 s is not yet frozen
    findings = [f for _, fs in named for f in fs]
    assert {(f.kind, tuple(f.culpritRanks)) for f in findings} == {(FindingKind.STALLED_RANK, (1,))}
    assert {f.since for f in findings} == {at(6)}  # one incident, from its first second
    assert all(f.waitingRanks == [0] for f in findings)
    waiter = {s: next(e for e in fs[0].evidence if e.deviceRank == 0) for s, fs in named if fs}
    assert waiter[30].waitingIn == "task_agreement"
    assert waiter[30].role is RankRole.WAITING
    assert waiter[64].processAlive is False
    assert waiter[64].gaveUp == "timed out in task_agreement after 60s at 12:01:00Z"
    assert (waiter[64].exitReason or "").startswith("watchdog")
    assert waiter[100].gaveUp == waiter[64].gaveUp  # restarted, and kept
    assert waiter[100].waitingIn == "connect_group"
    (last,) = named[-1][1]
    assert last.summary == (
        f"rank 1 (node-1) went silent in idle, last heard {at(0)[11:19]}Z; rank 0 (node-0) "
        "timed out in task_agreement after 60s at 12:01:00Z, waiting in connect_group"
    )


def test_the_incident_ends_when_its_culprit_moves_again() -> None:
    hang = Hang()
    hang.run(30)
    assert _run(hang.state, hang.clock)
    hang.tell(1, _said(1, hang.seq(1), 31, Phase.TASK_AGREEMENT, "collective_resumed"))
    hang.clock.now += 1
    assert _run(hang.state, hang.clock) == []


def test_a_stalled_culprit_confirmed_dead_opens_a_death_naming_it() -> None:
    hang = Hang()
    (stall,) = hang.run(30)[-1][1]
    assert stall.kind is FindingKind.STALLED_RANK
    killed = status(
        rank(1), hang.seq(1), RunnerStatusKind.FAILED, alive=False, detail="killed by SIGKILL"
    )
    hang.state.apply_telemetry(killed)
    hang.clock.now += 1
    (death,) = _run(hang.state, hang.clock)
    assert (death.kind, death.culpritRanks) == (FindingKind.DEAD_RANK, [1])
    assert death.since != stall.since


def test_a_victim_that_timed_out_is_never_named_while_its_peer_is_silent() -> None:
    state, clock = _setup()
    for r in (0, 1):
        state.apply_telemetry(entries(rank(r), (0, 0, Phase.IDLE, None)))
    timeout = _said(
        0,
        1,
        60,
        Phase.TASK_AGREEMENT,
        "pipeline_eval_timeout",
        site="task_agreement",
        timeoutSeconds=60,
    )
    state.apply_telemetry(timeout)
    state.apply_telemetry(status(rank(0), 2, RunnerStatusKind.FAILED, alive=False))
    clock.now += 60  # neither says a word: the victim is down, the culprit frozen
    (finding,) = _run(state, clock)
    assert (finding.kind, finding.culpritRanks) == (FindingKind.STALLED_RANK, [1])


def test_a_victim_stays_a_victim_until_it_is_ready_again() -> None:
    state, _ = _setup()
    state.apply_telemetry(_said(0, 0, 1, Phase.TASK_AGREEMENT, "pipeline_eval_timeout"))
    assert state.runners["i-r0"].gave_up is not None
    state.apply_telemetry(_said(0, 1, 2, Phase.CREATED, "process_started"))
    assert state.runners["i-r0"].gave_up is not None
    state.apply_telemetry(_said(0, 2, 3, Phase.IDLE, "runner_ready"))
    assert state.runners["i-r0"].gave_up is None


def test_the_incident_outlasts_a_moment_when_every_rank_is_quiet() -> None:
    hang = Hang()
    (before,) = hang.run(30)[-1][1]
    hang.clock.now += 10  # the waiting rank's samples are late too: both look frozen
    (during,) = _run(hang.state, hang.clock)
    assert (during.culpritRanks, during.since) == ([1], before.since)


def test_a_rank_that_lost_its_peer_is_a_victim_even_when_it_says_so_last() -> None:
    state, clock = _setup()
    for r in (0, 1):
        state.apply_telemetry(entries(rank(r), (0, 1, Phase.DECODE_STREAM, 5)))
    # node-1 and its rank die; rank 0's ring breaks and it exits: its exit arrives first
    state.apply_telemetry(
        status(rank(0), 1, RunnerStatusKind.FAILED, alive=False, detail="exit code 1")
    )
    (first,) = _run(state, clock)
    assert first.culpritRanks == [0]  # all that is known yet
    state.apply_telemetry(_said(0, 2, 2, Phase.ERROR, "peer_lost", site="decode_stream"))
    state.unreachable = {"node-1": UnreachableNode(nodeId="node-1", error="silent")}
    clock.now += 1
    (finding,) = _run(state, clock)
    assert (finding.kind, finding.culpritRanks, finding.waitingRanks) == (
        FindingKind.DEAD_RANK,
        [1],
        [0],
    )
    (victim,) = [e for e in finding.evidence if e.deviceRank == 0]
    assert victim.gaveUp == "lost its peer in decode_stream at 12:00:02Z"
    assert victim.role is RankRole.WAITING


def test_a_second_rank_found_dead_widens_the_incident_it_does_not_start_another() -> None:
    state, clock = _setup(world=3)
    for r in range(3):
        state.apply_telemetry(entries(rank(r, world=3), (0, 1, Phase.DECODE_STREAM, 5)))
    state.unreachable = {"node-1": UnreachableNode(nodeId="node-1", error="silent")}
    (first,) = _run(state, clock)
    clock.now += 1
    state.unreachable["node-2"] = UnreachableNode(nodeId="node-2", error="silent")
    (wider,) = _run(state, clock)
    assert (first.culpritRanks, wider.culpritRanks) == ([1], [1, 2])
    assert wider.since == first.since


def test_instances_judged_in_slices_are_judged_as_they_are_now() -> None:
    state, clock = _setup()
    state.apply_placement(placed("j"))
    state.apply_placement(placed("k"))
    for name in ("i", "j"):
        state.apply_telemetry(entries(rank(0, name), (0, 1, Phase.PREFILL_PIPELINE, 7)))
        state.apply_telemetry(entries(rank(1, name), (0, 1, Phase.DECODE_BARRIER, 8)))
    stale = placed("i", world=3)  # picked for a slice; placed as 2 ranks since
    released = InstanceReleased(
        at=at(1), instanceId="k", cause=ReleaseCause.SPEC_DELETED, reason="spec deleted"
    )
    slices = [[stale], [state.instances["j"], state.instances["k"]]]
    state.apply_placement(released)  # k released after it was picked
    clock.now += 11
    found = {
        instance_id: incident.finding
        for part in slices
        for instance_id, incident in diagnose(
            state,
            now=clock.now,
            wall=at(0),
            incidents={},
            placed_at=lambda i: 990.0,
            thresholds=LIMITS,
            instances=part,
        ).items()
    }
    assert sorted(found) == ["i", "j"]
    assert [e.runnerId for e in found["i"].evidence] == ["i-r0", "i-r1"]  # as placed now
