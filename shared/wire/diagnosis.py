"""Findings that name the rank at fault, and the aggregator's query shapes."""

from __future__ import annotations

import hashlib
from enum import StrEnum
from typing import Annotated

import msgspec

from rankscope.shared.timestamps import parse_ts
from rankscope.shared.wire.base import CamelStruct
from rankscope.shared.wire.enums import Phase
from rankscope.shared.wire.memory import MlxMemorySnapshot
from rankscope.shared.wire.node_diagnostics import ProcessState

__all__ = [
    "Diagnosis",
    "FaultSignature",
    "Finding",
    "FindingKind",
    "InstanceState",
    "PaceHistogram",
    "PlacementQuery",
    "QueryError",
    "RankEvidence",
    "RankPace",
    "RankRole",
    "RankState",
    "RunnerHistory",
    "SeenBefore",
    "TimelineQuery",
    "incident_id",
]


class FindingKind(StrEnum):
    """What is wrong with an instance."""

    RANK_DISAGREEMENT = "rank_disagreement"
    STALLED_RANK = "stalled_rank"
    DEAD_RANK = "dead_rank"
    MISSING_DATA = "missing_data"
    SLOW_RANK = "slow_rank"
    """A rank works slower than it usually does while its peers do not: every rank of the
    instance runs at its pace, and its peers wait for it."""
    NATS_UNREACHABLE = "nats_unreachable"
    """The aggregator cannot reach NATS: nothing can be said of any rank meanwhile (the
    finding of the whole installation, `instanceId` empty)."""
    JETSTREAM_STORAGE = "jetstream_storage"
    """NATS answers but JetStream does not store (its store or disk is full, or it is
    disabled): telemetry is lost meanwhile, so likewise nothing is said of any rank."""
    TELEMETRY_FLOOD = "telemetry_flood"
    """A node sends more than the aggregator keeps: its own oldest entries are given up
    so every other node's stay (a finding of the installation naming the node's ranks;
    its instances are judged as ever)."""


class RankRole(StrEnum):
    """A rank's part in a finding."""

    CULPRIT = "culprit"
    WAITING = "waiting"


class RankPace(CamelStruct, kw_only=True, frozen=True):
    """A rank's pace over the last window: per sampled step, the milliseconds it worked
    and waited, the work it usually does a step (its own history), and how long its peers
    waited for it."""

    steps: int
    workMs: float
    waitMs: float
    usualWorkMs: float | None = None
    """None while its history is too short to say."""
    ratio: float | None = None
    """`workMs` over `usualWorkMs`: how much slower than usual it works."""
    waitedOn: float | None = None
    """The share of the job's time spent waiting for this rank, over the steps every rank
    sampled: on those where it arrived last in their collectives, what its peers waited
    beyond its own wait (None: its job's ranks do not sample the same steps)."""
    lastArrival: float | None = None
    """The share of those steps on which it arrived last (chance: one in as many ranks)."""
    workVsPeers: float | None = None
    """Its median work a step over its peers' median of theirs."""
    layers: int | None = None
    """The layers it holds, where its job is a pipeline whose stages are compared per layer:
    `workVsPeers` is then per layer, `waitedOn` a share of the pipeline's work a step, and
    `lastArrival` the share of the span's slices in which it did the most per layer."""


class RankEvidence(CamelStruct, kw_only=True, frozen=True):
    """What one rank looked like when the finding was made."""

    runnerId: str
    nodeId: str
    deviceRank: int
    phase: Phase | None = None
    step: int | None = None
    lastProgressAt: str | None = None
    processAlive: bool | None = None
    role: RankRole | None = None
    waitingIn: str | None = None
    """The collective it has been waiting in, by its last entry."""
    gaveUp: str | None = None
    """How, where and when it last gave up on a peer (its collective timed out, or the ring
    lost the peer), kept across its restarts until it is ready again."""
    exitReason: str | None = None
    """How its process ended, when it is down or timed out."""
    process: ProcessState | None = None
    """What the kernel said the process was doing when the evidence was captured."""
    stack: str | None = None
    """Its threads' Python stacks when the finding opened (see `RunnerEvidence`)."""
    mlxMemory: MlxMemorySnapshot | None = None
    capturedAt: str | None = None
    pace: RankPace | None = None
    """Its work and wait per step when the finding was made, when it keeps a pace."""


