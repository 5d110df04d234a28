"""Generated garbage — random bytes, wrong types, huge strings, deep nesting, valid JSON of
the wrong shape — on every subject the aggregator consumes, mixed with valid events: no
crash, every valid event applied, every bad one counted and dead-lettered."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.aggregator.service import AggregatorService
from services.aggregator.store import EntryStore
from services.aggregator.views import ClusterState
from shared.connection import connect
from shared.jetstream import Layout, ensure
from shared.nats_server import EmbeddedNats
from shared.settings import Settings
from shared.subjects import Subjects
from shared.wire import Phase, encode
from tests.aggregator.builders import entries, placed, rank

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


async def _scenario(url: str, garbage: list[tuple[str, bytes]]) -> None:
    layout = Layout(subjects=Subjects(f"fuzz{uuid.uuid4().hex[:8]}"))
    nc = await connect(Settings(nats_url=url), "fuzz")
    js = nc.jetstream()
    await ensure(js, layout)
    subjects = {
        "runner": layout.subjects.runner("node-0", "i", 0, "phase"),
        "placement": layout.subjects.placement("i"),
        "tasks": layout.subjects.tasks("i"),
    }
    await js.publish(subjects["placement"], encode(placed()))
    for seq, (where, payload) in enumerate(garbage):
        await js.publish(subjects[where], payload)
        await js.publish(subjects["runner"], encode(entries(rank(0), (seq, seq, Phase.IDLE, None))))
    state = ClusterState(store=EntryStore())
    service = AggregatorService(nc=nc, js=js, layout=layout, state=state, node_id="fuzz")
    stop = asyncio.Event()
    running = asyncio.create_task(service.run(stop))
    await asyncio.wait_for(service.ready.wait(), 30)
    for _ in range(500):  # dead letters are published in the background
        if not service._background:
            break
        await asyncio.sleep(0.01)
    stop.set()
    await running
    dead = await js.stream_info(layout.deadletter_stream.name)
    await nc.close()
    assert state.store.size == len(garbage)  # every valid entry applied
    assert list(state.instances) == ["i"]  # the valid placement too
    assert sum(service.bad.values()) == len(garbage)
    assert dead.state.messages == len(garbage)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.data_too_large,
    ],
)
@given(
    garbage=st.lists(
        st.tuples(st.sampled_from(["runner", "placement", "tasks"]), bad_payloads),
        min_size=20,
        max_size=40,
    )
)
def test_garbage_on_every_subject_loses_no_valid_event(
    server: EmbeddedNats, garbage: list[tuple[str, bytes]]
) -> None:
    asyncio.run(_scenario(server.url, garbage))
