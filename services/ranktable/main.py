"""`rankscope ranktable`: the rank-table service with its gRPC `config.Config` server."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from rankscope.services.lifecycle import connected, run_until_signalled
from rankscope.services.ranktable.grpc_server import serve
from rankscope.services.ranktable.hub import TableHub
from rankscope.services.ranktable.models import ModelShapes
from rankscope.services.ranktable.recorded import RecordLimits
from rankscope.services.ranktable.service import RankTableService
from rankscope.shared.connection import (
    REACH_CHECK_S,
    Reachability,
    keep_checking,
)
from rankscope.shared.settings import Settings
from rankscope.shared.storage import STORAGE_CHECK_S, Storage

__all__ = ["run", "serve_until"]

log = logging.getLogger("rankscope.ranktable")


async def serve_until(settings: Settings, stop: asyncio.Event) -> None:
    """Run the service and its gRPC server until `stop` is set."""
    async with contextlib.AsyncExitStack() as stack:
        bus = await connected(stack, settings, "rankscope-ranktable", stop)
        nc, js, layout = bus.nc, bus.js, bus.layout
        hub = TableHub()
        server, port = await serve(hub, settings.grpc_host, settings.grpc_port)
        stack.push_async_callback(server.stop, 1.0)
        reach = Reachability(nc, timeout=REACH_CHECK_S)
        storage = Storage(
            js,
            layout.subjects.canary("ranktable"),
            timeout=REACH_CHECK_S,
            streams=layout.stream_names,
        )
        service = RankTableService(
            js=js,
            layout=layout,
            hub=hub,
            port_base=settings.ring_port_base,
            max_replicas=settings.max_replicas,
            max_runners_per_node=settings.max_runners_per_node,
            shapes=ModelShapes(nc, layout.subjects),
            # heartbeats that JetStream did not store are no sign of lost nodes
            connected=lambda: reach.reachable and storage.storing,
            nc=nc,
            record_limits=RecordLimits(
                ranks_per_node=settings.record_ranks_per_node, deadline_s=settings.record_deadline
            ),
        )
        log.info("rank-table service up; gRPC config.Config on port %d", port)
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(keep_checking(reach.check, stop, every=REACH_CHECK_S))
            tasks.create_task(keep_checking(storage.check, stop, every=STORAGE_CHECK_S))
            await service.run(stop)


def run(settings: Settings) -> int:
    """Run in the foreground until SIGINT or SIGTERM; returns the exit code."""
    return run_until_signalled(serve_until, settings)
