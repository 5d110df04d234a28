"""Runner specs in the Clarifai `apiRunner` shape (seed 002), snake_case as published.

A Runner spec declares one model deployment: `num_replicas` instances, each sharded over
`compute_info.num_accelerators` ranks on nodes of `nodepool`. What is served parses
strictly as `clarifai_grpc` `resources_pb2.Runner` proto JSON; what the seed writes
differently (a nodepool's `user_id`, an empty `accelerator_topology` or `reason` string) is
accepted and served the proto's way.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from rankscope.shared.wire.base import SnakeStruct

__all__ = [
    "ComputeCluster",
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


class ComputeCluster(SnakeStruct, kw_only=True, frozen=True, omit_defaults=True):
    """The compute cluster a nodepool belongs to; `user_id` owns them."""

    id: str = ""
    user_id: str = ""


class Nodepool(SnakeStruct, kw_only=True, frozen=True, omit_defaults=True):
    """The group of nodes the runner is placed in."""

    id: str
    user_id: str = ""
    """Accepted as the seed writes it; served as `compute_cluster.user_id`, where the
    proto carries the owner."""
    compute_cluster: ComputeCluster | None = None

    def __post_init__(self) -> None:
        if self.user_id:
            cluster = self.compute_cluster or ComputeCluster()
            if not cluster.user_id:
                cluster = msgspec.structs.replace(cluster, user_id=self.user_id)
            msgspec.structs.force_setattr(self, "compute_cluster", cluster)
            msgspec.structs.force_setattr(self, "user_id", "")


class ComputeInfo(SnakeStruct, kw_only=True, frozen=True):
    """Resources each instance needs; `num_accelerators` is the ranks per instance."""

    cpu_limit: Quantity = ""
    cpu_memory: Quantity = ""
    cpu_requests: Quantity = ""
    cpu_memory_requests: Quantity = ""
    num_accelerators: Count = 0
    accelerator_memory: Quantity = ""
    accelerator_type: list[str] = []
    accelerator_topology: list[str] | str = []
    """A list in the proto; a string (the seed's `""`) is taken as one entry or none."""

    def __post_init__(self) -> None:
        topology = self.accelerator_topology
        if isinstance(topology, str):
            msgspec.structs.force_setattr(
                self, "accelerator_topology", [topology] if topology else []
            )


class SpecialHandling(SnakeStruct, kw_only=True, frozen=True, omit_defaults=True):
    """A special handling instruction and whether it was carried out."""

    id: str = ""
    reason: Literal["", "REASON_NOT_SET", "CONTACT_SALES", "INTERNAL_ONLY"] | None = None
    """The proto's enum, left out when unset (`""` is taken as unset)."""
    done: bool = False

    def __post_init__(self) -> None:
        if self.reason == "":
            msgspec.structs.force_setattr(self, "reason", None)


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
