"""Join the ring and load only this rank's layers (mlx rank is deviceRank; the split
itself is `pipeline.split_layers`)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm import __version__ as mlx_lm_version
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import _get_classes as model_classes
from mlx_lm.utils import load_config, load_model, load_tokenizer

from rankscope.services.agent.runner.pace import Pace
from rankscope.services.agent.runner.pipeline import split_layers
from rankscope.shared.wire import RunnerAssignment

__all__ = ["LoadedShard", "connect_group", "load_shard", "ring_hosts", "unsupported"]


def ring_hosts(assignments: Sequence[RunnerAssignment]) -> list[list[str]]:
    """The ring hostfile: per rank, the address it listens on."""
    return [[f"{a.host}:{a.port}"] for a in sorted(assignments, key=lambda a: a.deviceRank)]


def unsupported(path: Path) -> str | None:
    """Why the model at `path` cannot run split by this node's mlx-lm, if it cannot: an
    architecture mlx-lm does not know, or one without a layer list. Reads its config only;
    an unreadable config is `read_shape`'s to report."""
    try:
        config = load_config(path)
    except (OSError, ValueError):
        return None
    try:
        model_class, _ = model_classes(config)
    except (ValueError, KeyError):
        model_type = config.get("model_type")
        return f"model_type {model_type!r} is not an architecture mlx-lm {mlx_lm_version} knows"
    if not isinstance(getattr(model_class, "layers", None), property):
        return f"{model_class.__module__} has no layer list to split"
    return None


def connect_group(assignment: RunnerAssignment, hosts: list[list[str]]) -> Any:
    """Join the ring of this instance (a group of one when the world is one rank)."""
    if assignment.worldSize == 1:
        return mx.distributed.init()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as hostfile:
        json.dump(hosts, hostfile)
    os.environ["MLX_HOSTFILE"] = hostfile.name
    os.environ["MLX_RANK"] = str(assignment.deviceRank)
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
    path: Path,
    group: Any,
    assignments: Sequence[RunnerAssignment],
    rank: RunnerAssignment,
    pace: Pace | None = None,
) -> LoadedShard:
    """Load the model lazily, keep layers `[startLayer, endLayer)` and materialise only them
    (`pace`: where this rank's sampled steps are timed).

    Raises:
        ValueError: the model cannot be split, or the placement's layers are not the model's.
    """
    model, _ = load_model(path, lazy=True, strict=False)
    layers = len(getattr(model, "layers", ()))
    placed = max(a.endLayer for a in assignments)
    if placed != layers:
        raise ValueError(f"the placement splits {placed} layers but the model has {layers}")
    split_layers(model, group, rank.startLayer, rank.endLayer, pace)
    mx.eval(model.parameters())
    tokenizer = load_tokenizer(path)  # type: ignore[no-untyped-call]
    return LoadedShard(model, tokenizer, rank.endLayer - rank.startLayer)
