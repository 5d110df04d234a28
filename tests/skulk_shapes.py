"""Skulk's diagnostics models (`skulk.shared.types.diagnostics`, as on its main and dev
branches), written out here field for field with its aliases (camelCase) and its
`extra="forbid"`, to judge what rankscope serves at Skulk's routes independently of
rankscope's own structs."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

__all__ = [
    "ClusterDiagnostics",
    "DiagnosticCaptureResponse",
    "NodeDiagnostics",
    "RunnerTaskCancelResponse",
]

Phase = Literal[
    "created", "idle", "connect_group", "load_model", "warmup", "task_submission",
    "task_agreement", "prompt_build", "vision_preprocess", "kv_cache_lookup",
    "prefill_barrier", "prefill_pipeline", "prefill_stream", "decode_barrier",
    "decode_wait_first_token", "decode_stream", "parser", "cancel_requested",
    "cancel_observed", "completion", "error", "shutdown_cleanup",
]  # fmt: skip
Value = str | int | float | bool | list[str]


class Camel(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, validate_by_name=True, extra="forbid", strict=True
    )


class Memory(Camel):
    in_bytes: int


class MlxMemorySnapshot(Camel):
    generated_at: str
    active: Memory | None = None
    cache: Memory | None = None
    peak: Memory | None = None
    wired_limit: Memory | None = None
    source: str


class RunnerDiagnosticContext(Camel):
    node_id: str
    runner_id: str
    pid: int | None = None
    instance_id: str
    model_id: str
    rank: int
    world_size: int
    start_layer: int
    end_layer: int
    n_layers: int


class RunnerFlightRecorderEntry(Camel):
    at: str
    phase: Phase
    event: str
    detail: str | None = None
    attrs: dict[str, Value] = Field(default_factory=dict)
    context: RunnerDiagnosticContext
    task_id: str | None = None
    command_id: str | None = None
    mlx_memory: MlxMemorySnapshot | None = None


class RunnerTaskDiagnostics(Camel):
    task_id: str
    task_kind: str
    task_status: str
    instance_id: str
    command_id: str | None = None
    runner_id: str | None = None
    model_id: str | None = None


class RunnerLifecycleMilestone(Camel):
    at: str
    name: str
    detail: str | None = None


class RunnerSupervisorDiagnostics(Camel):
    runner_id: str
    instance_id: str
    node_id: str
    model_id: str
    device_rank: int
    world_size: int
    start_layer: int
    end_layer: int
    n_layers: int
    pid: int | None = None
    process_alive: bool
    exit_code: int | None = None
    status_kind: str
    status_since: str
    seconds_in_status: float
    phase: Phase
    phase_started_at: str
    seconds_in_phase: float
    last_progress_at: str | None = None
    active_task_id: str | None = None
    active_command_id: str | None = None
    phase_detail: str | None = None
    last_mlx_memory: MlxMemorySnapshot | None = None
    flight_recorder: list[RunnerFlightRecorderEntry] = Field(default_factory=list)
    pending_task_ids: list[str] = Field(default_factory=list)
    in_progress_tasks: list[RunnerTaskDiagnostics] = Field(default_factory=list)
    completed_task_count: int
    cancelled_task_ids: list[str] = Field(default_factory=list)
    last_task_sent_at: str | None = None
    last_event_received_at: str | None = None
    last_event_type: str | None = None
    milestones: list[RunnerLifecycleMilestone] = Field(default_factory=list)


class PlacementRunnerDiagnostics(Camel):
    runner_id: str
    node_id: str
    friendly_name: str | None = None
    status_kind: str | None = None
    device_rank: int
    world_size: int
    start_layer: int
    end_layer: int
    n_layers: int
    is_local: bool
    is_master: bool
    tasks: list[RunnerTaskDiagnostics] = Field(default_factory=list)


class InstancePlacementDiagnostics(Camel):
    instance_id: str
    model_id: str
    master_node_id: str | None = None
    master_is_placement_node: bool
    local_node_is_placement_node: bool
    placement_node_ids: list[str] = Field(default_factory=list)
    runners: list[PlacementRunnerDiagnostics] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)


class NodeRuntimeDiagnostics(Camel):
    node_id: str
    hostname: str
    friendly_name: str | None = None
    is_master: bool
    master_node_id: str | None = None
    cwd: str
    config_path: str
    config_file_exists: bool
    skulk_version: str
    skulk_commit: str
    libp2p_namespace: str | None = None  # alias libp2PNamespace, as to_camel makes it
    python_unbuffered: bool
    tracing_enabled: bool
    structured_logging_configured: bool
    logging_ingest_url: str | None = None


class NodeResourceDiagnostics(Camel):
    """Every reading optional (none of their shapes is exercised here)."""


class NodeDiagnostics(Camel):
    generated_at: str
    runtime: NodeRuntimeDiagnostics
    resources: NodeResourceDiagnostics
    supervisor_runners: list[RunnerSupervisorDiagnostics] = Field(default_factory=list)
    placements: list[InstancePlacementDiagnostics] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)


class ClusterNodeDiagnostics(Camel):
    node_id: str
    url: str | None = None
    ok: bool
    diagnostics: NodeDiagnostics | None = None
    error: str | None = None


class ClusterDiagnostics(Camel):
    generated_at: str
    local_node_id: str
    master_node_id: str | None = None
    nodes: list[ClusterNodeDiagnostics] = Field(default_factory=list)


class RunnerTaskCancelResponse(Camel):
    node_id: str
    runner_id: str
    task_id: str
    status: Literal["cancel_requested", "already_cancelled", "already_completed"]
    message: str


class DiagnosticProcessSample(Camel):
    name: str
    command: list[str]
    ok: bool
    exit_code: int | None = None
    duration_seconds: float
    stdout: str | None = None
    stderr: str | None = None
    error: str | None = None


class DiagnosticCaptureResponse(Camel):
    generated_at: str
    node_id: str
    node_diagnostics: NodeDiagnostics
    runner: RunnerSupervisorDiagnostics | None = None
    flight_recorder: list[RunnerFlightRecorderEntry] = Field(default_factory=list)
    mlx_memory: MlxMemorySnapshot | None = None
    process_samples: list[DiagnosticProcessSample] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)
