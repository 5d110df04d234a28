"""`unless_stopped`: what waits on NATS gives way to a stop, and never outlives its caller."""

from __future__ import annotations

import asyncio

import pytest

from rankscope.shared.connection import unless_stopped


async def _work(ended: list[str], seconds: float, fails: bool = False) -> None:
    try:
        await asyncio.sleep(seconds)
        if fails:
            raise ValueError("the work failed")
        ended.append("done")
    except asyncio.CancelledError:
        ended.append("cancelled")
        raise


async def test_work_done_before_a_stop_ran_to_its_end_and_its_error_is_raised() -> None:
    ended: list[str] = []
    assert await unless_stopped(_work(ended, 0), asyncio.Event())
    assert ended == ["done"]
    with pytest.raises(ValueError, match="the work failed"):
        await unless_stopped(_work(ended, 0, fails=True), asyncio.Event())


async def test_a_stop_cancels_the_work_and_says_it_did_not_run_to_its_end() -> None:
    ended: list[str] = []
    stop = asyncio.Event()
    asyncio.get_running_loop().call_soon(stop.set)
    assert not await unless_stopped(_work(ended, 3600), stop)
    assert ended == ["cancelled"]  # ended before unless_stopped returned


async def test_a_caller_cancelled_takes_the_work_with_it() -> None:
    ended: list[str] = []
    caller = asyncio.ensure_future(unless_stopped(_work(ended, 3600), asyncio.Event()))
    await asyncio.sleep(0)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await asyncio.sleep(0)
    assert ended == ["cancelled"]
