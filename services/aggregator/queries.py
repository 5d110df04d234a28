"""The aggregator's answers to `rankscope.query.<view>`: one endpoint per view of the NATS
micro service, big timelines built a slice at a time in a lane of their own, identical
timeline queries answered once."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

from nats.aio.client import Client
from nats.micro import add_service
from nats.micro.request import Request, ServiceError
from nats.micro.service import Service

from rankscope.services.aggregator import answers
from rankscope.services.aggregator.bounds import diagnosis_answer
from rankscope.services.aggregator.rules import Thresholds
from rankscope.services.aggregator.views import ClusterState
from rankscope.shared.partitions import Partition
from rankscope.shared.subjects import AGGREGATOR_SERVICE, Subjects
from rankscope.shared.timestamps import now
from rankscope.shared.views import HISTORY, INSTANCES, TIMELINE, VIEWS, View
from rankscope.shared.wire import (
    AggregatorHealth,
    DiagnosisQuery,
    Finding,
    PlacementQuery,
    TimelineQuery,
    WireError,
    decode,
    encode,
)

__all__ = ["Queries"]

SERVICE_VERSION = version("rankscope")

ANSWER_REUSE_S = 0.5
"""How long an unchanged view's answer may be served again (its `secondsInPhase` ages)."""
ANSWER_CACHE_BYTES = 128 << 20
"""Bytes of timeline answers kept for reuse; the oldest go first."""
HEAVY_ENTRIES = 5_000
"""Timelines of more entries than this are built in a lane of their own, a slice at a
time, so a small query never waits behind them for more than one slice."""
SLICE_ENTRIES = 2_000
"""Entries built between two turns of the other queries."""


