"""A recorded job's ranks (`rankscope record`) are judged by the collectives they wait in:
the rank at fault is named, the ranks waiting on it never are."""

from __future__ import annotations

import time

from rankscope.services.aggregator.diagnosis import Incident, Thresholds
from rankscope.services.aggregator.store import EntryStore
from rankscope.services.aggregator.views import ClusterState
from rankscope.shared.wire import (
    AttrValue,
    Finding,
    FindingKind,
    FlightEntry,
    InstanceCreated,
    MemorySampled,
    MlxMemorySnapshot,
    Phase,
    PhaseEntries,
    RecordedProgram,
    RecordedRank,
    RunnerStatusChanged,
    RunnerStatusKind,
    UnreachableNode,
)
from tests.aggregator.builders import at, judged, placed, rank

LIMITS = Thresholds(working=10, loading=300, no_data=30, silent=5)


def _recorded(world: int) -> InstanceCreated:
    plain = placed(world=world)
    ranks = [
        RecordedRank(
            jobId="i",
            nodeId=f"node-{r}",
            deviceRank=r,
            worldSize=world,
            pid=100 + r,
            host="127.0.0.1",
            command="python train.py",
            startedAt=at(0),
        )
        for r in range(world)
    ]
    return InstanceCreated(
        at=plain.at,
        instanceId=plain.instanceId,
        runnerSpecId="i",
        modelId="i",
        assignments=plain.assignments,
        recorded=RecordedProgram(ranks=ranks),
    )


class Job:
    """A recorded job of `world` ranks before an aggregator's diagnosis, its clock moved
    by hand (NATS's stored times follow it)."""

    def __init__(self, world: int = 2) -> None:
        self.now = 1000.0
        self.state = ClusterState(store=EntryStore())
        self.state.apply_placement(_recorded(world), stored_ns=self._ns())
        self.incidents: dict[str, Incident] = {}
        self.seqs = dict.fromkeys(range(world), 0)
        self.ranks = [rank(r, world=world) for r in range(world)]
        for r in range(world):
            self.entry(r, Phase.CONNECT_GROUP, "group_ready")

    def _ns(self) -> int:
        return int(self.now * 1e9)

    def _seq(self, r: int) -> int:
        self.seqs[r] += 1
        return self.seqs[r]

    def entry(self, r: int, phase: Phase, event: str, **attrs: AttrValue) -> None:
        entry = FlightEntry(
            seq=self._seq(r), at=at(self.now - 1000), phase=phase, event=event, attrs=attrs
        )
        self.state.arrive(self.now, time.time())
        self.state.apply_telemetry(
            PhaseEntries(runner=self.ranks[r], entries=[entry]), stored_ns=self._ns()
        )

    def waits(self, r: int, site: str, number: int) -> None:
        self.entry(r, Phase.DECODE_BARRIER, "collective_wait", site=site, step=number)

    def sample(self, r: int) -> None:
        snapshot = MlxMemorySnapshot(generatedAt=at(self.now - 1000), source="mlx.core")
        event = MemorySampled(runner=self.ranks[r], seq=self._seq(r), snapshot=snapshot)
        self.state.arrive(self.now, time.time())
        self.state.apply_telemetry(event, stored_ns=self._ns())

    def ends(
        self, r: int, code: int | None = None, signal: str | None = None, stopped: bool = False
    ) -> None:
        clean = code == 0 or stopped
        event = RunnerStatusChanged(
            runner=self.ranks[r],
            seq=self._seq(r),
            at=at(self.now - 1000),
            statusKind=RunnerStatusKind.SHUTDOWN if clean else RunnerStatusKind.FAILED,
            processAlive=False,
            exitCode=code,
            signal=signal,
            stoppedByUser=stopped,
        )
        self.state.arrive(self.now, time.time())
        self.state.apply_telemetry(event, stored_ns=self._ns())

    def pass_time(self, seconds: float, *, talking: tuple[int, ...]) -> None:
        """`seconds` go by a second at a time; the `talking` ranks sample their memory."""
        for _ in range(int(seconds)):
            self.now += 1.0
            for r in talking:
                self.sample(r)

    def judge(self) -> list[Finding]:
        self.incidents = judged(self.state, self.now, self.incidents, LIMITS)
        return [i.finding for i in self.incidents.values()]


