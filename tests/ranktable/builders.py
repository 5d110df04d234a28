"""Small builders for rank-table tests: specs, nodes, runners."""

from __future__ import annotations

from typing import Any

from rankscope.services.ranktable.placement import NodeView
from rankscope.shared.model_shape import ModelShape
from rankscope.shared.specs import PlacementSpec
from rankscope.shared.timestamps import now
from rankscope.shared.wire import (
    ComputeInfo,
    NodeInfo,
    Nodepool,
    Runner,
    Worker,
    WorkerModel,
)

GiB = 1 << 30


def spec(runner_id: str = "llm", **changes: Any) -> PlacementSpec:
    """A valid placement spec: 2 ranks, 1 replica, an 8 GiB model of 32 layers."""
    fields: dict[str, Any] = dict(
        runner_id=runner_id,
        revision=1,
        created_at="",
        model_id="llama",
        model_path=None,
        model=ModelShape(n_layers=32, model_bytes=8 * GiB),
        nodepool="default",
        labels=frozenset(),
        ranks=2,
        replicas=1,
        min_replicas=0,
        priority=0,
        rank_bytes=None,
        max_ranks_per_node=1,
    )
    fields.update(changes)
    return PlacementSpec(**fields)


def node(node_id: str, free_gib: float, **changes: Any) -> NodeView:
    """A live node with `free_gib` GiB available."""
    fields: dict[str, Any] = dict(
        node_id=node_id,
        address=f"10.0.0.{len(node_id)}",
        available_bytes=int(free_gib * GiB),
        nodepool="default",
    )
    fields.update(changes)
    return NodeView(**fields)


def nodes(*views: NodeView) -> dict[str, NodeView]:
    """Nodes by id."""
    return {view.node_id: view for view in views}


def node_info(node_id: str, free_gib: float, **changes: Any) -> NodeInfo:
    """An inventory entry, as an agent's heartbeat writes it."""
    fields: dict[str, Any] = dict(
        nodeId=node_id,
        friendlyName=node_id,
        address="127.0.0.1",
        memoryTotalBytes=64 * GiB,
        memoryAvailableBytes=int(free_gib * GiB),
        nodepool="default",
        lastHeartbeat=now(),
    )
    fields.update(changes)
    return NodeInfo(**fields)


def runner(runner_id: str = "llm", ranks: int = 2, **changes: Any) -> Runner:
    """A Runner spec in the Clarifai shape whose model size is given in metadata."""
    fields: dict[str, Any] = dict(
        id=runner_id,
        worker=Worker(model=WorkerModel(id="llama")),
        nodepool=Nodepool(id="default"),
        compute_info=ComputeInfo(num_accelerators=ranks),
        num_replicas=1,
        metadata={"nLayers": 32, "modelBytes": "8Gi"},
    )
    fields.update(changes)
    return Runner(**fields)
