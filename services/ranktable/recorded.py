"""Recorded jobs (`rankscope record`): ranks of a program rankscope did not start register
themselves; once every rank of the world has, the job is announced as an instance like a
placed one, and once every rank has ended, it is released. Pure: registrations, the live
instances and the time in, decisions out.

A job belongs to the nodes its ranks registered from: no other node may replace, release
or join it while it lives. What one node may hold (ranks gathering or live) is capped, and
what never finishes registering, or never reports once announced, goes after a deadline.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from rankscope.shared.specs import id_problem
from rankscope.shared.timestamps import from_micros, to_epoch
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

__all__ = ["LINGER_S", "Decision", "RecordLimits", "RecordedJobs", "Release", "release_due"]

ANNOUNCED_COMMAND = 256
"""How much of each rank's command line its job's announcement carries (what `rankscope
record` sends): the announcement of the largest world stays a few MB."""
LINGER_S = 30.0
"""How long a recorded job whose rank died stays live after its last rank ended."""


@dataclass(frozen=True, slots=True)
class RecordLimits:
    """What recorded jobs may take of the rank-table service (`RANKSCOPE_RECORD_*`)."""

    ranks_per_node: int = 256
    """Recorded ranks one node may hold at once, gathering or live."""
    deadline_s: float = 120.0
    """How long a registered rank may go without asking again while its job gathers, and
    an announced rank without its first report, before it is dropped."""


@dataclass(frozen=True, slots=True)
class Decision:
    """What one registration comes to: the rank's identity (or why it has none), and the
    placement events to publish first, in order."""

    runner: RunnerRef | None
    refused: str | None = None
    publish: tuple[InstanceCreated | InstanceReleased, ...] = ()
    announced: bool = False
    """Whether the rank's job is announced once `publish` is."""


@dataclass(frozen=True, slots=True)
class Release:
    """A recorded job due to go: when (seconds since the epoch) and why."""

    at: float
    cause: ReleaseCause
    reason: str


@dataclass(slots=True)
class _Asked:
    rank: RecordedRank
    last: float
    """When it last asked (seconds since the epoch)."""


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


def _nodes(ranks: list[RecordedRank]) -> str:
    return ", ".join(sorted({r.nodeId for r in ranks}))


def _stamp(moment: float) -> str:
    return from_micros(int(moment * 1_000_000))


@dataclass(slots=True)
class RecordedJobs:
    """Jobs whose ranks are still registering (the announced ones live in the placement
    state, so a restarted service knows them from the stream)."""

    limits: RecordLimits = field(default_factory=RecordLimits)
    gathering: dict[str, dict[int, _Asked]] = field(default_factory=dict)

    def register(
        self,
        rank: RecordedRank,
        instances: dict[str, InstanceCreated],
        attempts: dict[str, int],
        moment: float,
    ) -> Decision:
        """Take `rank`'s registration at `moment` (seconds since the epoch), given the
        live instances and the placements made so far per instance id."""
        self.expire(moment)
        if (problem := id_problem(rank.jobId)) is not None:
            return Decision(None, f"job {problem}")
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
            if rank.nodeId not in {r.nodeId for r in known}:
                return Decision(
                    None,
                    f"job {job_id} is running on {_nodes(known)}: node {rank.nodeId} may not "
                    "replace or join it (a new run of the job may start once it ended)",
                )
            released = (  # a new run of the job from a node of the old one: that one is over
                InstanceReleased(
                    at=_stamp(moment),
                    instanceId=job_id,
                    cause=ReleaseCause.JOB_ENDED,
                    reason=f"a new run of job {job_id} started on {rank.nodeId}",
                ),
            )
        ranks = self.gathering.get(job_id, {})
        held = [asked.rank for asked in ranks.values()]
        slot = ranks.get(rank.deviceRank)
        earlier = any(r.worldSize != rank.worldSize for r in held) or (
            slot is not None and not _same_run(slot.rank, rank)
        )
        if earlier and rank.nodeId not in {r.nodeId for r in held}:
            return Decision(
                None,
                f"job {job_id} is gathering ranks from {_nodes(held)}: node {rank.nodeId} "
                "may not replace them",
            )
        retry = slot is not None and not earlier
        if not retry and (crowd := self._held_by(rank.nodeId, instances)) >= (
            cap := self.limits.ranks_per_node
        ):
            return Decision(
                None,
                f"node {rank.nodeId} holds {crowd} recorded ranks, the most one node may "
                f"(RANKSCOPE_RECORD_RANKS_PER_NODE={cap})",
            )
        if earlier:
            ranks = {}  # what gathered belongs to an earlier run
        ranks[rank.deviceRank] = _Asked(rank, moment)
        self.gathering[job_id] = ranks
        if len(ranks) < rank.worldSize:
            return Decision(_ref(rank, attempt), publish=released)
        del self.gathering[job_id]
        ordered = [ranks[r].rank for r in range(rank.worldSize)]
        created = InstanceCreated(
            at=_stamp(moment),
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
            recorded=RecordedProgram(
                ranks=[
                    msgspec.structs.replace(r, command=r.command[:ANNOUNCED_COMMAND])
                    for r in ordered
                ]
            ),
        )
        return Decision(_ref(rank, attempt), publish=(*released, created), announced=True)

    def expire(self, moment: float) -> float | None:
        """Drop the gathering ranks that stopped asking a deadline ago; when the next one
        may go (None: none gathers)."""
        deadline = self.limits.deadline_s
        for job_id in list(self.gathering):
            ranks = self.gathering[job_id]
            for number in [n for n, a in ranks.items() if moment - a.last > deadline]:
                del ranks[number]
            if not ranks:
                del self.gathering[job_id]
        lasts = [a.last for ranks in self.gathering.values() for a in ranks.values()]
        return min(lasts) + deadline if lasts else None

    def _held_by(self, node_id: str, instances: dict[str, InstanceCreated]) -> int:
        gathering = sum(
            a.rank.nodeId == node_id for ranks in self.gathering.values() for a in ranks.values()
        )
        live = sum(
            r.nodeId == node_id
            for i in instances.values()
            if i.recorded is not None
            for r in i.recorded.ranks
        )
        return gathering + live


def release_due(
    instance: InstanceCreated,
    status: dict[str, RunnerStatusChanged],
    limits: RecordLimits,
) -> Release | None:
    """When a recorded job may be released, and why: once every rank's process is gone,
    at once when each exited cleanly or the user stopped it, else `LINGER_S` after the
    last ended, so a death
    stays in the live views long enough to be diagnosed (a launcher stops the other ranks
    the moment one dies); and a deadline after it was announced if a rank never reported.
    None while every rank runs."""
    if instance.recorded is None:
        return None
    ends = [status.get(a.runnerId) for a in instance.assignments]
    reported = [e for e in ends if e is not None]
    if len(reported) < len(ends):
        pairs = zip(instance.assignments, ends, strict=True)
        silent = [str(a.deviceRank) for a, e in pairs if e is None]
        return Release(
            to_epoch(instance.at) + limits.deadline_s,
            ReleaseCause.JOB_ENDED,
            f"rank {', '.join(silent[:8])} of job {instance.instanceId} never reported within "
            f"{limits.deadline_s:g} s of its announcement",
        )
    if any(e.processAlive for e in reported):
        return None
    last = max(to_epoch(e.at) for e in reported)
    clean = all(e.exitCode == 0 or e.stoppedByUser for e in reported)
    return Release(
        last if clean else last + LINGER_S,
        ReleaseCause.JOB_ENDED,
        f"every rank of job {instance.instanceId} ended",
    )
