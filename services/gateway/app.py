"""The FastAPI application: routes, errors, limits, metrics and the web timeline."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.staticfiles import StaticFiles
from fastapi_offline import FastAPIOffline
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import FileResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rankscope.services.gateway.bus import Bus, BusError
from rankscope.services.gateway.metrics import RequestMetrics
from rankscope.services.gateway.responses import ERRORS, Json, openapi_components
from rankscope.services.gateway.routes import (
    chat,
    cluster,
    dumps,
    incidents,
    jobs,
    models,
    ops,
    runners,
    skulk,
)
from rankscope.services.gateway.scatter import MissingPartitions
from rankscope.services.lifecycle import quiet_closed_writes
from rankscope.shared.connection import close, connect
from rankscope.shared.host import hostname
from rankscope.shared.jetstream import Layout
from rankscope.shared.provision import LayoutError, ensure
from rankscope.shared.settings import Settings
from rankscope.shared.subjects import IdTooLongError

__all__ = ["MAX_BODY_BYTES", "create_app"]

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
JOIN_WAIT_S = 2.0
"""How long start-up waits for NATS before serving anyway (not ready until it answers)."""
_TOO_LARGE = f"request body over {MAX_BODY_BYTES} bytes"
WEB = Path(__file__).parent / "web"


class LimitsAndMetrics:
    """Refuse oversize bodies (413) and count every request by route and status.

    A plain ASGI middleware: Starlette's `BaseHTTPMiddleware` would re-stream every
    response body, which costs dearly on large timelines."""

    def __init__(self, app: ASGIApp, metrics: RequestMetrics) -> None:
        self._app = app
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        started, status = time.perf_counter(), 500
        length = Headers(scope=scope).get("content-length")

        async def sent(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        received = 0

        async def counted() -> Message:
            # a body without Content-Length (chunked) is counted as it streams in
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > MAX_BODY_BYTES:
                raise HTTPException(413, _TOO_LARGE)
            return message

        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            refusal = Json({"detail": _TOO_LARGE}, status_code=413)
            await refusal(scope, receive, sent)
        else:
            await self._app(scope, counted, sent)
        path = getattr(scope.get("route"), "path", "unmatched")
        self._metrics.observe(path, scope["method"], status, time.perf_counter() - started)


def create_app(settings: Settings, on_lost: Callable[[str], None] | None = None) -> FastAPI:
    """The gateway for `settings`; NATS is connected when the app starts. `on_lost(reason)`
    is called if the NATS connection closes for good (the server should then exit)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        asyncio.get_running_loop().set_exception_handler(quiet_closed_writes)

        def lost(reason: str) -> None:
            if app.state.bus is not None:
                app.state.bus.lost = reason
            if on_lost is not None:
                on_lost(reason)

        async def join() -> None:
            nc = await connect(settings, "rankscope-gateway", on_lost=lost)
            layout = Layout.from_settings(settings)
            try:
                await ensure(nc.jetstream(), layout)
            except LayoutError as exc:
                await close(nc)
                log.error("%s", exc)
                lost(str(exc))
                return
            app.state.bus = Bus(
                nc=nc,
                layout=layout,
                timeout=settings.request_timeout,
                local_node=settings.node_id or hostname(),
                partitions=settings.aggregator_partitions,
            )

        # Serve at once when NATS is slow to answer (not ready meanwhile), so that the
        # gateway is alive, says why it is not ready, and stops when asked.
        app.state.bus = None
        joining = asyncio.ensure_future(join())
        await asyncio.wait({joining}, timeout=JOIN_WAIT_S)
        yield
        joining.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await joining
        if app.state.bus is not None:
            await close(app.state.bus.nc)

    app = FastAPIOffline(  # /docs from packaged Swagger UI assets: no CDN
        responses=ERRORS,
        title="rankscope",
        version="0.1.0",
        lifespan=lifespan,
        description="Diagnostics plane for pipeline-parallel MLX inference.",
    )
    app.state.settings = settings
    app.state.capturing = set()  # nodes a capture is under way of
    app.state.metrics = RequestMetrics()
    for module in (cluster, incidents, runners, jobs, dumps, chat, models, skulk, ops):
        app.include_router(module.router)
    app.mount("/static", StaticFiles(directory=WEB), name="static")

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(WEB / "index.html")

    @app.exception_handler(BusError)
    async def bus_error(request: Request, exc: BusError) -> Json:
        return Json({"detail": exc.detail}, status_code=exc.status)

    @app.exception_handler(IdTooLongError)
    async def id_too_long(request: Request, exc: IdTooLongError) -> Json:
        return Json({"detail": str(exc)}, status_code=422)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Json:
        return Json({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Json:
        problems = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
        return Json({"detail": "; ".join(problems)}, status_code=422)

    app.add_middleware(MissingPartitions)
    app.add_middleware(LimitsAndMetrics, metrics=app.state.metrics)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            schema.setdefault("components", {}).setdefault("schemas", {}).update(
                openapi_components()
            )
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
