"""An agent acts on the placement as it stands, not on its history: started after an
instance was placed and released, it starts no runner for it."""

from __future__ import annotations

import asyncio
import functools
from datetime import UTC, datetime, timedelta

import msgspec
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from rankscope.services.agent.agent import Agent
from rankscope.shared.jetstream import Layout
from rankscope.shared.provision import ensure
from rankscope.shared.replay import follow
from rankscope.shared.telemetry import TelemetryPublisher
from rankscope.shared.timestamps import format_ts, later, now
from rankscope.shared.wire import (
    GenerationRequest,
    InstanceReleased,
    ReleaseCause,
    TaskCreated,
    TaskKind,
    TaskStatus,
    TaskStatusChanged,
    decode,
    encode,
)
from tests.aggregator.builders import placed
from tests.ranktable.builders import node_info

pytestmark = [pytest.mark.nats, pytest.mark.mlx]


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
    agent = Agent(nc=nc, js=js, layout=layout, node=describe, publisher=TelemetryPublisher(nc=nc))
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


def _task(task_id: str, deadline: str) -> TaskCreated:
    return TaskCreated(
        at=now(),
        deadline=deadline,
        taskId=task_id,
        instanceId="kept",
        taskKind=TaskKind.TEXT_GENERATION,
        commandId=f"cmd-{task_id}",
        request=GenerationRequest(prompt="hi", maxTokens=2),
    )


def _status(task_id: str, status: TaskStatus) -> TaskStatusChanged:
    return TaskStatusChanged(
        at=now(), taskId=task_id, instanceId="kept", taskStatus=status, runnerId="kept-r1"
    )


async def test_a_restarted_agent_runs_no_task_that_finished_started_or_expired_before(
    nc: Client, layout: Layout
) -> None:
    js, subjects = nc.jetstream(), layout.subjects
    await ensure(js, layout)
    created = msgspec.structs.replace(placed("kept"), modelPath="/nonexistent/model")
    await js.publish(subjects.placement("kept"), encode(created))
    past = format_ts(datetime.now(UTC) - timedelta(seconds=1))
    stored = [
        _task("done", later(300)),
        _task("started", later(300)),
        _task("late", past),
        _task("waiting", later(300)),
        _status("done", TaskStatus.COMPLETE),  # its final status comes after it in the stream
        _status("started", TaskStatus.RUNNING),  # a rank began it before the restart
    ]
    for event in stored:
        subject = (
            subjects.tasks("kept")
            if isinstance(event, TaskCreated)
            else subjects.task_status("kept", "node-1")
        )
        await js.publish(subject, encode(event))
    said: list[TaskStatusChanged] = []

    async def keep(msg: Msg) -> None:
        said.append(decode(msg.data, TaskStatusChanged))

    await nc.subscribe(subjects.task_status("kept", "node-0"), cb=keep)
    describe = functools.partial(node_info, "node-0", 24)
    publisher, publishing = TelemetryPublisher(nc=nc), asyncio.Event()
    sending = asyncio.create_task(publisher.run(publishing))
    agent = Agent(nc=nc, js=js, layout=layout, node=describe, publisher=publisher)
    follower = await follow(js, subjects.placement_all(), agent.on_placement)
    await follower.caught_up.wait()
    await agent.catch_up()
    try:
        for _ in range(200):
            if len(said) >= 2:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # and nothing more
        assert sorted((s.taskId, s.taskStatus) for s in said) == [
            ("late", TaskStatus.TIMED_OUT),
            ("started", TaskStatus.FAILED),
        ]
        assert all(s.runnerId == "kept-r0" for s in said)
    finally:
        await follower.stop()
        await agent.shutdown()
        publishing.set()
        await sending
