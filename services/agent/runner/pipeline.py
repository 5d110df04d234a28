"""Pipeline-parallel split of any mlx-lm model whose inner model has a `layers` list.

The model keeps its own forward pass; only the entries of its layer list change, so every
per-layer index the family's code uses (sliding/full-attention patterns, the layer a mask
is made from, `make_cache`) stays an index into the full model:

- a layer this rank holds is wrapped: the first one replaces its input with the hidden
  state received from the previous rank, the last one sends its output to the next;
- a layer another rank holds becomes a shell (its settings, no weights) that passes the
  hidden state through and keeps its KV cache's bookkeeping (offset, rotation) with
  zero-width keys, so a mask made from that cache is the full model's, at no memory cost;
- the model's last layer, wherever it lives, all-gathers the hidden state and keeps the
  last rank's, so every rank computes the same logits and samples the same token.

mlx rank is deviceRank: rank 0 holds layer 0 and embeds the prompt.
"""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx.utils import tree_map

from rankscope.services.agent.runner.pace import Pace

__all__ = ["split_layers"]


def _cache_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The KV cache a layer was called with (families pass it by position or by name)."""
    for value in (*args, *kwargs.values()):
        if hasattr(value, "make_mask") or hasattr(value, "update_and_fetch"):
            return value
    return None


class _Stage(Module):
    """One entry of the split layer list: a layer held here or a shell of one held
    elsewhere, plus this rank's traffic at that point. Reads through to the layer's own
    attributes (`use_sliding`, `layer_type`, ...) that the family's code asks for."""

    def __init__(
        self,
        layer: Any,
        group: Any,
        *,
        here: bool,
        receive: bool,
        send: bool,
        gather: bool,
        timed_in: Pace | None = None,
        timed_out: Pace | None = None,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.layer = layer
        self._group = group
        self._here = here
        self._receive = receive
        self._send = send
        self._gather = gather
        self._timed_in = timed_in
        self._timed_out = timed_out

    def __getattr__(self, name: str) -> Any:
        if name != "layer" and "layer" in self:
            return getattr(self["layer"], name)
        return super().__getattr__(name)

    def __call__(self, h: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        group, rank = self._group, self._group.rank()
        cache = _cache_of(args, kwargs)
        if self._receive:  # still depends on h, so the embedding's cache bookkeeping runs
            h = mx.depends(mx.distributed.recv_like(h, rank - 1, group=group), h)
        if self._here:
            if self._timed_in is not None:
                h = self._timed_in.received(h)
            h = self.layer(h, *args, **kwargs)
            if self._timed_out is not None:
                h = self._timed_out.computed(h)
        elif hasattr(cache, "update_and_fetch"):
            empty = mx.zeros((h.shape[0], 1, h.shape[1], 0), dtype=h.dtype)
            keys, _ = cache.update_and_fetch(empty, empty)
            h = cast(mx.array, mx.depends(h, keys))
        if self._send:
            h = mx.distributed.send(h, rank + 1, group=group)
            if getattr(cache, "keys", None) is not None:  # evaluating the cache sends
                cache.keys = mx.depends(cache.keys, h)
        if self._gather:
            h = mx.distributed.all_gather(h, group=group)[-h.shape[0] :]
        return h


def _shell(layer: Any) -> Any:
    """The layer with its settings and no weights (none of them is ever read)."""
    return layer.update(tree_map(lambda a: mx.zeros((0,), a.dtype), layer.parameters()))


def _owner_of_layers(model: Any) -> Any:
    """The module whose `layers` list holds the blocks `model.layers` names (the model's
    inner model, or a language model inside a multimodal one).

    Raises:
        ValueError: the model names no blocks, or no module holds them as a list.
    """
    named = list(getattr(model, "layers", None) or ())
    if named:
        for _, module in model.named_modules():
            held = module.get("layers") if isinstance(module, dict) else None
            if isinstance(held, list) and [id(b) for b in held] == [id(b) for b in named]:
                return module
    raise ValueError(f"{type(model).__module__} has no layer list to split")


def split_layers(model: Any, group: Any, start: int, end: int, pace: Pace | None = None) -> None:
    """Make `model` run layers `[start, end)` here and the rest on the group's other ranks
    (a group of one keeps the model as it is); with `pace`, time this rank's sampled
    steps: its input to layer `start` as wait, its layers as work (in a group of one
    too, which is how `bench/recorder_overhead.py` measures what that costs).

    Raises:
        ValueError: the model has no layer list, or the slice is not within it.
    """
    inner = _owner_of_layers(model)
    layers: list[Any] = inner["layers"]
    count, rank, last = len(layers), group.rank(), group.size() - 1
    if not 0 <= start < end <= count:
        raise ValueError(f"layers [{start}, {end}) are not within the model's {count}")
    if last == 0 and pace is None:
        return
    inner.layers = [
        _Stage(
            layer if start <= i < end else _shell(layer),
            group,
            here=start <= i < end,
            receive=i == start and rank > 0,
            send=i == end - 1 and rank < last,
            gather=i == count - 1 and last > 0,
            timed_in=pace if i == start else None,
            timed_out=pace if i == end - 1 else None,
        )
        for i, layer in enumerate(layers)
    ]
