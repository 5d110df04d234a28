"""A PyTorch job's loaded Flight Recorder dumps (`rankscope fr load`) as the aggregator
keeps a job: an instance of its ranks (recorded, from a dump: never probed nor judged
live), each rank's entries, and the dumps' verdict as an incident, opened where the job
began to wait and closed as it was loaded. Pure: the load in, what to fold and publish out.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from rankscope.shared.wire import (
    Finding,
    FindingKind,
    InstanceCreated,
    PhaseEntries,
    RankEvidence,
    RankRole,
    RunnerAssignment,
    RunnerRef,
    incident_id,
)
from rankscope.shared.wire.events import RecordedProgram
from rankscope.shared.wire.fr import FrLoad, FrRank, FrVerdict

__all__ = ["DUMP_NODE", "Loaded", "loaded"]

DUMP_NODE = "dump"
"""The node a loaded rank is shown on: it ran on a machine rankscope never heard from."""
MODEL = "pytorch"


@dataclass(frozen=True, slots=True)
class Loaded:
    """What a load puts in the views, and the words its incident is published in."""

    instance: InstanceCreated
    batches: list[PhaseEntries]
    incident: list[Finding]
    """Opened then cleared; none when nothing in the dumps waits."""


def _runner(job: str, rank: int, world: int) -> RunnerRef:
    return RunnerRef(
        runnerId=f"{job}-0-{rank}",
        nodeId=DUMP_NODE,
        instanceId=job,
        modelId=MODEL,
        deviceRank=rank,
        worldSize=world,
    )


def _evidence(rank: FrRank, ref: RunnerRef) -> RankEvidence:
    waiting = rank.waitingIn
    return RankEvidence(
        runnerId=ref.runnerId,
        nodeId=ref.nodeId,
        deviceRank=rank.rank,
        role=RankRole.CULPRIT if rank.role == "culprit" else RankRole.WAITING,
        waitingIn=f"{waiting.op} #{waiting.seq} (group {waiting.group})" if waiting else None,
        step=waiting.seq if waiting else None,
        exitReason="no dump was read for it" if rank.dump is None else None,
        stack="\n".join(["Where it issued the collective (Flight Recorder):", *rank.stack])
        if rank.stack
        else None,
    )


def _incident(load: FrLoad, refs: dict[int, RunnerRef]) -> list[Finding]:
    verdict: FrVerdict = load.verdict
    involved = [r for r in verdict.ranks if r.role in ("culprit", "waiting")]
    if not involved:
        return []
    began = [r.waitingIn.createdAt for r in involved if r.waitingIn and r.waitingIn.createdAt]
    since = min(began, default=load.loadedAt)
    kind = (
        FindingKind.RANK_DISAGREEMENT
        if verdict.mismatches and not verdict.stuck
        else FindingKind.STALLED_RANK
    )
    opened = Finding(
        instanceId=load.jobId,
        kind=kind,
        culpritRanks=verdict.culprits,
        culpritRunnerIds=[refs[r].runnerId for r in verdict.culprits if r in refs],
        waitingRanks=[r.rank for r in involved if r.role == "waiting"],
        summary=f"From Flight Recorder dumps ({load.files or 'loaded'}): {verdict.summary}",
        since=since,
        evidence=[_evidence(r, refs[r.rank]) for r in involved if r.rank in refs],
        incidentId=incident_id(load.jobId, since),
    )
    cleared = msgspec.structs.replace(opened, open=False, clearedAt=max(load.loadedAt, since))
    return [opened, cleared]


def loaded(load: FrLoad) -> Loaded:
    """The views' share of `load` and its incident."""
    shown = sorted({r.rank for r in load.verdict.ranks} | {r.rank for r in load.ranks})
    world = shown[-1] + 1
    refs = {rank: _runner(load.jobId, rank, world) for rank in shown}
    instance = InstanceCreated(
        at=load.loadedAt,
        instanceId=load.jobId,
        runnerSpecId=load.jobId,
        modelId=MODEL,
        assignments=[
            RunnerAssignment(
                runnerId=refs[rank].runnerId,
                nodeId=DUMP_NODE,
                deviceRank=rank,
                worldSize=world,
                startLayer=0,
                endLayer=1,
                nLayers=1,
                host="",
                port=0,
            )
            for rank in shown
        ],
        recorded=RecordedProgram(ranks=[], dump=load.files or "Flight Recorder dumps"),
    )
    batches = [
        PhaseEntries(runner=refs[r.rank], entries=r.entries) for r in load.ranks if r.entries
    ]
    return Loaded(instance, batches, _incident(load, refs))
