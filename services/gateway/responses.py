"""Responses encoded with msgspec, errors as JSON, and OpenAPI schemas from the structs."""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import HTTPException
from starlette.responses import Response

__all__ = ["Json", "fail", "openapi_components", "schema_ref"]

_encoder = msgspec.json.Encoder()


class Json(Response):
    """A JSON response encoded by msgspec (structs, dicts, lists, or raw JSON bytes)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        if isinstance(content, bytes):
            return content
        return _encoder.encode(content)


def fail(status: int, detail: str) -> HTTPException:
    """An error that becomes `{"detail": ...}` with `status`."""
    return HTTPException(status_code=status, detail=detail)


_components: dict[str, Any] = {}


def schema_ref(shape: Any) -> dict[str, Any]:
    """An OpenAPI response entry for `shape` (a Struct, or a list of one), registering the
    schemas msgspec generates so `/docs` shows the real wire shapes."""
    (schema,), components = msgspec.json.schema_components(
        [shape], ref_template="#/components/schemas/{name}"
    )
    _components.update(components)
    return {"content": {"application/json": {"schema": schema}}}


def openapi_components() -> dict[str, Any]:
    """Every schema registered through `schema_ref`."""
    return dict(_components)
