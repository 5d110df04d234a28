"""Run a service in the foreground until SIGINT or SIGTERM, and always exit after that;
non-zero when its NATS connection closed for good, so that its supervisor restarts it.
Every service starts on NATS the same way (`connected`)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import uvloop
from nats.aio.client import Client
from nats.js import JetStreamContext

from rankscope.shared.connection import ConnectionLostError, Lifeline, connect
from rankscope.shared.jetstream import Layout
from rankscope.shared.provision import LayoutError, ensure
from rankscope.shared.settings import Settings

__all__ = [
    "SHUTDOWN_GRACE_S",
    "Connected",
    "connected",
    "quiet_closed_writes",
    "run_until_signalled",
]

log = logging.getLogger("rankscope")

SHUTDOWN_GRACE_S = 8.0
"""How long a clean shutdown may take before the process exits regardless (a shutdown
that waits on a NATS server that is gone must not keep the process alive)."""


def run_until_signalled(
    serve_until: Callable[[Settings, asyncio.Event], Awaitable[None]], settings: Settings
) -> int:
    """Call `serve_until(settings, stop)`, setting `stop` on SIGINT or SIGTERM; exit code."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(quiet_closed_writes)
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        serving = asyncio.ensure_future(serve_until(settings, stop))
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not serving.done():
            try:
                await asyncio.wait_for(asyncio.shield(serving), SHUTDOWN_GRACE_S)
            except TimeoutError:
                log.error("shutdown took over %gs; exiting anyway", SHUTDOWN_GRACE_S)
                logging.shutdown()
                os._exit(1)
        stopping.cancel()
        serving.result()

    try:
        uvloop.run(main())  # libuv's loop: less of each message and request is overhead
    except ConnectionLostError:
        return 1  # logged when it closed
    except (LayoutError, StartError) as exc:
        log.error("%s", exc)
        return 1
    return 0


class StartError(RuntimeError):
    """A service that cannot start, said in one line (a port taken, ...)."""


def quiet_closed_writes(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The loop's handler of errors no task retrieved: a write to a connection already
    closed is one debug line (the NATS client flushes what it still holds as it closes a
    connection the server dropped: uvloop raises where asyncio's own loop lets it pass,
    MagicStack/uvloop#506, and the flush meets a reset connection when the server drops it
    first), not a traceback on a service's way out; the rest as asyncio reports them."""
    error = context.get("exception")
    if (
        isinstance(error, RuntimeError) and str(error).endswith("the handler is closed")
    ) or isinstance(error, ConnectionResetError | BrokenPipeError):
        log.debug("a write after its connection closed: %s", error)
        return
    loop.default_exception_handler(context)


@dataclass(frozen=True, slots=True)
class Connected:
    """A service's NATS connection, its JetStream context and the installation's layout."""

    nc: Client
    js: JetStreamContext
    layout: Layout


async def connected(
    stack: AsyncExitStack,
    settings: Settings,
    name: str,
    stop: asyncio.Event,
    *,
    owner: bool = True,
) -> Connected:
    """Connect service `name` (closed with `stack`; `stop` is set when the connection
    closes for good) and make sure the installation's streams and buckets are there
    (made or updated by an `owner`, else waited for)."""
    lifeline = stack.enter_context(Lifeline(stop))
    nc = await connect(settings, name, on_lost=lifeline)
    stack.push_async_callback(lifeline.close, nc)
    js = nc.jetstream()
    layout = Layout.from_settings(settings)
    await ensure(js, layout, owner=owner)
    return Connected(nc, js, layout)