class SeenBefore(CamelStruct, kw_only=True, frozen=True):
    """How often the same fault (the same `signature`) was seen before an incident."""

    count: int
    first: str
    last: str
    incidentIds: list[str] = []
    """The latest of them (20 at most)."""


class FaultSignature(CamelStruct, kw_only=True, frozen=True):
    """One fault and the incidents it was: how many, first and last when."""

    signature: str
    kind: FindingKind
    count: int
    first: str
    last: str
    incidentIds: list[str] = []
    """The latest of them (20 at most)."""
    summary: str
    """The last word of the latest of them."""


def incident_id(scope: str, since: str) -> str:
    """The id of the incident of `scope` (an instance, a node's flood, an outage's kind)
    that opened at `since`: the same wherever and however often it is worked out, so a
    restart that keeps the incident keeps it."""
    return hashlib.sha256(f"{scope}\0{since}".encode()).hexdigest()[:16]


class Finding(CamelStruct, kw_only=True, frozen=True):
    """One problem of one instance: the ranks at fault, the ranks waiting on them, why.

    `open` is false on the message that says the finding cleared.
    """

    instanceId: str
    kind: FindingKind
    culpritRanks: list[int]
    culpritRunnerIds: list[str]
    waitingRanks: list[int] = []
    summary: str
    since: str
    open: bool = True
    clearedAt: str | None = None
    """When it cleared (on the message that says so)."""
    evidence: list[RankEvidence] = []
    incidentId: str | None = None
    """The incident's id, the same from its opening to its clearing, across restarts of
    any service."""
    signature: str | None = None
    """The fault it is (its kind, where the culprits stood, the frames the ranks were in),
    in the incident history."""
    seenBefore: SeenBefore | None = None
    """In the incident history: the incidents of the same signature before it."""
    unwatchedSince: str | None = None
    """When rankscope stopped watching while it was open (its aggregator stopped): what
    happened from then on was not seen."""
    unwatchedUntil: str | None = None
    """When an aggregator took it up again: its duration leaves the time between out."""

    @property
    def key(self) -> str:
        """Its incident's id: the one the history, the bundle and the alert all use (worked
        out for a finding published without one, by an older release)."""
        return self.incidentId or incident_id(self.instanceId or self.kind.value, self.since)


class Diagnosis(CamelStruct, kw_only=True, frozen=True):
    """Every open finding, by instance; or, as history, every incident's last word (open
    or cleared), oldest first."""

    generatedAt: str
    findings: list[Finding] = []
    omitted: int = 0
    """Findings left out to keep the answer within its bound (`DiagnosisQuery` narrows
    it to an instance or a kind to see them)."""


class RankState(CamelStruct, kw_only=True, frozen=True):
    """Readiness of one rank of an instance."""

    runnerId: str
    nodeId: str
    deviceRank: int
    statusKind: str | None = None
    ready: bool
    lost: bool
    gaveUp: bool = False
    """It gave up on a peer since it was last ready (a victim of another rank's fault)."""


class InstanceState(CamelStruct, kw_only=True, frozen=True):
    """Which ranks of an instance are ready and which are lost."""

    instanceId: str
    runnerSpecId: str = ""
    modelId: str
    ranks: list[RankState]

    @property
    def ready(self) -> bool:
        """Whether it has ranks and every one is ready."""
        return bool(self.ranks) and all(rank.ready for rank in self.ranks)


class PaceHistogram(CamelStruct, kw_only=True, frozen=True):
    """A runner's sampled steps by the seconds they took working and waiting, counted
    since the aggregator started (each sample's steps in the bucket of their mean):
    `workCounts[i]` steps took at most `bounds[i]` seconds of work, the last count is of
    every step (+Inf)."""

    bounds: list[float]
    workCounts: list[int]
    waitCounts: list[int]
    steps: int
    workSeconds: float
    waitSeconds: float


