"""Responses encoded with msgspec, errors as JSON, and OpenAPI schemas from the structs."""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import HTTPException
from starlette.responses import JSONResponse

__all__ = ["ERRORS", "SSE_PING_S", "ErrorBody", "Json", "fail", "openapi_components", "schema_ref"]

SSE_PING_S = 15.0
"""Seconds between comment lines on an idle event stream, so proxies keep it open."""

_encoder = msgspec.json.Encoder()


class Json(JSONResponse):
    """A JSON response encoded by msgspec (structs, dicts, lists, or raw JSON bytes)."""

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


class ErrorBody(msgspec.Struct, kw_only=True, frozen=True):
    """Every error: what went wrong, in one sentence."""

    detail: str


def _errors() -> dict[int | str, dict[str, Any]]:
    reasons = {
        401: "Bearer token missing",
        403: "Bearer token wrong",
        404: "Unknown id",
        409: "Already exists",
        413: "Body too large",
        422: "Bad query or body (the message names the field)",
        503: "NATS or a service behind the gateway not answering",
        504: "No answer in time",
    }
    return {
        status: {"description": why, **schema_ref(ErrorBody)} for status, why in reasons.items()
    }


ERRORS = _errors()
"""Error responses every route may give, for the OpenAPI document."""
