"""rankscope's own bus events, as tagged unions (`type` names the variant).

Runner telemetry carries a per-runner, gap-free `seq` shared by all three kinds, so a
consumer can dedupe retries and count what never arrived.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Annotated

import msgspec

from rankscope.shared.timestamps import check_ts, to_epoch
from rankscope.shared.wire.base import CamelStruct
from rankscope.shared.wire.enums import Phase, RunnerStatusKind, TaskKind, TaskStatus
from rankscope.shared.wire.memory import MlxMemorySnapshot, StepPace
from rankscope.shared.wire.timeline import Attrs, TimelineEntry

__all__ = [
    "MAX_COMMAND",
    "MAX_WORLD",
    "TASK_HORIZON_S",
    "ChatMessage",
    "FlightEntry",
    "FlightRecord",
    "GenerationRequest",
    "InstanceCreated",
    "InstanceReleased",
    "MemorySampled",
    "PhaseEntries",
    "PhaseRecords",
    "PlacementEvent",
    "ReceivedTelemetry",
    "RecordedProgram",
    "RecordedRank",
    "Registered",
    "ReleaseCause",
    "RunnerAssignment",
    "RunnerRef",
    "RunnerStatusChanged",
    "RunnerTelemetry",
    "TaskCreated",
    "TaskEvent",
    "TaskStatusChanged",
    "TokenChunk",
]

TASK_HORIZON_S = 300.0
"""How long a task without a deadline may wait to start: the gateway's own deadline."""

MAX_WORLD = 4096
"""The most ranks one recorded job may have (a typo cannot make a job wait for millions)."""
MAX_JOB_ID = 480
"""The longest recorded job or node id: its runners' ids must still name a subject."""
MAX_COMMAND = 4096
"""The longest command line a recorded rank registers with (`rankscope record` cuts)."""
MAX_HOST = 255
"""The longest host name (DNS's limit)."""
MAX_PID = 1 << 22
"""The largest process id (Linux's `pid_max` ceiling; macOS stays under 100,000)."""

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]


def _utc(event: msgspec.Struct, name: str) -> None:
    """Check the timestamp `name` of `event`, put in the wire's UTC form if it was not."""
    given = getattr(event, name)
    fixed = check_ts(given)
    if fixed != given:
        msgspec.structs.force_setattr(event, name, fixed)


class RunnerRef(CamelStruct, kw_only=True, frozen=True):
    """Who emitted a telemetry message: one rank of one instance on one node."""

    runnerId: str
    nodeId: str
    instanceId: str
    modelId: str
    deviceRank: NonNegative
    worldSize: Positive


class _Stamped(CamelStruct, kw_only=True, frozen=True):
    """An event of a moment, `at`: checked as it is made or decoded."""

    at: str

    def __post_init__(self) -> None:
        _utc(self, "at")


class FlightRecord(CamelStruct, kw_only=True, frozen=True, gc=False):
    """One phase transition as the runner recorded it (seed 001 `timeline[]` minus the
    runner's identity, which travels once per batch in `RunnerRef`), its time not checked
    yet: ingest decodes these and checks a batch's times at once (`inputs.entry_times`);
    everyone else decodes a `FlightEntry`.

    Not tracked by the cycle collector (`gc=False`): decoded from JSON it can hold no
    cycle, and a service holding many (ingest between two settles) would otherwise pay a
    collection pass over each of them again and again."""

    seq: NonNegative
    at: str
    phase: Phase
    event: str
    detail: str | None = None
    attrs: Attrs = {}
    taskId: str | None = None
    commandId: str | None = None
    mlxMemory: MlxMemorySnapshot | None = None

    def check_time(self) -> None:
        """Check `at` as decoding a `FlightEntry` does, putting it in the wire's UTC form.

        Raises:
            ValueError: it is no RFC 3339 date-time with an offset.
        """
        _utc(self, "at")

    def of(self, runner: RunnerRef) -> TimelineEntry:
        """This entry of `runner` as a timeline shows it."""
        return TimelineEntry(
            at=self.at,
            nodeId=runner.nodeId,
            runnerId=runner.runnerId,
            deviceRank=runner.deviceRank,
            worldSize=runner.worldSize,
            phase=self.phase,
            event=self.event,
            detail=self.detail,
            attrs=self.attrs,
            taskId=self.taskId,
            commandId=self.commandId,
            mlxMemory=self.mlxMemory,
        )