class RunnerHistory(CamelStruct, kw_only=True, frozen=True):
    """How much of one runner's history the aggregator holds, and what it lacks.

    Seqs count every telemetry message of a runner from 0 without gaps, so what is not
    here was either evicted (by the stream's limits before it was read, or by the
    aggregator's retention) or lost on the way.
    """

    runnerId: str
    nodeId: str
    instanceId: str
    deviceRank: int
    firstSeq: int | None = None
    """The oldest seq received; history before it is not held (stream limits evicted it,
    or it was never stored)."""
    lastSeq: int | None = None
    """The newest seq received."""
    missingSeqs: int = 0
    """Seqs between `firstSeq` and `lastSeq` that never arrived."""
    heldEntries: int = 0
    """Flight-recorder entries held for timelines."""
    evictedEntries: int = 0
    """Entries received but dropped by the aggregator's own retention (oldest first)."""
    oldestAt: str | None = None
    """Time of the oldest entry held: timelines of this runner start here."""
    acknowledgedSeq: int | None = None
    """The newest seq JetStream acknowledged to the runner's agent, as of its last probe."""
    unseenSeqs: int = 0
    """Seqs up to `acknowledgedSeq` newer than `lastSeq`: stored, yet not read here (a
    loss at the end of the range, which no gap between seqs can show)."""
    pace: PaceHistogram | None = None
    """Its work and wait per step, when it keeps a pace."""
    waitedOn: float | None = None
    """The share of its job's time spent waiting for it over the newest steps every rank
    sampled, or of its pipeline's work a step (`RankPace.waitedOn`); None where its job's
    ranks cannot be compared."""
    lastArrival: float | None = None
    """The share of those steps on which it arrived last (`RankPace.lastArrival`)."""
    layers: int | None = None
    """The layers it holds, where its job is a pipeline compared per layer
    (`RankPace.layers`)."""


class TimelineQuery(CamelStruct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Filters of the timeline; `limit` keeps the newest entries, still in `at` order;
    `localNodeId` is the node of whoever asks (the answering gateway's)."""

    instanceId: str | None = None
    nodeId: str | None = None
    modelId: str | None = None
    since: str | None = None
    until: str | None = None
    limit: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 1000
    localNodeId: str | None = None

    def __post_init__(self) -> None:
        for name, value in (("since", self.since), ("until", self.until)):
            if value is not None:
                try:
                    parse_ts(value)
                except ValueError:
                    raise ValueError(
                        f"`{name}` is not an RFC 3339 timestamp: {value[:40]!r}"
                    ) from None


class DiagnosisQuery(CamelStruct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Filters of the open findings: one instance, one kind, or both (unset: all)."""

    instanceId: str | None = None
    kind: FindingKind | None = None


class PlacementQuery(CamelStruct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """One runner's placement, or every runner's when `runnerId` is unset; `isLocal` is
    relative to `localNodeId` (the asker's node)."""

    runnerId: str | None = None
    localNodeId: str | None = None


class QueryError(CamelStruct, kw_only=True, frozen=True):
    """A query the aggregator could not answer: `status` follows HTTP (404, 422, 503)."""

    status: int
    error: str


class MissingPartition(CamelStruct, kw_only=True, frozen=True):
    """An aggregator partition left out of an answer, and why."""

    partition: int
    reason: str


class AggregatorHealth(CamelStruct, kw_only=True, frozen=True):
    """An aggregator's readiness and counters (`rankscope.query.health`); the gateway's
    answer from every partition sums the counters, joins the maps and names the partitions
    that did not answer."""

    ready: bool
    partition: str
    storageProblem: str = ""
    natsReachable: bool = True
    natsOutages: int = 0
    entries: int = 0
    heldBytes: int = 0
    """What the entries held cost, in bytes."""
    evictedEntries: int = 0
    trimmedBytes: dict[str, int] = {}
    """Bytes of each node's history given up to stay within the aggregator's byte bound:
    a node here sent more than its share."""
    runners: int = 0
    duplicates: int = 0
    badMessages: dict[str, int] = {}
    missingSeqs: dict[str, int] = {}
    openFindings: int = 0
    queuedTasks: dict[str, int] = {}
    slowConsumerDrops: int = 0
    followerRestarts: int = 0
    clockOffsets: dict[str, float] = {}
    missingPartitions: list[MissingPartition] = []
