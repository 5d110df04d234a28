"""Request dependencies: the bus, and bearer-token checks. They are coroutines because
FastAPI runs a plain function dependency on a worker thread: a hop per dependency per
request, on the path of every query."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request

from rankscope.services.gateway.bus import Bus
from rankscope.services.gateway.responses import fail
from rankscope.shared.settings import Settings

__all__ = ["NOT_YET", "Nats", "bus", "reader", "settings", "writer"]

NOT_YET = "NATS has not answered yet"


async def bus(request: Request) -> Bus:
    """The app's NATS bus; 503 while the gateway has not reached NATS yet."""
    found: Bus | None = request.app.state.bus
    if found is None:
        raise fail(503, NOT_YET)
    return found


Nats = Annotated[Bus, Depends(bus)]
"""A route's bus to the services, once the gateway is connected (503 until then)."""


def settings(request: Request) -> Settings:
    """The app's settings."""
    found: Settings = request.app.state.settings
    return found


def _check(request: Request) -> None:
    expected = settings(request).api_token
    if expected is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise fail(401, "this endpoint needs 'Authorization: Bearer <token>'")
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise fail(403, "the bearer token is not valid")


async def writer(request: Request) -> None:
    """Changes need the token when one is configured."""
    _check(request)


async def reader(request: Request) -> None:
    """Reads need the token only when configured to."""
    if settings(request).api_token_reads:
        _check(request)
