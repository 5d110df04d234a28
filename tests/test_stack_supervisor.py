"""`up` does not call the demo ready while one of its services is down or crash-looping."""

from __future__ import annotations

import asyncio

from rankscope.services.stack.supervisor import ChildSpec, Supervisor
from tests.stack_up import free_port


async def test_a_crash_looping_child_is_unsteady_and_a_running_one_is_not() -> None:
    gateway = ["gateway", "--gateway-port", str(free_port())]
    supervisor = Supervisor(
        [ChildSpec("broken", ["no-such-command"]), ChildSpec("gateway", gateway)],
        env={"RANKSCOPE_NATS_URL": f"nats://127.0.0.1:{free_port()}"},  # it serves, not ready
    )
    assert supervisor.unsteady() == ["broken", "gateway"]  # nothing started yet
    stop = asyncio.Event()
    running = asyncio.create_task(supervisor.run(stop))
    try:
        for _ in range(60):  # the broken one exits at once and again after each backoff
            await asyncio.sleep(0.1)
            assert "gateway" not in supervisor.unsteady()
        assert supervisor.unsteady() == ["broken"]
    finally:
        stop.set()
        await running
