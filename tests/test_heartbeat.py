"""A node's inventory entry lives while its heartbeat does."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from nats.aio.client import Client
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from rankscope.shared.heartbeat import Heartbeat
from rankscope.shared.jetstream import Layout
from rankscope.shared.provision import ensure
from rankscope.shared.subjects import token
from rankscope.shared.wire import NodeInfo, decode
from tests.ranktable.builders import node_info

pytestmark = pytest.mark.nats


async def _nodes(nc: Client, layout: Layout) -> KeyValue:
    js = nc.jetstream()
    await ensure(js, layout)
    return await js.key_value(layout.nodes_bucket.bucket)


async def test_beat_writes_the_entry_under_the_node_key(nc: Client, layout: Layout) -> None:
    kv = await _nodes(nc, layout)
    info = node_info("node a.1", 12)
    await Heartbeat(kv=kv, describe=lambda: info, interval=1).beat()
    entry = await kv.get(token("node a.1"))
    assert decode(entry.value or b"", NodeInfo) == info


async def test_clean_stop_removes_the_entry_at_once(nc: Client, layout: Layout) -> None:
    kv = await _nodes(nc, layout)
    stop = asyncio.Event()
    beating = asyncio.create_task(
        Heartbeat(kv=kv, describe=lambda: node_info("node-a", 1), interval=0.05).run(stop)
    )
    watcher = await kv.watch(token("node-a"))
    first = await asyncio.wait_for(watcher.updates(), 5)
    assert first is not None
    stop.set()
    await beating
    with pytest.raises(KeyNotFoundError):
        await kv.get(token("node-a"))
    await watcher.stop()


async def test_entry_expires_when_beats_stop(nc: Client, layout: Layout) -> None:
    kv = await _nodes(nc, replace(layout, node_ttl_s=1.0))
    await Heartbeat(kv=kv, describe=lambda: node_info("node-a", 1), interval=1).beat()
    assert await kv.get(token("node-a"))
    for _ in range(60):  # the server expires it on its own schedule; give it 3 TTLs
        try:
            await kv.get(token("node-a"))
        except KeyNotFoundError:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the node entry outlived its TTL")
