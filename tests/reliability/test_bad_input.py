"""Generated garbage — random bytes, wrong types, huge strings, deep nesting, valid JSON of
the wrong shape — on every subject and bucket the aggregator, the rank-table service and an
agent consume, mixed with valid events: no crash, every valid event applied, every bad one
counted and dead-lettered."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.js.errors import KeyNotFoundError

from rankscope.services.agent.agent import Agent
from rankscope.services.aggregator.service import AggregatorService
from rankscope.services.aggregator.store import EntryStore
from rankscope.services.aggregator.views import ClusterState
from rankscope.services.ranktable.hub import TableHub
from rankscope.services.ranktable.service import RankTableService
from rankscope.shared.connection import connect
from rankscope.shared.jetstream import Layout
from rankscope.shared.nats_server import EmbeddedNats
from rankscope.shared.provision import ensure
from rankscope.shared.replay import follow
from rankscope.shared.settings import Settings
from rankscope.shared.subjects import Subjects
from rankscope.shared.telemetry import TelemetryPublisher
from rankscope.shared.wire import Phase, RunnerSpecStatus, decode, encode
from tests.aggregator.builders import entries, placed, rank
from tests.ranktable.builders import node_info, runner

pytestmark = [pytest.mark.nats, pytest.mark.filterwarnings("ignore:Generating overly large repr")]

VALID_RUNNER = json.loads(encode(entries(rank(0), (0, 1, Phase.IDLE, None))))

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


def _deep(depth: int) -> Any:
    value: Any = "bottom"
    for _ in range(depth):
        value = {"type": "PhaseEntries", "runner": value}
    return value


def _mutated(field: str, value: Any) -> bytes:
    broken = json.loads(json.dumps(VALID_RUNNER))
    broken["runner" if field in VALID_RUNNER["runner"] else "entries"] = (
        {**broken["runner"], field: value} if field in VALID_RUNNER["runner"] else value
    )
    return json.dumps(broken).encode()


def _timed(at: str) -> bytes:
    """A valid batch but for its entry's time."""
    broken = json.loads(json.dumps(VALID_RUNNER))
    broken["entries"][0]["at"] = at
    return json.dumps(broken).encode()


_not_text = st.one_of(st.none(), st.booleans(), st.integers(), st.lists(st.integers(), max_size=2))
_not_rank = st.one_of(
    st.none(), st.text(), st.integers(max_value=-1), st.lists(st.integers(), max_size=2)
)
WRONG = {  # for each field, values of a type it can never take
    "runnerId": _not_text,
    "nodeId": _not_text,
    "instanceId": _not_text,
    "modelId": _not_text,
    "deviceRank": _not_rank,
    "worldSize": st.one_of(_not_rank, st.just(0)),
    "entries": st.one_of(
        st.none(), st.text(), st.integers(), st.dictionaries(st.text(), st.integers())
    ),
}

bad_payloads = st.one_of(
    st.binary(max_size=256),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.integers(min_value=10_000, max_value=500_000).map(lambda n: json.dumps("x" * n).encode()),
    st.integers(min_value=50, max_value=200).map(lambda d: json.dumps(_deep(d)).encode()),
    st.text(max_size=40).map(_timed),  # no time of the wire form, which is 27 characters
    st.one_of(
        *(
            st.tuples(st.just(field), wrong).map(lambda p: _mutated(*p))
            for field, wrong in WRONG.items()
        )
    ),
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with EmbeddedNats(store_dir=Path(tmp_path_factory.mktemp("nats"))) as running:
        yield running


_FUZZED = settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.data_too_large,
    ],
)


async def _aggregator_scenario(
    nc: Client, layout: Layout, garbage: list[tuple[str, bytes]]
) -> None:
    js = nc.jetstream()
    subjects = {
        "runner": layout.subjects.runner("node-0", "i", 0, "phase"),
        "placement": layout.subjects.placement("i"),
        "tasks": layout.subjects.tasks("i"),
    }
    nodes = await js.key_value(layout.nodes_bucket.bucket)
    await js.publish(subjects["placement"], encode(placed()))
    for seq, (where, payload) in enumerate(garbage):
        if where == "nodes":
            await nodes.put(f"garbage-{seq}", payload)
        else:
            await js.publish(subjects[where], payload)
        await js.publish(subjects["runner"], encode(entries(rank(0), (seq, seq, Phase.IDLE, None))))
    await nodes.put("node-0", encode(node_info("node-0", 24)))
    state = ClusterState(store=EntryStore())
    service = AggregatorService(nc=nc, js=js, layout=layout, state=state, node_id="fuzz")
    stop = asyncio.Event()
    running = asyncio.create_task(service.run(stop))
    await asyncio.wait_for(service.ready.wait(), 30)
    await service.dead_letters.settled()
    stop.set()
    await running
    assert state.store.size == len(garbage)  # every valid entry applied
    assert list(state.instances) == ["i"]  # the valid placement too
    assert "node-0" in state.nodes  # and the valid node
    assert service.dead_letters.total == len(garbage)
    assert await _dead_lettered(nc, layout) == len(garbage)


def _garbage(places: list[str], size: int) -> st.SearchStrategy[list[tuple[str, bytes]]]:
    """`size` to twice as many bad payloads, each bound for one of `places`."""
    return st.lists(
        st.tuples(st.sampled_from(places), bad_payloads), min_size=size, max_size=2 * size
    )


