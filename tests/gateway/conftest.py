"""A real stack for gateway tests: nats-server, aggregator, rank-table service and the
gateway on uvicorn, all in this process's loop, talking over real sockets."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import pytest
import uvicorn
from nats.aio.client import Client
from nats.js.kv import KeyValue

from rankscope.services.aggregator.main import serve_until as aggregator
from rankscope.services.gateway.app import create_app
from rankscope.services.ranktable.main import serve_until as ranktable
from rankscope.shared.jetstream import Layout
from rankscope.shared.provision import ensure
from rankscope.shared.settings import Settings
from rankscope.shared.subjects import token
from rankscope.shared.wire import encode
from tests.ranktable.builders import node_info
from tests.stack_up import free_port


@dataclass
class Stack:
    settings: Settings
    layout: Layout
    nc: Client
    http: httpx.AsyncClient
    aggregators: dict[int, tuple[asyncio.Event, asyncio.Task[None]]] = field(default_factory=dict)
    """The running aggregator of each partition: its stop event and task."""

    def start_aggregator(self, partition: int = 0) -> None:
        stop = asyncio.Event()
        configured = replace(self.settings, aggregator_partition=partition)
        self.aggregators[partition] = stop, asyncio.create_task(aggregator(configured, stop))

    async def stop_aggregator(self, partition: int = 0) -> None:
        stop, task = self.aggregators.pop(partition)
        stop.set()
        await task


async def _ready(http: httpx.AsyncClient) -> None:
    """Wait for uvicorn to listen and the stack behind it to be ready (10 s at most)."""
    for _ in range(200):
        with contextlib.suppress(httpx.TransportError):
            if (await http.get("/readyz")).status_code == 200:
                return
        await asyncio.sleep(0.05)
    raise AssertionError("the gateway never became ready")


async def _beat(kv: KeyValue) -> None:
    """Two nodes' inventory entries, stamped now, as their agents' heartbeats write them."""
    for info in (node_info("node-a", 24), node_info("node-b", 8)):
        await kv.put(token(info.nodeId), encode(info))


async def _heartbeats(kv: KeyValue, every: float) -> None:
    """The nodes' entries put again every `every` seconds: no agent answers for them
    (their ranks are dead to the aggregator's probes), but the rank-table service keeps
    them however long a loaded machine makes a test (one expiring before the other is a
    lost node, and its instance is placed again)."""
    while True:
        await asyncio.sleep(every)
        await _beat(kv)


@pytest.fixture
async def stack_for(nc: Client, settings: Settings, layout: Layout) -> AsyncIterator[object]:
    """A factory: `await stack_for(api_token=...)` starts the stack with those settings."""
    started: list[tuple[asyncio.Event, list[asyncio.Task[None]], uvicorn.Server, Stack]] = []
    heartbeats: list[asyncio.Task[None]] = []

    async def start(**changes: Any) -> Stack:
        configured = replace(
            settings, grpc_port=0, gateway_port=free_port(), request_timeout=2.0, **changes
        )
        await ensure(nc.jetstream(), layout)
        kv = await nc.jetstream().key_value(layout.nodes_bucket.bucket)
        await _beat(kv)
        heartbeats.append(asyncio.create_task(_heartbeats(kv, layout.node_ttl_s / 4)))
        stop = asyncio.Event()
        tasks = [asyncio.create_task(ranktable(configured, stop))]
        server = uvicorn.Server(
            uvicorn.Config(
                create_app(configured),
                host="127.0.0.1",
                port=configured.gateway_port,
                log_config=None,
            )
        )
        tasks.append(asyncio.create_task(server.serve()))
        http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{configured.gateway_port}", timeout=10)
        built = Stack(configured, layout, nc, http)
        for partition in range(configured.aggregator_partitions):
            built.start_aggregator(partition)
        await _ready(http)
        started.append((stop, tasks, server, built))
        return built

    yield start
    for beating in heartbeats:
        beating.cancel()
    for stop, tasks, server, built in started:
        await built.http.aclose()
        server.should_exit = True
        stop.set()
        for partition in list(built.aggregators):
            await built.stop_aggregator(partition)
        await asyncio.gather(*tasks)
