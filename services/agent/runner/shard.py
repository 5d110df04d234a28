"""Join the ring and load only this rank's layers.

rankscope's `deviceRank` 0 holds layer 0. mlx-lm's `PipelineMixin` splits in reverse
(mlx rank 0 holds the *last* layers), so mlx rank = worldSize - 1 - deviceRank, and the
placement's split is handed over in mlx rank order.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_model, load_tokenizer

from shared.wire import RunnerAssignment

__all__ = ["LoadedShard", "connect_group", "load_shard", "mlx_rank", "ring_hosts", "split"]


def mlx_rank(device_rank: int, world_size: int) -> int:
    """The mlx rank that holds what `device_rank` holds."""
    return world_size - 1 - device_rank


def _by_mlx_rank(assignments: Sequence[RunnerAssignment]) -> list[RunnerAssignment]:
    return sorted(assignments, key=lambda a: mlx_rank(a.deviceRank, a.worldSize))


def ring_hosts(assignments: Sequence[RunnerAssignment]) -> list[list[str]]:
    """The ring hostfile: per mlx rank, the address its rank listens on."""
    return [[f"{a.host}:{a.port}"] for a in _by_mlx_rank(assignments)]


def split(assignments: Sequence[RunnerAssignment]) -> list[int]:
    """Layers per mlx rank."""
    return [a.endLayer - a.startLayer for a in _by_mlx_rank(assignments)]


def connect_group(assignment: RunnerAssignment, hosts: list[list[str]]) -> Any:
    """Join the ring of this instance (a group of one when the world is one rank)."""
    if assignment.worldSize == 1:
        return mx.distributed.init()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as hostfile:
        json.dump(hosts, hostfile)
    os.environ["MLX_HOSTFILE"] = hostfile.name
    os.environ["MLX_RANK"] = str(mlx_rank(assignment.deviceRank, assignment.worldSize))
    try:
        return mx.distributed.init(backend="ring", strict=True)
    finally:
        os.unlink(hostfile.name)


class LoadedShard:
    """This rank's slice of the model, its tokenizer, and what the slice weighs."""

    def __init__(self, model: Any, tokenizer: TokenizerWrapper, layers: int) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.layers = layers
        context = getattr(getattr(model, "args", None), "max_position_embeddings", None)
        self.context_length: int | None = context if isinstance(context, int) else None
        """Longest sequence the model was built for, when its config says."""
        flat = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
        self.parameter_bytes = sum(array.nbytes for _, array in flat)


def load_shard(
    path: Path, group: Any, assignments: Sequence[RunnerAssignment], rank: RunnerAssignment
) -> LoadedShard:
    """Load the model lazily, keep layers `[startLayer, endLayer)` and materialise only them.

    Raises:
        ValueError: the model cannot be split into pipeline stages, or the split does not
            match the model's layer count.
    """
    model, _ = load_model(path, lazy=True, strict=False)
    inner: Any = getattr(model, "model", None)
    if group.size() > 1:
        if not hasattr(inner, "pipeline"):
            raise ValueError(f"{type(model).__module__} does not support pipeline parallelism")
        inner.pipeline(group, split=split(assignments))
        if (inner.start_idx, inner.end_idx) != (rank.startLayer, rank.endLayer):
            raise ValueError(
                f"loaded layers [{inner.start_idx}, {inner.end_idx}) but the placement says "
                f"[{rank.startLayer}, {rank.endLayer})"
            )
    mx.eval(model.parameters())
    tokenizer = load_tokenizer(path)  # type: ignore[no-untyped-call]
    return LoadedShard(model, tokenizer, rank.endLayer - rank.startLayer)