def test_a_stopped_rank_is_named_and_the_ranks_waiting_on_it_are_not() -> None:
    job = Job(world=4)
    for r in (0, 1, 3):
        job.waits(r, "all_sum #417 (group world)", 417)
    job.pass_time(4, talking=(0, 1, 2, 3))
    assert job.judge() == []  # a second of waiting is not an incident
    job.pass_time(6, talking=(0, 1, 3))  # rank 2 stopped: its samples stop too
    (finding,) = job.judge()
    assert finding.kind is FindingKind.STALLED_RANK
    assert finding.culpritRanks == [2]
    assert finding.waitingRanks == [0, 1, 3]
    assert "rank 2 (node-2) went silent, last heard 12:00:04Z" in finding.summary
    assert "rank 0 (node-0) waits in all_sum #417 (group world)" in finding.summary
    job.pass_time(60, talking=(0, 1, 3))
    (still,) = job.judge()
    assert (still.culpritRanks, still.incidentId) == ([2], finding.incidentId)
    job.pass_time(1, talking=(0, 1, 2, 3))  # continued
    for r in (0, 1, 3):
        job.entry(r, Phase.IDLE, "collective_resumed")
    assert job.judge() == []


def test_a_rank_busy_outside_any_collective_holds_its_waiting_peers() -> None:
    job = Job()
    job.waits(0, "all_sum #9 (group world)", 9)
    job.pass_time(9, talking=(0, 1))  # rank 1 talks (alive) but never enters all_sum #9
    assert job.judge() == []
    job.pass_time(3, talking=(0, 1))
    (finding,) = job.judge()
    assert finding.kind is FindingKind.STALLED_RANK
    assert (finding.culpritRanks, finding.waitingRanks) == ([1], [0])
    assert finding.summary.startswith("rank 1 (node-1) outside any collective")


def test_a_killed_rank_is_named_not_the_ranks_its_launcher_stopped_after_it() -> None:
    job = Job(world=4)
    job.ends(2, code=-9, signal="SIGKILL")
    job.now += 0.01
    for r in (0, 1):
        job.ends(r, code=-15, signal="SIGTERM")  # mlx.launch stops the rest at once
    job.ends(3, code=1)  # its collective failed on the lost peer
    (finding,) = job.judge()
    assert finding.kind is FindingKind.DEAD_RANK
    assert finding.culpritRanks == [2]
    assert finding.waitingRanks == [0, 1, 3]
    assert finding.summary.startswith("rank 2 (node-2): process killed by SIGKILL")
    assert "rank 0 (node-0) killed by SIGTERM after it" in finding.summary


def test_a_job_the_user_stopped_is_no_incident_however_its_ranks_ended() -> None:
    job = Job(world=3)
    job.ends(1, code=-2, signal="SIGINT", stopped=True)
    job.ends(0, code=-6, signal="SIGABRT", stopped=True)  # mlx-lm's server on Ctrl-C
    job.pass_time(60, talking=(2,))  # one rank still shutting down, silent in a collective
    assert job.judge() == []


def test_ranks_killed_together_are_named_together() -> None:
    job = Job(world=3)
    job.ends(0, code=-9, signal="SIGKILL")
    job.ends(1, code=-9, signal="SIGKILL")
    (finding,) = job.judge()
    assert (finding.culpritRanks, finding.waitingRanks) == ([0, 1], [2])


def test_ranks_waiting_in_different_collectives_disagree_and_each_is_said() -> None:
    job = Job()
    job.waits(0, "all_sum #21 (group world)", 21)
    job.waits(1, "recv #21 (group world)", 21)
    job.pass_time(12, talking=(0, 1))
    (finding,) = job.judge()
    assert finding.kind is FindingKind.RANK_DISAGREEMENT
    assert len(finding.culpritRanks) == 1
    assert "rank 0 (node-0) in all_sum #21 (group world)" in finding.summary
    assert "rank 1 (node-1) in recv #21 (group world)" in finding.summary


def test_of_ranks_alone_at_their_sites_the_one_at_the_newest_number_is_named() -> None:
    job = Job(world=4)
    job.waits(0, "all_reduce #21 (group default_pg)", 21)
    job.waits(1, "broadcast #21 (group default_pg)", 21)
    job.waits(2, "all_reduce #20 (group default_pg)", 20)  # #20's completion said late
    job.waits(3, "all_reduce #21 (group default_pg)", 21)
    job.pass_time(12, talking=(0, 1, 2, 3))
    (finding,) = job.judge()
    assert finding.kind is FindingKind.RANK_DISAGREEMENT
    assert finding.culpritRanks == [1]