class FlightEntry(FlightRecord, kw_only=True, frozen=True):
    """A flight-recorder entry whose time is checked as it is made or decoded."""

    def __post_init__(self) -> None:
        self.check_time()  # a bad time is refused with its message, not carried into views


class _Telemetry(CamelStruct, kw_only=True, frozen=True, tag_field="type", tag=True):
    runner: RunnerRef


class PhaseRecords(_Telemetry, kw_only=True, frozen=True, tag="PhaseEntries"):
    """A batch of consecutive flight-recorder entries of one runner, as ingest decodes it
    (see `FlightRecord`)."""

    entries: Sequence[FlightRecord]


class PhaseEntries(PhaseRecords, kw_only=True, frozen=True, tag="PhaseEntries"):
    """A batch of consecutive flight-recorder entries of one runner."""

    entries: list[FlightEntry]


class MemorySampled(_Telemetry, kw_only=True, frozen=True):
    """A periodic MLX memory snapshot of one runner, with its pace since the last one
    (absent from ranks that keep none: a world of one, a runner of an older release)."""

    seq: NonNegative
    snapshot: MlxMemorySnapshot
    pace: StepPace | None = None


class RunnerStatusChanged(_Telemetry, kw_only=True, frozen=True):
    """The supervisor's view of a runner changed: status, process liveness, exit cause."""

    seq: NonNegative
    at: str
    statusKind: RunnerStatusKind
    pid: int | None = None
    processAlive: bool
    detail: str | None = None
    exitCode: int | None = None
    signal: str | None = None
    stoppedByUser: bool = False
    """Its end was asked for (Ctrl-C, a signal sent to `rankscope record`): a stop, not a
    fault, however the process ended."""

    def __post_init__(self) -> None:
        _utc(self, "at")


RunnerTelemetry = PhaseEntries | MemorySampled | RunnerStatusChanged
ReceivedTelemetry = PhaseRecords | MemorySampled | RunnerStatusChanged
"""Runner telemetry as ingest decodes it: a batch's times are checked after, at once."""


class RunnerAssignment(CamelStruct, kw_only=True, frozen=True):
    """One rank of a placed instance: where it runs and which layers it holds."""

    runnerId: str
    nodeId: str
    deviceRank: NonNegative
    worldSize: Positive
    startLayer: NonNegative
    endLayer: Positive
    nLayers: Positive
    host: str
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)]
    """The rank's ring port; 0 when not known (a recorded rank under another backend)."""


class _Placement(_Stamped, kw_only=True, frozen=True, tag_field="type", tag=True):
    instanceId: str


class InstanceCreated(_Placement, kw_only=True, frozen=True):
    """An instance of a Runner spec was placed; `assignments` are ordered by rank.

    An instance placed again (after a node loss) keeps its id, so its job and rank table
    live on; `attempt` counts its placements and is part of every new runner id.
    """

    runnerSpecId: str
    modelId: str
    modelPath: str | None = None
    modelBytes: NonNegative | None = None
    """The weights' size placement went by (a restarted rank-table service reuses it)."""
    attempt: NonNegative = 0
    specDigest: str = ""
    assignments: list[RunnerAssignment]
    recorded: RecordedProgram | None = None
    """Set for a recorded job: its ranks registered themselves (`RecordedRank`)."""


class ReleaseCause(StrEnum):
    """Why an instance was taken down."""

    SPEC_DELETED = "spec_deleted"
    SPEC_CHANGED = "spec_changed"
    SCALED_DOWN = "scaled_down"
    PREEMPTED = "preempted"
    NODE_LOST = "node_lost"
    JOB_ENDED = "job_ended"
    """A recorded job's every rank ended."""


class InstanceReleased(_Placement, kw_only=True, frozen=True):
    """An instance was taken down; `reason` says why in words, `cause` for machines."""

    cause: ReleaseCause
    reason: str


