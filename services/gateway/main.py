"""`rankscope gateway`: the HTTP API and web timeline on uvicorn."""

from __future__ import annotations

import uvicorn

from rankscope.services.gateway.app import create_app
from rankscope.shared.settings import Settings

__all__ = ["run"]


def run(settings: Settings) -> int:
    """Serve until SIGINT or SIGTERM, or until the NATS connection closes for good (exit
    code 1, so that a supervisor restarts it); returns the exit code."""
    lost: list[str] = []

    def stop(reason: str) -> None:
        lost.append(reason)
        server.should_exit = True

    config = uvicorn.Config(
        create_app(settings, on_lost=stop),
        host=settings.gateway_host,
        port=settings.gateway_port,
        log_config=None,
        access_log=settings.access_log,
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    server.run()
    return 1 if lost else 0
