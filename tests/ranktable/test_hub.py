"""The rank-table hub: followers of unknown jobs cost nothing once they leave."""

from __future__ import annotations

import asyncio

from rankscope.services.ranktable.hub import TableHub
from rankscope.shared.wire import RankTableStream


async def _first(hub: TableHub, job_id: str) -> tuple[int, RankTableStream]:
    async for found in hub.follow(job_id):
        return found
    raise AssertionError("the follow ended")


async def test_followers_of_unknown_jobs_leave_nothing_behind() -> None:
    hub = TableHub()
    waiting = [asyncio.create_task(_first(hub, f"nobody-{n}")) for n in range(1000)]
    await asyncio.sleep(0)
    assert len(hub._changed) == 1000
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert hub._changed == {}
    assert hub._following == {}


async def test_a_job_s_followers_get_its_table_and_leave_nothing_behind() -> None:
    hub = TableHub()
    followers = [asyncio.create_task(_first(hub, "job")) for _ in range(3)]
    await asyncio.sleep(0)
    table = RankTableStream(jobId="job", rankTable="{}")
    hub.publish("job", 1, table)
    assert await asyncio.gather(*followers) == [(1, table)] * 3
    assert hub._following == {}
