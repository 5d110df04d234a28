"""Recorded jobs: announced once every rank registered, one identity per rank whatever
it retries, a new run a new instance, released once every rank ended; a job belongs to its
nodes, what one node holds is capped, and what never completes or reports goes."""

from __future__ import annotations

import msgspec

from rankscope.services.ranktable.recorded import (
    LINGER_S,
    RecordedJobs,
    RecordLimits,
    release_due,
)
from rankscope.services.ranktable.state import PlacementState, apply_placement
from rankscope.shared.jetstream import PLACEMENT_MAX_MESSAGE
from rankscope.shared.timestamps import to_epoch
from rankscope.shared.wire import (
    MAX_COMMAND,
    MAX_WORLD,
    InstanceCreated,
    RecordedRank,
    RunnerStatusChanged,
    RunnerStatusKind,
    encode,
)
from tests.aggregator.builders import at, placed, rank

LIMITS = RecordLimits(ranks_per_node=3, deadline_s=60.0)
START = to_epoch(at(0))


def _rank(
    r: int, world: int = 2, pid: int = 100, job: str = "train-7", node: str | None = None
) -> RecordedRank:
    return RecordedRank(
        jobId=job,
        nodeId=node or f"node-{r}",
        deviceRank=r,
        worldSize=world,
        pid=pid + r,
        host="10.0.0.1",
        port=5000 + r,
        command="python train.py",
        startedAt=at(pid),
    )


class Service:
    """The pure parts as the service drives them: registrations, then the events applied."""

    def __init__(self) -> None:
        self.jobs = RecordedJobs(limits=LIMITS)
        self.state = PlacementState()
        self.seq = 0

    def register(self, rank: RecordedRank, after: float = 0.0) -> tuple[str | None, list[str]]:
        decision = self.jobs.register(
            rank, self.state.instances, self.state.attempts, START + after
        )
        for event in decision.publish:
            self.seq += 1
            self.state = apply_placement(self.state, event, self.seq)
        kinds = [type(e).__name__ for e in decision.publish]
        return (decision.runner.runnerId if decision.runner else decision.refused), kinds


def test_a_job_is_announced_once_its_whole_world_registered() -> None:
    service = Service()
    assert service.register(_rank(1)) == ("train-7-0-1", [])
    assert service.register(_rank(1)) == ("train-7-0-1", [])  # a retry
    assert service.register(_rank(0)) == ("train-7-0-0", ["InstanceCreated"])
    job = service.state.instances["train-7"]
    assert job.recorded is not None
    assert [a.runnerId for a in job.assignments] == ["train-7-0-0", "train-7-0-1"]
    assert [(a.nodeId, a.port) for a in job.assignments] == [("node-0", 5000), ("node-1", 5001)]
    assert service.register(_rank(0)) == ("train-7-0-0", [])  # asked again once announced


def test_a_rank_hears_its_job_is_announced_only_once_it_is() -> None:
    jobs, state = RecordedJobs(), PlacementState()
    first = jobs.register(_rank(1), state.instances, state.attempts, START)
    assert (first.announced, first.publish) == (False, ())  # its telemetry would be refused
    last = jobs.register(_rank(0), state.instances, state.attempts, START)
    assert last.announced
    state = apply_placement(state, last.publish[0], 1)
    again = jobs.register(_rank(1), state.instances, state.attempts, START)
    assert (again.announced, again.runner) == (True, first.runner)


def test_a_new_run_of_a_job_ends_the_old_one_and_gets_new_identities() -> None:
    service = Service()
    service.register(_rank(0))
    service.register(_rank(1))
    runner, kinds = service.register(_rank(0, pid=200))
    assert (runner, kinds) == ("train-7-1-0", ["InstanceReleased"])
    assert "train-7" not in service.state.instances
    assert service.register(_rank(1, pid=200)) == ("train-7-1-1", ["InstanceCreated"])
    assert service.state.instances["train-7"].attempt == 1


def test_ranks_of_an_earlier_start_are_not_mixed_into_a_new_one() -> None:
    service = Service()
    service.register(_rank(0, world=3))
    service.register(_rank(0, world=2, pid=300))  # restarted smaller before it was whole
    assert service.register(_rank(1, world=2, pid=300))[1] == ["InstanceCreated"]
    assert len(service.state.instances["train-7"].assignments) == 2


def test_nonsense_and_a_spec_s_instance_are_refused() -> None:
    service = Service()
    outside = msgspec.structs.replace(_rank(0), deviceRank=2)
    assert service.register(outside) == ("rank 2 is outside a world of 2", [])
    for bad in ("../../etc", "", "x" * 500):
        refused, _ = service.register(_rank(0, job=bad))
        assert refused is not None
        assert refused.startswith("job id"), refused
    service.state = apply_placement(service.state, placed(instance="i-0"), 1)
    taken = service.register(_rank(0, job="i-0"))
    assert taken == ("'i-0' is an instance of Runner spec spec", [])


