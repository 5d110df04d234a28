"""A recorded rank's watcher exits once its rank's end is told, even when a library leaves
a task behind that swallows its cancellation (it would otherwise outlive the job)."""

from __future__ import annotations

import asyncio

from rankscope.services.record.watcher import let_go


async def test_letting_go_names_the_tasks_that_ignore_cancellation_and_waits_no_longer() -> None:
    released = asyncio.Event()

    async def stubborn() -> None:  # as nats.py's reconnect loop (nats-io/nats.py#981)
        while not released.is_set():
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                continue

    obedient = asyncio.create_task(asyncio.sleep(60))
    holding = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    assert await let_go(0.3) == [holding]  # returned while it still runs: not waited for
    assert obedient.cancelled()
    released.set()
    await holding


async def test_with_nothing_left_running_letting_go_returns_at_once() -> None:
    assert await let_go(60) == []
