"""Request bodies: decoded with msgspec, unknown fields refused with their JSON path."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from services.gateway.responses import fail

__all__ = ["strict"]

T = TypeVar("T")


def _unknown(given: Any, known: Any, path: str) -> str | None:
    if isinstance(given, dict) and isinstance(known, dict):
        for key, value in given.items():
            if key not in known:
                return f"{path}.{key}"
            found = _unknown(value, known[key], f"{path}.{key}")
            if found:
                return found
    elif isinstance(given, list) and isinstance(known, list):
        for index, (item, kept) in enumerate(zip(given, known, strict=False)):
            found = _unknown(item, kept, f"{path}[{index}]")
            if found:
                return found
    return None


def strict(data: bytes, tp: type[T], *, free: frozenset[str] = frozenset({"metadata"})) -> T:
    """Decode a body as `tp`; 422 naming the JSON path on a bad value or an unknown field
    (fields named in `free`, free-form by design, are not checked inside).

    Raises:
        HTTPException: 422.
    """
    try:
        value = msgspec.json.decode(data, type=tp)
        raw = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise fail(422, f"invalid body: {exc}") from None
    known = msgspec.to_builtins(value)
    for name in free:
        _drop(raw, name)
        _drop(known, name)
    unknown = _unknown(raw, known, "$")
    if unknown:
        raise fail(422, f"invalid body: unknown field `{unknown}`")
    return value


def _drop(tree: Any, name: str) -> None:
    if isinstance(tree, dict):
        tree.pop(name, None)
        for value in tree.values():
            _drop(value, name)
    elif isinstance(tree, list):
        for value in tree:
            _drop(value, name)
