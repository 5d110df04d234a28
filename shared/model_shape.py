"""A model's shape as placement needs it: its layer count and the bytes of its weights,
read from the model's own directory, on a node that holds it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ModelShape", "UnreadableModelError", "Unsupported", "read_shape"]


@dataclass(frozen=True, slots=True)
class ModelShape:
    """How many layers a model has and how many bytes its weights take."""

    n_layers: int
    model_bytes: int
    kv_shared_layers: int = 0
    """Trailing layers that read the KV cache of earlier layers (gemma3n, gemma4): a split
    across ranks cannot give it to them."""


@dataclass(frozen=True, slots=True)
class Unsupported:
    """A model a node can read but that cannot run as asked, whatever node holds it."""

    reason: str


class UnreadableModelError(ValueError):
    """A directory that is not a readable model; the message says what is missing."""


def read_shape(directory: Path) -> ModelShape:
    """Read the layer count from `config.json` and the weight bytes from the safetensors
    files (a multimodal model's text config holds its layers).

    Raises:
        UnreadableModelError: the directory is not a readable model.
    """
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise UnreadableModelError(f"no readable config.json ({exc})") from None
    if not isinstance(config, dict):
        raise UnreadableModelError("config.json is not an object")
    text = config.get("text_config", config)
    layers = next(
        (text[k] for k in ("num_hidden_layers", "n_layer", "num_layers") if k in text), None
    )
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        raise UnreadableModelError("config.json has no layer count")
    shared = text.get("num_kv_shared_layers") or 0
    if not isinstance(shared, int) or isinstance(shared, bool) or not 0 <= shared < layers:
        raise UnreadableModelError(f"config.json has a bad num_kv_shared_layers: {shared!r}")
    try:
        weights = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    except OSError as exc:
        raise UnreadableModelError(f"weights not readable ({exc})") from None
    if weights == 0:
        raise UnreadableModelError("no *.safetensors weights")
    return ModelShape(n_layers=layers, model_bytes=weights, kv_shared_layers=shared)