@settings(_FUZZED, max_examples=25)
@given(garbage=_garbage(["runner", "placement", "tasks", "nodes"], 20))
def test_garbage_on_every_subject_loses_no_valid_event(
    server: EmbeddedNats, garbage: list[tuple[str, bytes]]
) -> None:
    asyncio.run(_in_space(server.url, _aggregator_scenario, garbage))


@contextlib.asynccontextmanager
async def _fuzz_space(url: str) -> AsyncIterator[tuple[Client, Layout]]:
    """A layout of its own for one example, removed afterwards (JetStream's storage is
    reserved per stream, and examples are many)."""
    layout = Layout(subjects=Subjects(f"fuzz{uuid.uuid4().hex[:8]}"))
    nc = await connect(Settings(nats_url=url), "fuzz")
    js = nc.jetstream()
    await ensure(js, layout)
    try:
        yield nc, layout
    finally:
        for name in [s.name for s in layout.streams] + [b.stream_name for b in layout.buckets]:
            await js.delete_stream(name)
        await nc.close()


async def _in_space(
    url: str, scenario: Callable[[Client, Layout, Any], Awaitable[None]], garbage: Any
) -> None:
    async with _fuzz_space(url) as (nc, layout):
        await scenario(nc, layout, garbage)


async def _dead_lettered(nc: Client, layout: Layout) -> int:
    return (await nc.jetstream().stream_info(layout.deadletter_stream.name)).state.messages


async def _ranktable_scenario(nc: Client, layout: Layout, garbage: list[tuple[str, bytes]]) -> None:
    js, subjects = nc.jetstream(), layout.subjects
    nodes = await js.key_value(layout.nodes_bucket.bucket)
    specs = await js.key_value(layout.runners_bucket.bucket)
    for n, (where, payload) in enumerate(garbage):  # one subject each: some replay the last
        if where == "spec":  # an operator's own object: answered in its status instead
            await specs.put(f"bad-{n}", payload)
        elif where == "node":
            await nodes.put(f"garbage-{n}", payload)
        elif where == "status":
            await js.publish(subjects.runner("node-a", f"x{n}", 0, "status"), payload)
        elif where == "placement":
            await js.publish(subjects.placement(f"x{n}"), payload)
        else:
            await js.publish(subjects.ranktable(f"x{n}"), payload)
    for info in (node_info("node-a", 24), node_info("node-b", 8)):
        await nodes.put(info.nodeId, encode(info))
    await specs.put("llm", encode(runner()))
    bad_specs = {f"bad-{n}" for n, (where, _) in enumerate(garbage) if where == "spec"}
    statuses = await js.key_value(layout.runner_status_bucket.bucket)
    service = RankTableService(js=js, layout=layout, hub=TableHub(), port_base=52000)
    stop = asyncio.Event()
    running = asyncio.create_task(service.run(stop))
    answered: dict[str, RunnerSpecStatus] = {}
    for _ in range(300):
        for key in bad_specs - set(answered):
            with contextlib.suppress(KeyNotFoundError):
                answered[key] = decode((await statuses.get(key)).value or b"", RunnerSpecStatus)
        if "llm-0" in service.placements and set(answered) == bad_specs:
            break
        await asyncio.sleep(0.05)
    placed = service.placements
    stop.set()
    await running
    await service.dead_letters.settled()
    assert {a.nodeId for a in placed["llm-0"].assignments} == {"node-a", "node-b"}
    assert all(s.reason and not s.instances for s in answered.values())
    assert set(answered) == bad_specs
    assert service.dead_letters.total == len(garbage) - len(bad_specs)
    assert await _dead_lettered(nc, layout) == len(garbage) - len(bad_specs)


@_FUZZED
@given(garbage=_garbage(["spec", "node", "status", "placement", "ranktable"], 10))
def test_garbage_the_rank_table_service_reads_loses_no_valid_node_or_spec(
    server: EmbeddedNats, garbage: list[tuple[str, bytes]]
) -> None:
    asyncio.run(_in_space(server.url, _ranktable_scenario, garbage))


async def _agent_scenario(nc: Client, layout: Layout, garbage: list[bytes]) -> None:
    js, subjects = nc.jetstream(), layout.subjects
    describe = functools.partial(node_info, "node-0", 24)
    agent = Agent(nc=nc, js=js, layout=layout, node=describe, publisher=TelemetryPublisher(nc=nc))
    follower = await follow(js, subjects.placement_all(), agent.on_placement)
    await follower.caught_up.wait()
    await agent.catch_up()
    local = msgspec.structs.replace(placed(), modelPath="/nonexistent/model")
    for payload in garbage:
        await js.publish(subjects.placement("i"), payload)
    await js.publish(subjects.placement("i"), encode(local))  # valid, after the garbage
    for payload in garbage:
        await js.publish(subjects.tasks("i"), payload)
    await follower.caught_up.wait()
    for _ in range(300):
        if agent.dead_letters.total == 2 * len(garbage):
            break
        await asyncio.sleep(0.05)
    applied = set(agent.supervisors)
    await agent.shutdown()
    await follower.stop()
    await agent.dead_letters.settled()
    assert applied == {"i-r0"}  # the valid placement started node-0's rank
    assert agent.dead_letters.counts == {
        "placement_undecodable": len(garbage),
        "task_undecodable": len(garbage),
    }
    assert await _dead_lettered(nc, layout) == 2 * len(garbage)


@settings(_FUZZED, max_examples=3)
@given(garbage=st.lists(bad_payloads, min_size=5, max_size=10))
def test_garbage_an_agent_reads_loses_no_valid_placement(
    server: EmbeddedNats, garbage: list[bytes]
) -> None:
    asyncio.run(_in_space(server.url, _agent_scenario, garbage))