class Queries:
    """Answers the views of `state`.

    Args:
        nc: NATS connection.
        subjects: where the queries come.
        state: the views.
        partition: the partition it answers for.
        node_id: this aggregator's node id (`localNodeId` of the timeline by default).
        findings: the open findings (the diagnosis view).
        health: readiness and counters (the health view).
        arrivals: the steps compared to say how long each job waits for each rank.
        clock: monotonic seconds.
        wall: seconds since the epoch (how long a rank has been in its phase).
    """

    def __init__(
        self,
        *,
        nc: Client,
        subjects: Subjects,
        state: ClusterState,
        partition: Partition,
        node_id: str,
        findings: Callable[[], list[Finding]],
        health: Callable[[], AggregatorHealth],
        thresholds: Thresholds,
        clock: Callable[[], float],
        wall: Callable[[], float],
    ) -> None:
        self._nc = nc
        self._subjects = subjects
        self._state = state
        self._partition = partition
        self._node_id = node_id
        self._findings = findings
        self._health = health
        self._thresholds = thresholds
        self._clock = clock
        self._wall = wall
        self._cache: dict[bytes, tuple[int, float, bytes]] = {}
        self._cache_bytes = 0
        self._heavy_lane = asyncio.Semaphore(1)
        self.heavy: set[asyncio.Task[None]] = set()

    async def serve(self) -> Service:
        """Answer queries from now on: it joins its partition's queue group only once its
        views are built, so a restarted twin never answers in place of a ready one."""
        part = self._partition
        queries = await add_service(
            self._nc,
            name=AGGREGATOR_SERVICE,
            version=SERVICE_VERSION,
            description="Cross-rank views of every runner's flight recorder",
            metadata={"partition": str(part)},
        )
        for view in VIEWS:  # one endpoint each; twins share the requests, any one answering
            await queries.add_endpoint(
                name=view.name,
                subject=self._subjects.query(view.name, part.index, part.count),
                handler=functools.partial(self._answer, view),
            )
        return queries

    async def _answer(self, view: View[Any], request: Request) -> None:
        data = request.data or b"{}"
        query = self._heavy_timeline_query(view, data)
        if query is None:
            await request.respond(self._answerable(self._query(view, data)))
            return
        task = asyncio.create_task(self._respond_heavy(request, data, query))
        self.heavy.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self.heavy.discard)

    def _heavy_timeline_query(self, view: View[Any], data: bytes) -> TimelineQuery | None:
        if view is not TIMELINE:
            return None
        try:
            query = decode(data, TimelineQuery)
        except WireError:
            return None  # answered as a bad query
        return query if query.limit > HEAVY_ENTRIES else None

    async def _respond_heavy(self, request: Request, data: bytes, query: TimelineQuery) -> None:
        async with self._heavy_lane:
            cached = self._cached(data)
            if cached is None:
                version = self._state.version
                cached = await self._timeline_in_slices(query)
                self._remember(data, version, cached)
        try:
            await request.respond(self._answerable(cached))
        except ServiceError as error:  # answered after the handler returned: by hand
            await request.respond_error(error.code, error.description)

    async def _timeline_in_slices(self, query: TimelineQuery) -> bytes:
        """The timeline's JSON, its entries encoded a slice at a time between turns of the
        other queries and of ingest (the plan holds what it needs of evicted entries)."""
        plan = answers.timeline_plan(
            self._state, query, local_node_id=query.localNodeId or self._node_id, now=self._wall()
        )
        before, after = encode(plan.head).split(b'"timeline":[]', 1)
        pieces = [before, b'"timeline":[']
        for start in range(0, plan.size, SLICE_ENTRIES):
            if start:
                pieces.append(b",")
            pieces.append(encode(plan.entries(start, start + SLICE_ENTRIES))[1:-1])
            await asyncio.sleep(0)
        pieces += [b"]", after]
        return b"".join(pieces)  # one copy of tens of MB, not three

    def _answerable(self, body: bytes) -> bytes:
        if len(body) > self._nc.max_payload:
            raise _failed(
                413,
                f"the answer is {len(body):,} bytes, over the NATS "
                f"limit of {self._nc.max_payload:,}; narrow the query",
            )
        return body

    def _query(self, view: View[Any], data: bytes) -> bytes:
        try:
            asked = decode(data, view.request)
        except WireError as exc:
            raise _failed(422, f"bad {view.name} query: {exc}") from None
        if isinstance(asked, TimelineQuery):
            return self._timeline(data, asked)
        if isinstance(asked, PlacementQuery):
            return self._placement(asked)
        if isinstance(asked, DiagnosisQuery):
            return diagnosis_answer(self._findings(), asked, now())
        if view is INSTANCES:
            return encode(answers.instance_states(self._state))
        if view is HISTORY:
            return encode(answers.history(self._state, self._thresholds))
        return encode(self._health())

    def _placement(self, asked: PlacementQuery) -> bytes:
        found = answers.placement(self._state, local_node_id=asked.localNodeId or self._node_id)
        if asked.runnerId is None:
            return encode(found)
        for item in found:
            if item.runnerId == asked.runnerId:
                return encode(item)
        raise _failed(404, f"no placed runner {asked.runnerId!r}")

    def _timeline(self, data: bytes, query: TimelineQuery) -> bytes:
        """Identical timeline queries within `ANSWER_REUSE_S` of each other, with nothing
        applied in between, share one answer: a roomful of browsers costs one build."""
        answer = self._cached(data)
        if answer is None:
            local = query.localNodeId or self._node_id
            made = answers.timeline(self._state, query, local_node_id=local, now=self._wall())
            answer = encode(made)
            self._remember(data, self._state.version, answer)
        return answer

    def _cached(self, query: bytes) -> bytes | None:
        cached = self._cache.get(query)
        if (
            cached
            and cached[0] == self._state.version
            and self._clock() - cached[1] < ANSWER_REUSE_S
        ):
            return cached[2]
        return None

    def _remember(self, query: bytes, version: int, answer: bytes) -> None:
        """Keep `answer` for reuse within `ANSWER_CACHE_BYTES`, dropping the oldest."""
        if len(answer) > ANSWER_CACHE_BYTES // 2:
            return
        if (old := self._cache.pop(query, None)) is not None:
            self._cache_bytes -= len(old[2])
        while self._cache and self._cache_bytes + len(answer) > ANSWER_CACHE_BYTES:
            self._cache_bytes -= len(self._cache.pop(next(iter(self._cache)))[2])
        self._cache[query] = (version, self._clock(), answer)
        self._cache_bytes += len(answer)


def _failed(status: int, error: str) -> ServiceError:
    """A query the aggregator cannot answer, as a service error whose code is HTTP's."""
    return ServiceError(code=str(status), description=error)
