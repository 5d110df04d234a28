"""`rankscope gateway`: the HTTP API and web timeline on uvicorn."""

from __future__ import annotations

import uvicorn

from services.gateway.app import create_app
from shared.settings import Settings

__all__ = ["run"]


def run(settings: Settings) -> int:
    """Serve until SIGINT or SIGTERM; returns the exit code."""
    config = uvicorn.Config(
        create_app(settings),
        host=settings.gateway_host,
        port=settings.gateway_port,
        log_config=None,
        timeout_graceful_shutdown=5,
    )
    uvicorn.Server(config).run()
    return 0