def test_another_node_can_neither_replace_nor_join_a_live_job() -> None:
    service = Service()
    service.register(_rank(0))
    service.register(_rank(1))
    for forged in (_rank(1, pid=900, node="node-x"), _rank(0, world=3, pid=900, node="node-x")):
        refused, kinds = service.register(forged)
        assert kinds == []
        assert refused is not None
        assert "train-7 is running on node-0, node-1: node node-x may not" in refused
    job = service.state.instances["train-7"]
    assert [a.nodeId for a in job.assignments] == ["node-0", "node-1"]
    assert service.register(_rank(1, pid=300))[1] == ["InstanceReleased"]  # its own node


def test_another_node_cannot_replace_ranks_gathering_from_others() -> None:
    service = Service()
    service.register(_rank(0, world=3))
    forged = _rank(0, world=2, pid=900, node="node-x")
    refused, _ = service.register(forged)
    assert refused == (
        "job train-7 is gathering ranks from node-0: node node-x may not replace them"
    )
    assert service.register(_rank(1, world=3))[0] == "train-7-0-1"  # joining is how jobs form
    assert service.register(_rank(2, world=3))[1] == ["InstanceCreated"]


def test_a_node_holds_at_most_its_share_of_recorded_ranks() -> None:
    service = Service()
    for job in ("a", "b"):
        service.register(_rank(0, world=1, job=job, node="node-x"))
    service.register(_rank(0, world=2, job="c", node="node-x"))
    refused, _ = service.register(_rank(0, world=1, job="d", node="node-x"))
    assert refused == (
        "node node-x holds 3 recorded ranks, the most one node may "
        "(RANKSCOPE_RECORD_RANKS_PER_NODE=3)"
    )
    assert service.register(_rank(0, world=2, job="c", node="node-x"))[0] == "c-0-0"  # a retry
    assert service.register(_rank(0, world=1, job="d", node="node-y"))[0] == "d-0-0"


def test_ranks_that_stop_asking_are_forgotten_after_the_deadline() -> None:
    service = Service()
    service.register(_rank(0, world=2, job="c", node="node-x"))
    assert service.jobs.expire(START + 30) == START + 60
    assert service.jobs.expire(START + 61) is None
    assert service.jobs.gathering == {}
    assert service.register(_rank(1, world=2, job="c"), after=61) == ("c-0-1", [])


def _ended(instance: InstanceCreated, seconds: float, code: int) -> dict[str, RunnerStatusChanged]:
    return {
        a.runnerId: RunnerStatusChanged(
            runner=rank(a.deviceRank, instance=instance.instanceId),
            seq=1,
            at=at(seconds + a.deviceRank),
            statusKind=RunnerStatusKind.SHUTDOWN if code == 0 else RunnerStatusKind.FAILED,
            processAlive=False,
            exitCode=code,
        )
        for a in instance.assignments
    }


def _due(instance: InstanceCreated, status: dict[str, RunnerStatusChanged]) -> float | None:
    release = release_due(instance, status, LIMITS)
    return None if release is None else release.at


def test_a_job_goes_once_every_rank_ended_later_when_one_died() -> None:
    service = Service()
    service.register(_rank(0))
    service.register(_rank(1))
    job = service.state.instances["train-7"]
    clean = _ended(job, 10, 0)
    assert _due(job, clean) == to_epoch(at(11))
    failed = _ended(job, 10, 1)
    assert _due(job, failed) == to_epoch(at(11)) + LINGER_S
    first = job.assignments[0].runnerId
    running = {**clean, first: msgspec.structs.replace(clean[first], processAlive=True)}
    assert _due(job, running) is None
    assert _due(placed(), clean) is None  # a spec's instance is not a recorded job


def test_a_job_the_user_stopped_goes_at_once() -> None:
    service = Service()
    service.register(_rank(0))
    service.register(_rank(1))
    job = service.state.instances["train-7"]
    stopped = {
        runner: msgspec.structs.replace(ended, stoppedByUser=True, signal="SIGINT", exitCode=None)
        for runner, ended in _ended(job, 10, 1).items()
    }
    assert _due(job, stopped) == to_epoch(at(11))  # no lingering: nothing to diagnose


def test_a_job_a_rank_never_reported_to_goes_after_the_deadline() -> None:
    service = Service()
    service.register(_rank(0))
    service.register(_rank(1))
    job = service.state.instances["train-7"]
    first = job.assignments[0].runnerId
    running = {first: msgspec.structs.replace(_ended(job, 10, 0)[first], processAlive=True)}
    release = release_due(job, running, LIMITS)
    assert release is not None
    assert release.at == to_epoch(job.at) + 60
    assert release.reason == "rank 1 of job train-7 never reported within 60 s of its announcement"


def test_the_announcement_of_the_largest_world_fits_one_placement_message() -> None:
    jobs, state = RecordedJobs(limits=RecordLimits(ranks_per_node=MAX_WORLD)), PlacementState()
    for r in range(MAX_WORLD):
        wide = msgspec.structs.replace(
            _rank(r, world=MAX_WORLD, job="j" * 400, node=f"{r % 64}".rjust(480, "n")),
            host="h" * 255,
            pid=1 << 22,
            command="c" * MAX_COMMAND,
        )
        decision = jobs.register(wide, state.instances, state.attempts, START)
    (created,) = decision.publish
    assert isinstance(created, InstanceCreated)
    assert len(encode(created)) <= PLACEMENT_MAX_MESSAGE
