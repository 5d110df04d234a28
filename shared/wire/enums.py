"""Closed vocabularies of the wire: runner phases, runner statuses, task kinds and statuses."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["Breadcrumb", "Phase", "RunnerStatusKind", "TaskKind", "TaskStatus"]


class Phase(StrEnum):
    """The 22 flight-recorder phases of a runner (seed 001)."""

    CREATED = "created"
    IDLE = "idle"
    CONNECT_GROUP = "connect_group"
    LOAD_MODEL = "load_model"
    WARMUP = "warmup"
    TASK_SUBMISSION = "task_submission"
    TASK_AGREEMENT = "task_agreement"
    PROMPT_BUILD = "prompt_build"
    VISION_PREPROCESS = "vision_preprocess"
    KV_CACHE_LOOKUP = "kv_cache_lookup"
    PREFILL_BARRIER = "prefill_barrier"
    PREFILL_PIPELINE = "prefill_pipeline"
    PREFILL_STREAM = "prefill_stream"
    DECODE_BARRIER = "decode_barrier"
    DECODE_WAIT_FIRST_TOKEN = "decode_wait_first_token"
    DECODE_STREAM = "decode_stream"
    PARSER = "parser"
    CANCEL_REQUESTED = "cancel_requested"
    CANCEL_OBSERVED = "cancel_observed"
    COMPLETION = "completion"
    ERROR = "error"
    SHUTDOWN_CLEANUP = "shutdown_cleanup"


class Breadcrumb(StrEnum):
    """Flight-recorder events the diagnosis reads (an entry's `event`)."""

    RUNNER_READY = "runner_ready"
    """The rank finished warming up and serves tasks."""
    COLLECTIVE_WAIT = "collective_wait"
    """The rank has been waiting in a collective (`attrs.site`) for a while."""
    COLLECTIVE_RESUMED = "collective_resumed"
    """The collective it waited in returned."""
    COLLECTIVE_TIMEOUT = "pipeline_eval_timeout"
    """Its collective did not finish before the watchdog's deadline; the process exits."""
    PEER_LOST = "peer_lost"
    """Its collective failed (the ring lost a peer's connection); the process exits."""


class RunnerStatusKind(StrEnum):
    """Event-sourced runner status variants, named as the seeds' origin names them."""

    IDLE = "RunnerIdle"
    CONNECTING = "RunnerConnecting"
    CONNECTED = "RunnerConnected"
    LOADING = "RunnerLoading"
    LOADED = "RunnerLoaded"
    WARMING_UP = "RunnerWarmingUp"
    READY = "RunnerReady"
    RUNNING = "RunnerRunning"
    SHUTTING_DOWN = "RunnerShuttingDown"
    SHUTDOWN = "RunnerShutdown"
    FAILED = "RunnerFailed"


class TaskKind(StrEnum):
    """Concrete task model names (seed 000 `taskKind`)."""

    CREATE_RUNNER = "CreateRunner"
    DOWNLOAD_MODEL = "DownloadModel"
    CONNECT_TO_GROUP = "ConnectToGroup"
    LOAD_MODEL = "LoadModel"
    START_WARMUP = "StartWarmup"
    TEXT_GENERATION = "TextGeneration"
    CANCEL_TASK = "CancelTask"
    SHUTDOWN = "Shutdown"


class TaskStatus(StrEnum):
    """Event-sourced task statuses (seed 000 `taskStatus`)."""

    PENDING = "Pending"
    RUNNING = "Running"
    COMPLETE = "Complete"
    TIMED_OUT = "TimedOut"
    FAILED = "Failed"
    CANCELLED = "Cancelled"

    @property
    def is_final(self) -> bool:
        """Whether no further status can follow this one."""
        return self not in (TaskStatus.PENDING, TaskStatus.RUNNING)
