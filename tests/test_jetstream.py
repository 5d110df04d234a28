"""`ensure` creates every stream and bucket, is idempotent, and updates changed limits."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from nats.aio.client import Client

from shared.jetstream import DUPLICATE_WINDOW_S, Layout, ensure
from shared.subjects import Subjects

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


async def test_is_idempotent_and_safe_to_run_concurrently(nc: Client, layout: Layout) -> None:
    js = nc.jetstream()
    await asyncio.gather(ensure(js, layout), ensure(js, layout), ensure(js, layout))
    before = {s.name: (await js.stream_info(s.name)).config for s in layout.streams}
    await ensure(js, layout)
    after = {s.name: (await js.stream_info(s.name)).config for s in layout.streams}
    assert before == after


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
