"""Recorded jobs (`rankscope record`): ranks of a program rankscope did not start register
themselves; once every rank of the world has, the job is announced as an instance like a
placed one, and once every rank has ended, it is released. Pure: registrations and the
live instances in, decisions out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rankscope.shared.timestamps import now, to_epoch
from rankscope.shared.wire import (
    InstanceCreated,
    InstanceReleased,
    RecordedProgram,
    RecordedRank,
    ReleaseCause,
    RunnerAssignment,
    RunnerRef,
    RunnerStatusChanged,
)

__all__ = ["LINGER_S", "Decision", "RecordedJobs", "release_due"]

MAX_WORLD = 4096
"""The most ranks one recorded job may have (a typo cannot make a job wait for millions)."""
LINGER_S = 30.0
"""How long a recorded job whose rank died stays live after its last rank ended."""


@dataclass(frozen=True, slots=True)
class Decision:
    """What one registration comes to: the rank's identity (or why it has none), and the
    placement events to publish first, in order."""

    runner: RunnerRef | None
    refused: str | None = None
    publish: tuple[InstanceCreated | InstanceReleased, ...] = ()
    announced: bool = False
    """Whether the rank's job is announced once `publish` is."""


def _runner_id(job_id: str, attempt: int, rank: int) -> str:
    return f"{job_id}-{attempt}-{rank}"


def _same_run(a: RecordedRank, b: RecordedRank) -> bool:
    return (a.nodeId, a.pid, a.startedAt, a.worldSize) == (
        b.nodeId,
        b.pid,
        b.startedAt,
        b.worldSize,
    )


def _ref(rank: RecordedRank, attempt: int) -> RunnerRef:
    return RunnerRef(
        runnerId=_runner_id(rank.jobId, attempt, rank.deviceRank),
        nodeId=rank.nodeId,
        instanceId=rank.jobId,
        modelId=rank.jobId,
        deviceRank=rank.deviceRank,
        worldSize=rank.worldSize,
    )


@dataclass(slots=True)
class RecordedJobs:
    """Jobs whose ranks are still registering (the announced ones live in the placement
    state, so a restarted service knows them from the stream)."""

    gathering: dict[str, dict[int, RecordedRank]] = field(default_factory=dict)

    def register(
        self,
        rank: RecordedRank,
        instances: dict[str, InstanceCreated],
        attempts: dict[str, int],
    ) -> Decision:
        """Take `rank`'s registration, given the live instances and the placements made
        so far per instance id."""
        if rank.worldSize > MAX_WORLD:
            return Decision(None, f"a world of {rank.worldSize} ranks is over {MAX_WORLD}")
        if rank.deviceRank >= rank.worldSize:
            return Decision(None, f"rank {rank.deviceRank} is outside a world of {rank.worldSize}")
        job_id = rank.jobId
        live = instances.get(job_id)
        released: tuple[InstanceReleased, ...] = ()
        attempt = attempts.get(job_id, 0)
        if live is not None:
            if live.recorded is None:
                return Decision(
                    None, f"{job_id!r} is an instance of Runner spec {live.runnerSpecId}"
                )
            known = live.recorded.ranks
            if rank.deviceRank < len(known) and _same_run(known[rank.deviceRank], rank):
                return Decision(_ref(rank, live.attempt), announced=True)  # asking again
            released = (  # a new run of the job: the old one is over
                InstanceReleased(
                    at=now(),
                    instanceId=job_id,
                    cause=ReleaseCause.JOB_ENDED,
                    reason=f"a new run of job {job_id} started",
                ),
            )
        ranks = self.gathering.setdefault(job_id, {})
        other = next(iter(ranks.values()), None)
        held = ranks.get(rank.deviceRank)
        if (other is not None and other.worldSize != rank.worldSize) or (
            held is not None and not _same_run(held, rank)
        ):
            ranks.clear()  # what gathered belongs to an earlier run
        ranks[rank.deviceRank] = rank
        if len(ranks) < rank.worldSize:
            return Decision(_ref(rank, attempt), publish=released)
        del self.gathering[job_id]
        ordered = [ranks[r] for r in range(rank.worldSize)]
        created = InstanceCreated(
            at=now(),
            instanceId=job_id,
            runnerSpecId=job_id,
            modelId=job_id,
            attempt=attempt,
            assignments=[
                RunnerAssignment(
                    runnerId=_runner_id(job_id, attempt, r.deviceRank),
                    nodeId=r.nodeId,
                    deviceRank=r.deviceRank,
                    worldSize=r.worldSize,
                    startLayer=0,
                    endLayer=1,
                    nLayers=1,
                    host=r.host,
                    port=r.port,
                )
                for r in ordered
            ],
            recorded=RecordedProgram(ranks=ordered),
        )
        return Decision(_ref(rank, attempt), publish=(*released, created), announced=True)


def release_due(instance: InstanceCreated, status: dict[str, RunnerStatusChanged]) -> float | None:
    """When a recorded job may be released (seconds since the epoch): once every rank's
    process is gone, at once when each exited cleanly, else `LINGER_S` after the last
    ended, so a death stays in the live views long enough to be diagnosed (a launcher
    stops the other ranks the moment one dies). None while a rank runs."""
    if instance.recorded is None:
        return None
    ends = [status.get(a.runnerId) for a in instance.assignments]
    if any(e is None or e.processAlive for e in ends):
        return None
    last = max(to_epoch(e.at) for e in ends if e is not None)
    clean = all(e is not None and e.exitCode == 0 for e in ends)
    return last if clean else last + LINGER_S
