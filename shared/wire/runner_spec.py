"""Runner specs in the Clarifai `apiRunner` shape (seed 002), snake_case as published.

A Runner spec declares one model deployment: `num_replicas` instances, each sharded over
`compute_info.num_accelerators` ranks on nodes of `nodepool`.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from shared.wire.base import SnakeStruct

__all__ = [
    "ComputeInfo",
    "ModelVersion",
    "Nodepool",
    "Runner",
    "RunnerMetrics",
    "SpecialHandling",
    "Worker",
    "WorkerModel",
]

Count = Annotated[int, msgspec.Meta(ge=0)]
Priority = Annotated[int, msgspec.Meta(ge=0, le=9, description="0-9, higher places first.")]
Quantity = Annotated[
    str, msgspec.Meta(description='A Kubernetes quantity such as "1500Mi", "3Gi" or "4.5".')
]


class ModelVersion(SnakeStruct, kw_only=True, frozen=True):
    """A pinned version of a model."""

    id: str = ""


class WorkerModel(SnakeStruct, kw_only=True, frozen=True):
    """The model a runner serves; `id` names it for placement and requests."""

    id: str
    user_id: str = ""
    app_id: str = ""
    model_version: ModelVersion | None = None


class Worker(SnakeStruct, kw_only=True, frozen=True):
    """What work the runner is for."""

    model: WorkerModel | None = None


class Nodepool(SnakeStruct, kw_only=True, frozen=True):
    """The group of nodes the runner is placed in."""

    id: str
    user_id: str = ""


class ComputeInfo(SnakeStruct, kw_only=True, frozen=True):
    """Resources each instance needs; `num_accelerators` is the ranks per instance."""

    cpu_limit: Quantity = ""
    cpu_memory: Quantity = ""
    cpu_requests: Quantity = ""
    cpu_memory_requests: Quantity = ""
    num_accelerators: Count = 0
    accelerator_memory: Quantity = ""
    accelerator_type: list[str] = []
    accelerator_topology: str = ""


class SpecialHandling(SnakeStruct, kw_only=True, frozen=True):
    """A special handling instruction and whether it was carried out."""

    id: str = ""
    reason: str = ""
    done: bool = False


class RunnerMetrics(SnakeStruct, kw_only=True, frozen=True):
    """Observed state of the deployment; a pod is one rank process."""

    pods_total: Count = 0
    pods_running: Count = 0
    total_pods_running_time_s: Count = 0
    pods_preempted_total: Count = 0


class Runner(SnakeStruct, kw_only=True, frozen=True):
    """One model deployment (Clarifai `apiRunner`). Timestamps are RFC 3339 strings."""

    id: str = ""
    description: str = ""
    created_at: str | None = None
    modified_at: str | None = None
    metadata: dict[str, Any] = {}
    labels: list[str] = []
    worker: Worker | None = None
    nodepool: Nodepool | None = None
    compute_info: ComputeInfo | None = None
    num_replicas: Count = 0
    special_handling: list[SpecialHandling] = []
    runner_metrics: RunnerMetrics | None = None
    min_replicas: Count = 0
    priority: Priority = 0
