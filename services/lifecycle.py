"""Run a service in the foreground until SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable

from shared.settings import Settings

__all__ = ["run_until_signalled"]


def run_until_signalled(
    serve_until: Callable[[Settings, asyncio.Event], Awaitable[None]], settings: Settings
) -> int:
    """Call `serve_until(settings, stop)`, setting `stop` on SIGINT or SIGTERM; exit code."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        await serve_until(settings, stop)

    asyncio.run(main())
    return 0
