"""A network partition, made with a network namespace: node-b's agent and runner live in
their own namespace, joined to the host by a veth pair. Cutting the link looks like a lost
node to everyone else (within two heartbeat TTLs); when the link returns, the node rejoins
and what it recorded while cut off arrives, each entry once."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
import pytest_asyncio

from rankscope.shared.nats_server import EmbeddedNats
from rankscope.shared.timestamps import format_ts, to_epoch
from rankscope.shared.wire import ClusterTimeline, Phase, decode
from tests.reliability.deployment import FAULT_TEST_MARKS, Deployment, deployed, node_loss_seen
from tests.reliability.netns import Link, behind, namespaces_work
from tests.stack_up import free_port

pytestmark = FAULT_TEST_MARKS

TTL = 3.0


@pytest.fixture(scope="module")
def link() -> Iterator[Link]:
    if not namespaces_work():
        pytest.skip("needs root and `ip netns` (iproute2) to build a network namespace")
    with Link() as made:
        yield made


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def deployment(
    link: Link, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Deployment]:
    root = tmp_path_factory.mktemp("partition")
    port = free_port()
    server = EmbeddedNats(store_dir=root / "nats", host="0.0.0.0", port=port).start()
    agents = behind(link, port)
    async with deployed(root, server, agents, heartbeat_ttl=TTL, collective_timeout=4.0) as built:
        yield built
    server.stop()


async def test_a_cut_link_is_a_lost_node_and_the_mended_link_brings_everything_back(
    link: Link, deployment: Deployment
) -> None:
    lost = {r.nodeId: r for r in (await deployment.timeline()).runners}["node-b"]
    await deployment.generate("partition", max_tokens=3000)
    await deployment.until(
        "decoding", lambda: deployment.entries("partition", Phase.DECODE_STREAM), 60
    )
    cut_at = time.time()
    await node_loss_seen(deployment, "node-b", link.cut, TTL)
    await asyncio.sleep(max(0.0, cut_at + 2 * TTL + 2 - time.time()))  # its watchdog fires
    link.mend()
    mended_at = time.time()

    async def rejoined() -> bool | None:
        found = await deployment.timeline()
        return None if any(n.nodeId == "node-b" for n in found.unreachableNodes) else True

    await deployment.until("node-b rejoined", rejoined, 30)

    async def buffered() -> list[str] | None:  # the events, if any arrived
        reply = await deployment.http.get(
            "/v1/cluster/timeline",
            params={
                "nodeId": "node-b",
                "since": format_ts(datetime.fromtimestamp(cut_at, tz=UTC)),
                "limit": 100_000,
            },
        )
        mine = [e for e in decode(reply.content, ClusterTimeline).timeline
                if e.runnerId == lost.runnerId and to_epoch(e.at) < mended_at]  # fmt: skip
        return [e.event for e in mine] if mine else None

    # what node-b's runner recorded on the far side (its watchdog, its exit) arrives
    await deployment.until("entries recorded while cut off", buffered, 30)

    async def complete() -> bool | None:  # retried batches may land after later ones
        health = (await deployment.nc.request("rankscope.query.health", b"")).data
        return None if lost.runnerId in decode(health, dict[str, Any])["missingSeqs"] else True

    await deployment.until(f"every seq of {lost.runnerId}", complete, 30)
    reply = await deployment.http.get(
        "/v1/cluster/timeline", params={"nodeId": "node-b", "limit": 100_000}
    )
    times = Counter(
        (e.runnerId, e.at, e.phase, e.event)
        for e in decode(reply.content, ClusterTimeline).timeline
    )
    assert [key for key, n in times.items() if n > 1] == [], "an entry arrived twice"
