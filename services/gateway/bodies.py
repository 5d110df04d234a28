"""Request bodies: decoded with msgspec, unknown fields refused with their JSON path."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
from msgspec import inspect

from rankscope.services.gateway.responses import fail

__all__ = ["strict"]

T = TypeVar("T")


def _unknown(given: Any, info: inspect.Type, path: str) -> str | None:
    """The JSON path of the first key in `given` that type `info` has no field for (free
    dicts, such as `metadata`, take any key)."""
    if isinstance(info, inspect.UnionType):
        for member in info.types:
            if isinstance(given, dict) and isinstance(
                member, inspect.StructType | inspect.DictType
            ):
                return _unknown(given, member, path)
            if isinstance(given, list) and isinstance(member, inspect.ListType):
                return _unknown(given, member, path)
        return None
    if isinstance(info, inspect.StructType) and isinstance(given, dict):
        fields = {f.encode_name: f.type for f in info.fields}
        for key, value in given.items():
            if key == info.tag_field:
                continue
            if key not in fields:
                return f"{path}.{key}"
            if found := _unknown(value, fields[key], f"{path}.{key}"):
                return found
    elif isinstance(info, inspect.ListType) and isinstance(given, list):
        for index, item in enumerate(given):
            if found := _unknown(item, info.item_type, f"{path}[{index}]"):
                return found
    return None


def strict(data: bytes, tp: type[T]) -> T:
    """Decode a body as `tp`; 422 naming the JSON path on a bad value or an unknown field.

    Raises:
        HTTPException: 422.
    """
    try:
        value = msgspec.json.decode(data, type=tp)
        raw = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise fail(422, f"invalid body: {exc}") from None
    except RecursionError:
        raise fail(422, "invalid body: nested too deep") from None
    unknown = _unknown(raw, inspect.type_info(tp), "$")
    if unknown:
        raise fail(422, f"invalid body: unknown field `{unknown}`")
    return value