def test_a_rank_whose_news_lags_its_peers_is_named_once_its_news_comes() -> None:
    job = Job(world=4)
    for peer in (0, 2, 3):
        job.waits(peer, "all_reduce #21 (group default_pg)", 21)
    job.waits(1, "all_reduce #16 (group default_pg)", 16)  # its #16 said; #17-#21 late
    job.pass_time(12, talking=(0, 1, 2, 3))
    assert job.judge() == []  # its peers passed #16: it did too, its wait is stale news
    job.waits(1, "broadcast #21 (group default_pg)", 21)
    job.pass_time(12, talking=(0, 1, 2, 3))
    (finding,) = job.judge()
    assert finding.kind is FindingKind.RANK_DISAGREEMENT
    assert finding.culpritRanks == [1]
    assert "rank 1 (node-1) in broadcast #21 (group default_pg)" in finding.summary


def test_a_rank_that_ended_after_fewer_collectives_disagrees_with_its_waiting_peer() -> None:
    job = Job()
    job.entry(1, Phase.SHUTDOWN_CLEANUP, "program_exit", step=20)
    job.ends(1, code=0)
    job.waits(0, "all_sum #21 (group world)", 21)
    job.pass_time(12, talking=(0,))
    (finding,) = job.judge()
    assert finding.kind is FindingKind.RANK_DISAGREEMENT
    assert (finding.culpritRanks, finding.waitingRanks) == ([1], [0])
    assert "rank 1 (node-1) ended after 20 collectives" in finding.summary


def test_a_job_whose_ranks_all_wait_in_one_collective_or_ended_cleanly_is_healthy() -> None:
    job = Job()
    for r in (0, 1):
        job.waits(r, "all_gather #3 (group world)", 3)
    job.pass_time(30, talking=(0, 1))
    assert job.judge() == []  # a slow collective of everyone names nobody
    for r in (0, 1):
        job.ends(r, code=0)
    assert job.judge() == []


def test_no_agent_speaks_for_a_recorded_rank() -> None:
    job = Job()
    for _ in range(3):  # node-1's agent answers probes without it, as it never ran it
        job.state.note_listed(set(), job.state.runners.on_node("node-1"))
    unreachable = UnreachableNode(nodeId="node-0", url=None, error="no agent")
    job.state.set_unreachable({"node-0": unreachable}, asked_ns=job._ns() + 1)
    job.pass_time(20, talking=(0, 1))
    assert job.judge() == []
    assert job.state.placed_nodes() == set()  # nothing to probe for it


def test_a_wait_in_an_evaluation_whose_collectives_are_hidden_names_nobody() -> None:
    job = Job()
    job.waits(0, "all_sum #5 (group world)", 5)
    job.entry(1, Phase.DECODE_BARRIER, "collective_wait", site="item()")  # compiled code
    job.pass_time(20, talking=(0, 1))
    assert job.judge() == []
    job.entry(0, Phase.DECODE_BARRIER, "collective_wait", site="eval()")
    job.pass_time(20, talking=(0, 1))
    assert job.judge() == []  # both wait in evaluations: a slow step, not a desync


def test_the_killed_rank_is_named_even_when_its_peers_ends_were_seen_first() -> None:
    job = Job(world=3)
    job.ends(0, code=-15, signal="SIGTERM")  # its watcher woke sooner
    job.ends(1, code=1)  # failed on the lost peer
    job.now += 0.3
    job.ends(2, code=-9, signal="SIGKILL")
    (finding,) = job.judge()
    assert (finding.culpritRanks, finding.waitingRanks) == ([2], [0, 1])


def test_a_rank_that_failed_on_its_own_is_named_before_those_stopped_after_it() -> None:
    job = Job(world=3)
    job.ends(1, code=1)
    job.now += 0.05
    job.ends(0, code=-15, signal="SIGTERM")
    job.ends(2, code=-15, signal="SIGTERM")
    assert job.judge() == []  # a rank killed outright may yet be heard of
    job.pass_time(2, talking=())
    (finding,) = job.judge()
    assert finding.culpritRanks == [1]
    assert "rank 1 (node-1): process exited with status 1" in finding.summary


def test_a_peer_that_aborted_on_the_lost_rank_is_not_named_for_it() -> None:
    job = Job(world=4)
    job.ends(2, code=-6, signal="SIGABRT")  # gloo's watchdog ended it on the lost peer
    assert job.judge() == []  # the rank killed outright may yet be heard of
    job.now += 0.3
    job.ends(1, code=-9, signal="SIGKILL")
    for r in (0, 3):
        job.ends(r, code=-15, signal="SIGTERM")  # torchrun stops the rest
    (finding,) = job.judge()
    assert (finding.culpritRanks, finding.waitingRanks) == ([1], [0, 2, 3])
    assert "rank 2 (node-2) killed by SIGABRT after it" in finding.summary
