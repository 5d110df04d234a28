"""The gateway's bus: identical queries in flight share one request to the aggregators,
and what one caller does (going away, getting an error) the others see rightly."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from rankscope.services.gateway.bus import Bus, BusError
from rankscope.shared.headers import ERROR_CODE_HEADER, ERROR_HEADER
from rankscope.shared.jetstream import Layout
from rankscope.shared.views import TIMELINE
from rankscope.shared.wire import TimelineQuery

pytestmark = pytest.mark.nats


class Aggregator:
    """Answers timeline queries on the bus after `delay` seconds (each with its own
    number), or with an error while `failing`; counts what it was asked."""

    def __init__(self, nc: Client, layout: Layout, delay: float = 0.3) -> None:
        self.nc, self.subject, self.delay = nc, layout.subjects.query("timeline"), delay
        self.asked: list[bytes] = []
        self.failing = False
        self.answering: set[asyncio.Task[None]] = set()

    async def arrived(self, msg: Msg) -> None:
        task = asyncio.create_task(self.answer(msg))  # answered side by side, as a service does
        self.answering.add(task)
        task.add_done_callback(self.answering.discard)

    async def answer(self, msg: Msg) -> None:
        self.asked.append(msg.data)
        number = len(self.asked)
        await asyncio.sleep(self.delay)
        if self.failing:
            error = {ERROR_CODE_HEADER: "422", ERROR_HEADER: "bad query"}
            await self.nc.publish(msg.reply, b"", headers=error)
        else:
            await msg.respond(b'{"answer":%d}' % number)

    async def __aenter__(self) -> Aggregator:
        self.subscription = await self.nc.subscribe(self.subject, cb=self.arrived)
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.subscription.unsubscribe()


def _bus(nc: Client, layout: Layout) -> Bus:
    return Bus(nc=nc, layout=layout, timeout=5.0, local_node="gw")


async def test_identical_queries_in_flight_are_asked_once(nc: Client, layout: Layout) -> None:
    bus = _bus(nc, layout)
    async with Aggregator(nc, layout) as aggregator:
        same = [bus.query(TIMELINE, TimelineQuery(limit=1000)) for _ in range(20)]
        other = bus.query(TIMELINE, TimelineQuery(limit=10))
        answers = await asyncio.gather(*same, other)
        assert len(aggregator.asked) == 2
        assert len(set(answers[:20])) == 1
        assert answers[20] != answers[0]
        again = await bus.query(TIMELINE, TimelineQuery(limit=1000))  # answered: asked anew
        assert len(aggregator.asked) == 3
        assert again == b'{"answer":3}'


async def test_a_caller_gone_mid_query_leaves_the_answer_to_the_others(
    nc: Client, layout: Layout
) -> None:
    bus = _bus(nc, layout)
    async with Aggregator(nc, layout) as aggregator:
        first = asyncio.create_task(bus.query(TIMELINE, TimelineQuery(limit=5)))
        await asyncio.sleep(0.05)
        rest = [asyncio.create_task(bus.query(TIMELINE, TimelineQuery(limit=5))) for _ in range(3)]
        await asyncio.sleep(0.05)
        first.cancel()  # its client disconnected
        with contextlib.suppress(asyncio.CancelledError):
            await first
        assert await asyncio.gather(*rest) == [b'{"answer":1}'] * 3
        assert len(aggregator.asked) == 1


async def test_an_error_reaches_every_caller_and_is_not_kept(nc: Client, layout: Layout) -> None:
    bus = _bus(nc, layout)
    async with Aggregator(nc, layout) as aggregator:
        aggregator.failing = True
        found = await asyncio.gather(
            *(bus.query(TIMELINE, TimelineQuery(limit=7)) for _ in range(4)), return_exceptions=True
        )
        assert all(isinstance(e, BusError) and e.status == 422 for e in found), found
        aggregator.failing = False
        assert await bus.query(TIMELINE, TimelineQuery(limit=7)) == b'{"answer":2}'
