"""The FastAPI application: routes, errors, limits, metrics and the web timeline."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException
from starlette.responses import FileResponse, Response

from services.gateway.bus import Bus, BusError
from services.gateway.metrics import RequestMetrics
from services.gateway.responses import ERRORS, Json, openapi_components
from services.gateway.routes import chat, cluster, jobs, ops, runners
from shared.connection import close, connect
from shared.jetstream import Layout, ensure
from shared.settings import Settings

__all__ = ["MAX_BODY_BYTES", "create_app"]

MAX_BODY_BYTES = 1 << 20
WEB = Path(__file__).parent / "web"


def create_app(settings: Settings) -> FastAPI:
    """The gateway for `settings`; NATS is connected when the app starts."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nc = await connect(settings, "rankscope-gateway")
        layout = Layout.from_settings(settings)
        await ensure(nc.jetstream(), layout)
        app.state.bus = Bus(nc=nc, layout=layout, timeout=settings.request_timeout)
        yield
        await close(nc)

    app = FastAPI(
        responses=ERRORS,
        title="rankscope",
        version="0.1.0",
        lifespan=lifespan,
        description="Diagnostics plane for pipeline-parallel MLX inference.",
    )
    app.state.settings = settings
    app.state.metrics = RequestMetrics()
    for module in (cluster, runners, jobs, chat, ops):
        app.include_router(module.router)
    app.mount("/static", StaticFiles(directory=WEB), name="static")

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(WEB / "index.html")

    @app.exception_handler(BusError)
    async def bus_error(request: Request, exc: BusError) -> Json:
        return Json({"detail": exc.detail}, status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Json:
        return Json({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Json:
        problems = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
        return Json({"detail": "; ".join(problems)}, status_code=422)

    @app.middleware("http")
    async def limits_and_metrics(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        started = time.perf_counter()
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            response: Response = Json(
                {"detail": f"request body over {MAX_BODY_BYTES} bytes"}, status_code=413
            )
        else:
            response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", "unmatched")
        app.state.metrics.observe(
            path, request.method, response.status_code, time.perf_counter() - started
        )
        return response

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
