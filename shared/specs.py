"""Validate a Runner spec into what placement needs, or refuse it with a reason."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from rankscope.shared.model_shape import ModelShape
from rankscope.shared.quantity import parse_bytes, parse_quantity
from rankscope.shared.subjects import MAX_TOKEN, IdTooLongError, token
from rankscope.shared.wire import Runner

__all__ = ["PlacementSpec", "SpecError", "id_problem", "validate"]

DEFAULT_NODEPOOL = "default"
DERIVED_ROOM = 32
"""Characters a spec id leaves free for the ids made from it: its instances'
(`<id>-<replica>`) and their runners' (`<instance>-a<attempt>-r<rank>`)."""


class SpecError(ValueError):
    """A spec that cannot be placed as written; the message is the reason for the user."""


@dataclass(frozen=True, slots=True)
class PlacementSpec:
    """A validated Runner spec: everything placement reads, nothing it does not."""

    runner_id: str
    revision: int
    created_at: str
    model_id: str
    model_path: str | None
    model: ModelShape | None
    """None until a node that holds the model at `model_path` has read its shape."""
    nodepool: str
    labels: frozenset[str]
    ranks: int
    replicas: int
    min_replicas: int
    priority: int
    rank_bytes: int | None
    max_ranks_per_node: int

    @property
    def shape(self) -> ModelShape:
        """The model's shape.

        Raises:
            SpecError: it is not known yet (only specs with a shape are placed).
        """
        if self.model is None:
            raise SpecError(f"the shape of the model at {self.model_path!r} is not known yet")
        return self.model

    def shaped(self, shape: ModelShape) -> PlacementSpec:
        """This spec with its model's shape.

        Raises:
            SpecError: the model has fewer layers than the spec has ranks, or layers that
                need another layer's KV cache and more than one rank.
        """
        if shape.n_layers < self.ranks:
            raise SpecError(
                f"the model has {shape.n_layers} layers, fewer than the "
                f"{self.ranks} ranks that must each hold one"
            )
        if shape.kv_shared_layers and self.ranks > 1:
            raise SpecError(
                f"the model's last {shape.kv_shared_layers} layers read the KV cache of earlier "
                f"layers, which a split across {self.ranks} ranks cannot give them; "
                "run it on 1 rank"
            )
        return dataclasses.replace(self, model=shape)

    def instance_id(self, replica: int) -> str:
        """The stable id of one replica (= the job id of its rank table)."""
        return f"{self.runner_id}-{replica}"

    @property
    def digest(self) -> str:
        """Fingerprint of what shapes an instance; a change means the instance is re-placed.
        Replica counts and priority are left out: they change how many, not how."""
        shape = [
            self.model_id,
            self.model_path,
            self.shape.n_layers,
            self.shape.model_bytes,
            self.nodepool,
            sorted(self.labels),
            self.ranks,
            self.rank_bytes,
            self.max_ranks_per_node,
        ]
        return hashlib.sha256(json.dumps(shape).encode()).hexdigest()[:16]

    def rank_demand(self, layers: int) -> int:
        """Bytes one rank holding `layers` layers needs: as the spec declares it, else its
        share of the weights and what a runner process holds besides (`RUNNER_BYTES`)."""
        if self.rank_bytes is not None:
            return self.rank_bytes
        return -(-self.shape.model_bytes * layers // self.shape.n_layers) + RUNNER_BYTES


def _positive(value: Any) -> int | None:
    """`value` as a positive whole number, or None. Metadata is a protobuf `Struct`, whose
    numbers are doubles: proto JSON writes 8 as `8.0`."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    return None


def _metadata_shape(metadata: dict[str, Any]) -> ModelShape | None:
    if "nLayers" not in metadata and "modelBytes" not in metadata:
        return None
    given_layers, given_size = metadata.get("nLayers"), metadata.get("modelBytes")
    layers = _positive(given_layers)
    if layers is None:
        raise SpecError(f"metadata.nLayers must be a positive integer, got {given_layers!r}")
    size = (
        _bytes("metadata.modelBytes", given_size)
        if isinstance(given_size, str)
        else _positive(given_size)
    )
    if size is None or size < 1:
        raise SpecError(f"metadata.modelBytes must be a positive size, got {given_size!r}")
    return ModelShape(n_layers=layers, model_bytes=size)


def _bytes(field: str, text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise SpecError(f"{field}: {exc}") from None


RUNNER_BYTES = 256 << 20
"""What one runner process holds besides its weights (Python, MLX, mlx-lm, buffers): a
rank of a tiny model still costs a process's worth of memory."""

MAX_REPLICAS = 64
"""Instances one spec may ask for by default (`RANKSCOPE_MAX_REPLICAS`)."""


def id_problem(given: str) -> str | None:
    """Why `given` cannot name a spec or a recorded job (None: it can): it must name it
    in a URL path, and leave room in a subject token for the ids derived from it."""
    if not given:
        return "id is required"
    if given in (".", "..") or "/" in given or any(c < " " or c == "\x7f" for c in given):
        return (
            f"id {given[:40]!r} is '.' or '..' or holds '/' or a control character: it "
            "must be one segment of a URL path"
        )
    try:
        token(given + "-" * DERIVED_ROOM)
    except IdTooLongError:
        return (
            f"id {given[:40]!r}... is too long: escaped (white space and non-ASCII take 3 "
            f"per byte) it must leave {DERIVED_ROOM} of {MAX_TOKEN} characters for the ids of "
            "its instances and runners"
        )
    return None


def validate(runner: Runner, revision: int = 0, max_replicas: int = MAX_REPLICAS) -> PlacementSpec:
    """Check a spec and extract its placement needs; it may ask for `max_replicas`
    instances at most.

    Raises:
        SpecError: the first problem, worded for the operator who wrote the spec.
    """
    if (problem := id_problem(runner.id)) is not None:
        raise SpecError(problem)
    model = runner.worker.model if runner.worker else None
    if model is None or not model.id:
        raise SpecError("worker.model.id is required: it names the model to serve")
    compute = runner.compute_info
    if compute is None or compute.num_accelerators < 1:
        raise SpecError("compute_info.num_accelerators must be at least 1 (ranks per instance)")
    if runner.num_replicas > max_replicas:
        raise SpecError(
            f"num_replicas ({runner.num_replicas:,}) is over this installation's limit of "
            f"{max_replicas} (RANKSCOPE_MAX_REPLICAS)"
        )
    if runner.min_replicas > runner.num_replicas:
        raise SpecError(
            f"min_replicas ({runner.min_replicas}) exceeds num_replicas ({runner.num_replicas})"
        )
    for name in ("cpu_limit", "cpu_requests"):
        if value := getattr(compute, name):
            try:
                parse_quantity(value)
            except ValueError as exc:
                raise SpecError(f"compute_info.{name}: {exc}") from None
    for name in ("cpu_memory", "cpu_memory_requests"):
        if value := getattr(compute, name):
            _bytes(f"compute_info.{name}", value)
    rank_bytes = (
        _bytes("compute_info.accelerator_memory", compute.accelerator_memory)
        if compute.accelerator_memory
        else None
    )
    given_per_node = runner.metadata.get("maxRanksPerNode", 1)
    per_node = _positive(given_per_node)
    if per_node is None:
        raise SpecError(
            f"metadata.maxRanksPerNode must be a positive integer, got {given_per_node!r}"
        )
    path = runner.metadata.get("modelPath")
    if path is not None and (not isinstance(path, str) or not path):
        raise SpecError(f"metadata.modelPath must be a path, got {path!r}")
    shape = _metadata_shape(runner.metadata)
    if shape is None and path is None:
        raise SpecError(
            "the model's size is unknown: set metadata.modelPath to the model's directory "
            "on the nodes, or metadata.nLayers and metadata.modelBytes"
        )
    spec = PlacementSpec(
        runner_id=runner.id,
        revision=revision,
        created_at=runner.created_at or "",
        model_id=model.id,
        model_path=path,
        model=None,
        nodepool=runner.nodepool.id if runner.nodepool else DEFAULT_NODEPOOL,
        labels=frozenset(runner.labels),
        ranks=compute.num_accelerators,
        replicas=runner.num_replicas,
        min_replicas=runner.min_replicas,
        priority=runner.priority,
        rank_bytes=rank_bytes,
        max_ranks_per_node=per_node,
    )
    return spec if shape is None else spec.shaped(shape)
