"""A real aggregator on a real nats-server, and the few steps every test of it takes."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from rankscope.services.aggregator.service import AggregatorService
from rankscope.services.aggregator.store import EntryStore
from rankscope.services.aggregator.views import ClusterState
from rankscope.shared.jetstream import Layout
from rankscope.shared.wire import InstanceCreated, PhaseEntries, encode

__all__ = ["WAIT", "Running", "aggregator", "publish", "query", "until"]

WAIT = 10.0


@dataclass
class Running:
    service: AggregatorService
    stop: asyncio.Event
    task: asyncio.Task[None]

    async def halt(self) -> None:
        self.stop.set()
        await self.task


@contextlib.asynccontextmanager
async def aggregator(
    nc: Client, layout: Layout, store: EntryStore | None = None, **options: Any
) -> AsyncIterator[Running]:
    service = AggregatorService(
        nc=nc,
        js=nc.jetstream(),
        layout=layout,
        state=ClusterState(store=store or EntryStore()),
        node_id="agg",
        **options,
    )
    stop = asyncio.Event()
    running = Running(service, stop, asyncio.create_task(service.run(stop)))
    await asyncio.wait_for(service.ready.wait(), WAIT)
    try:
        yield running
    finally:
        if not running.task.done():
            await running.halt()


async def publish(nc: Client, layout: Layout, event: PhaseEntries | InstanceCreated) -> None:
    js = nc.jetstream()
    if isinstance(event, PhaseEntries):
        ref = event.runner
        subject = layout.subjects.runner(ref.nodeId, ref.instanceId, ref.deviceRank, "phase")
    else:
        subject = layout.subjects.placement(event.instanceId)
    await js.publish(subject, encode(event))


async def query(nc: Client, layout: Layout, view: str, body: object = None) -> Msg:
    return await nc.request(
        layout.subjects.query(view), json.dumps(body or {}).encode(), timeout=WAIT
    )


async def until(check: object) -> None:
    for _ in range(int(WAIT / 0.02)):
        if check():  # type: ignore[operator]
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")
