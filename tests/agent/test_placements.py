"""An agent acts on the placement as it stands, not on its history: started after an
instance was placed and released, it starts no runner for it."""

from __future__ import annotations

import asyncio
import functools

import msgspec
import pytest
from nats.aio.client import Client

from services.agent.agent import Agent
from services.agent.publisher import TelemetryPublisher
from shared.jetstream import Layout, ensure
from shared.replay import follow
from shared.timestamps import now
from shared.wire import InstanceReleased, ReleaseCause, encode
from tests.aggregator.builders import placed
from tests.ranktable.builders import node_info

pytestmark = pytest.mark.nats


async def test_a_restarted_agent_starts_runners_only_for_what_is_still_placed(
    nc: Client, layout: Layout
) -> None:
    js, subjects = nc.jetstream(), layout.subjects
    await ensure(js, layout)
    nowhere = "/nonexistent/model"  # a runner started for it fails: it must not start at all
    for instance in ("gone", "kept"):
        created = msgspec.structs.replace(placed(instance), modelPath=nowhere)
        await js.publish(subjects.placement(instance), encode(created))
    released = InstanceReleased(
        at=now(), instanceId="gone", cause=ReleaseCause.SPEC_DELETED, reason="spec deleted"
    )
    await js.publish(subjects.placement("gone"), encode(released))
    describe = functools.partial(node_info, "node-0", 24)
    agent = Agent(nc=nc, js=js, layout=layout, node=describe, publisher=TelemetryPublisher(js=js))
    follower = await follow(js, subjects.placement_all(), agent.on_placement)
    await follower.caught_up.wait()
    assert agent.supervisors == {}, "nothing starts while the stream is replayed"
    await agent.catch_up()
    try:
        assert set(agent.supervisors) == {"kept-r0"}
        gone = msgspec.structs.replace(released, instanceId="kept")
        await js.publish(subjects.placement("kept"), encode(gone))  # after: acted on at once
        for _ in range(200):
            if not agent.supervisors:
                break
            await asyncio.sleep(0.05)
        assert agent.supervisors == {}
    finally:
        await follower.stop()
        await agent.shutdown()