PlacementEvent = InstanceCreated | InstanceReleased


class RecordedRank(CamelStruct, kw_only=True, frozen=True):
    """One rank of a recorded job asking to be announced (`rankscope record`): the job is
    announced once every rank of its world has asked."""

    jobId: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_JOB_ID)]
    nodeId: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_JOB_ID)]
    deviceRank: Annotated[int, msgspec.Meta(ge=0, lt=MAX_WORLD)]
    worldSize: Annotated[int, msgspec.Meta(ge=1, le=MAX_WORLD)]
    pid: Annotated[int, msgspec.Meta(ge=1, le=MAX_PID)]
    host: Annotated[str, msgspec.Meta(max_length=MAX_HOST)]
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    command: Annotated[str, msgspec.Meta(max_length=MAX_COMMAND)]
    startedAt: Annotated[str, msgspec.Meta(max_length=64)]
    """When the rank's process started: a rank asking again for the same start is the
    same rank (a retry); another start of a rank already announced is a new run."""

    def __post_init__(self) -> None:
        _utc(self, "startedAt")


class RecordedProgram(CamelStruct, kw_only=True, frozen=True):
    """A program rankscope did not start, recorded by `rankscope record`: no agent runs
    its ranks and no spec placed them; each rank registered itself, in rank order here."""

    ranks: list[RecordedRank]
    dump: str | None = None
    """Set when the ranks come from Flight Recorder dumps (`rankscope fr load`, with where
    they were read): nothing runs, so nothing is probed or judged live; the dumps' verdict
    is the job's incident."""


class Registered(CamelStruct, kw_only=True, frozen=True):
    """The rank-table service's answer to a `RecordedRank`: who the rank is on the wire,
    or why it cannot be recorded."""

    runner: RunnerRef | None = None
    announced: bool = False
    """Whether its job is announced: its telemetry counts from then on (before, it would
    be refused as older than the placement that made the rank), so the rank waits."""
    refused: str | None = None


class ChatMessage(CamelStruct, kw_only=True, frozen=True):
    """One message of a chat request."""

    role: str
    content: str


class GenerationRequest(CamelStruct, kw_only=True, frozen=True):
    """What a text-generation task asks for; greedy when `temperature` is 0."""

    messages: list[ChatMessage] = []
    prompt: str | None = None
    maxTokens: Positive = 128
    temperature: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    topP: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0


class _Task(_Stamped, kw_only=True, frozen=True, tag_field="type", tag=True):
    taskId: str
    instanceId: str


class TaskCreated(_Task, kw_only=True, frozen=True):
    """A task was submitted to every rank of an instance; a `CancelTask` names the task it
    cancels in `targetTaskId`. Past `deadline` nobody waits for it: it never starts then
    (without one, `TASK_HORIZON_S` after `at`)."""

    taskKind: TaskKind
    commandId: str | None = None
    modelId: str | None = None
    request: GenerationRequest | None = None
    targetTaskId: str | None = None
    deadline: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.deadline is not None:
            _utc(self, "deadline")

    def expired(self, now_s: float) -> bool:
        """Whether nobody waits for this task any more at `now_s` (seconds since the
        epoch)."""
        if self.deadline is not None:
            return to_epoch(self.deadline) < now_s
        return to_epoch(self.at) + TASK_HORIZON_S < now_s


class TaskStatusChanged(_Task, kw_only=True, frozen=True):
    """A task moved on; `runnerId` is set when one rank reports for itself; `refused` when
    it failed as asked, before any work (the request is at fault, `detail` says how)."""

    taskStatus: TaskStatus
    runnerId: str | None = None
    detail: str | None = None
    refused: bool = False


TaskEvent = TaskCreated | TaskStatusChanged


class TokenChunk(CamelStruct, kw_only=True, frozen=True):
    """Generated text for one command, in order of `seq`; the last has `finishReason` and
    the token counts."""

    commandId: str
    seq: NonNegative
    text: str
    finishReason: str | None = None
    promptTokens: int | None = None
    completionTokens: int | None = None
