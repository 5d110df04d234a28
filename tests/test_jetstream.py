"""`ensure` creates every stream and bucket, is idempotent, and updates changed limits."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import StreamInfo
from nats.js.errors import APIError, NotFoundError

from rankscope.shared.connection import close, connect
from rankscope.shared.jetstream import DEAD_LETTERS_KEPT, DUPLICATE_WINDOW_S, Layout
from rankscope.shared.provision import LayoutError, _refused, ensure
from rankscope.shared.settings import Settings
from rankscope.shared.subjects import Subjects

pytestmark = pytest.mark.nats


async def test_creates_every_stream_and_bucket(nc: Client, layout: Layout) -> None:
    js = nc.jetstream()
    await ensure(js, layout)
    for stream in layout.streams:
        info = await js.stream_info(stream.name)
        assert info.config.subjects == list(stream.subjects)
        assert info.config.duplicate_window == DUPLICATE_WINDOW_S
    nodes = await js.stream_info(layout.nodes_bucket.stream_name)
    assert nodes.config.max_age == layout.node_ttl_s
    kv = await js.key_value(layout.runners_bucket.bucket)
    assert (await kv.status()).history == 8


def test_names_follow_the_prefix() -> None:
    layout = Layout(subjects=Subjects("acme.prod"))
    assert layout.runner_stream.name == "ACME_PROD_RUNNER"
    assert layout.runner_stream.subjects == ("acme.prod.runner.>",)
    assert layout.nodes_bucket.bucket == "acme_prod_nodes"
    assert Layout().runners_bucket.bucket == "rankscope_runners"


async def test_is_idempotent_and_safe_to_run_concurrently(
    nc: Client, layout: Layout, settings: Settings
) -> None:
    js = nc.jetstream()
    # every service runs it at start, each on its own connection, at the same moment
    services = [await connect(settings, f"service-{n}") for n in range(6)]
    await asyncio.gather(*(ensure(s.jetstream(), layout) for s in services))
    for service in services:
        await close(service)
    before = {s.name: (await js.stream_info(s.name)).config for s in layout.streams}
    await ensure(js, layout)
    after = {s.name: (await js.stream_info(s.name)).config for s in layout.streams}
    assert before == after


class _LookedTooEarly:
    """A service's JetStream context that found no bucket just before another service
    made them all (and refused rollups on them)."""

    def __init__(self, js: JetStreamContext) -> None:
        self._js = js
        self._missed: set[str] = set()

    async def stream_info(self, name: str) -> StreamInfo:
        if name.startswith("KV_") and name not in self._missed:
            self._missed.add(name)
            raise NotFoundError
        return await self._js.stream_info(name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._js, name)


async def test_a_bucket_made_meanwhile_by_another_service_is_fine(
    nc: Client, layout: Layout
) -> None:
    js = nc.jetstream()
    await ensure(js, layout)
    await ensure(_LookedTooEarly(js), layout)  # type: ignore[arg-type]
    for bucket in layout.buckets:
        assert not (await js.stream_info(bucket.stream_name)).config.allow_rollup_hdrs


async def test_changed_limits_are_applied_without_losing_data(nc: Client, layout: Layout) -> None:
    js = nc.jetstream()
    await ensure(js, layout)
    await js.publish(layout.subjects.placement("i-1"), b"{}")
    changed = replace(layout, telemetry_max_age_s=3600.0, node_ttl_s=4.0)
    await ensure(js, changed)
    runner = await js.stream_info(changed.runner_stream.name)
    assert runner.config.max_age == 3600.0
    nodes = await js.stream_info(changed.nodes_bucket.stream_name)
    assert nodes.config.max_age == 4.0
    assert nodes.config.duplicate_window == 4.0
    placement = await js.stream_info(changed.placement_stream.name)
    assert placement.state.messages == 1


async def test_duplicate_message_ids_are_dropped(nc: Client, layout: Layout) -> None:
    js = nc.jetstream()
    await ensure(js, layout)
    subject = layout.subjects.runner("node-a", "i-1", 0, "phase")
    first = await js.publish(subject, b"{}", headers={"Nats-Msg-Id": "r-0:0-31"})
    again = await js.publish(subject, b"{}", headers={"Nats-Msg-Id": "r-0:0-31"})
    assert again.duplicate
    assert again.seq == first.seq


async def test_latest_rank_table_per_job_stays_readable(nc: Client, layout: Layout) -> None:
    js = nc.jetstream()
    await ensure(js, layout)
    for version in range(3):
        await js.publish(layout.subjects.ranktable("job-1"), str(version).encode())
    await js.publish(layout.subjects.ranktable("job-2"), b"other")
    last = await js.get_last_msg(layout.ranktable_stream.name, layout.subjects.ranktable("job-1"))
    assert last.data == b"2"


async def test_copies_a_lone_server_cannot_keep_are_refused_naming_the_setting(
    nc: Client, layout: Layout
) -> None:
    with pytest.raises(LayoutError, match=r"cannot keep 3 copies .* set RANKSCOPE_REPLICAS=1"):
        await ensure(nc.jetstream(), replace(layout, replicas=3), patience=1)


def test_a_store_too_small_for_a_fixed_reserve_says_what_rankscope_reserves() -> None:
    layout = Layout()
    full = APIError(code=500, err_code=10047, description="insufficient storage resources")
    said = str(_refused(layout, layout.deadletter_stream, full))
    whole = sum(s.max_bytes for s in layout.streams if s.max_bytes > 0)
    assert said == (
        f"JetStream refused stream RANKSCOPE_DEADLETTER (reserving {64 << 20:,} bytes): "
        "insufficient storage resources; free space in the server's store, or lower "
        f"--telemetry-max-bytes: rankscope's streams reserve {whole:,} bytes in all, "
        f"{1 << 30:,} of them telemetry"
    )


async def test_a_writer_flooding_dead_letters_evicts_only_its_own(
    nc: Client, layout: Layout
) -> None:
    await ensure(nc.jetstream(), layout)
    js = nc.jetstream()
    await js.publish(layout.subjects.deadletter("aggregator"), b"kept")
    flood = layout.subjects.deadletter("agent-node-a")
    await asyncio.gather(*(js.publish(flood, b"x") for _ in range(DEAD_LETTERS_KEPT + 100)))
    info = await js.stream_info(layout.deadletter_stream.name, subjects_filter=">")
    assert info.state.subjects == {
        layout.subjects.deadletter("aggregator"): 1,
        flood: DEAD_LETTERS_KEPT,
    }


async def test_a_role_that_makes_no_stream_waits_for_them_and_says_which_is_missing(
    nc: Client, layout: Layout
) -> None:
    with pytest.raises(LayoutError, match=r"^after 1s: stream \S+_RUNNER is not there yet"):
        await ensure(nc.jetstream(), layout, owner=False, patience=1)
    waiting = asyncio.create_task(ensure(nc.jetstream(), layout, owner=False, patience=10))
    await ensure(nc.jetstream(), layout)
    await waiting


async def test_a_first_start_says_in_one_line_what_it_made_and_a_second_says_nothing(
    nc: Client, layout: Layout, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="rankscope.shared.provision")

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "rankscope.shared.provision"]

    await ensure(nc.jetstream(), layout)
    everything = len(layout.streams) + len(layout.buckets)
    assert [s.split(":")[0] for s in said()] == [f"made {everything} streams and buckets"]
    caplog.clear()
    await ensure(nc.jetstream(), layout)
    assert said() == []
