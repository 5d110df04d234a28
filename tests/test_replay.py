"""Following streams and buckets: the backlog is handled before `caught_up`, in order, and
live changes keep coming after it."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from shared.jetstream import Layout, ensure
from shared.replay import follow, follow_bucket

pytestmark = pytest.mark.nats

WAIT = 10.0


async def test_a_bucket_s_latest_entries_all_come_before_caught_up(
    nc: Client, layout: Layout
) -> None:
    js = nc.jetstream()
    await ensure(js, layout)
    bucket = layout.runners_bucket.bucket
    kv = await js.key_value(bucket)
    for key in ("a", "b", "c"):
        await kv.put(key, b"old")
    await kv.put("a", b"new")
    await kv.delete("b")
    for _ in range(50):  # a restart is a new follower over the same keys, every time
        seen: list[tuple[str, bytes | None, str | None]] = []

        async def keep(
            entry: KeyValue.Entry, seen: list[tuple[str, bytes | None, str | None]] = seen
        ) -> None:
            seen.append((entry.key, entry.value, entry.operation))

        follower = await follow_bucket(js, bucket, keep)
        await asyncio.wait_for(follower.caught_up.wait(), WAIT)
        assert sorted(seen) == [("a", b"new", None), ("b", b"", "DEL"), ("c", b"old", None)]
        await follower.stop()
    changes: asyncio.Queue[KeyValue.Entry] = asyncio.Queue()
    follower = await follow_bucket(js, bucket, changes.put)
    await asyncio.wait_for(follower.caught_up.wait(), WAIT)
    await kv.put("d", b"live")
    while (entry := await asyncio.wait_for(changes.get(), WAIT)).key != "d":
        pass
    assert (entry.value, entry.revision) == (b"live", 6)
    await follower.stop()


async def test_an_empty_bucket_is_caught_up_at_once(nc: Client, layout: Layout) -> None:
    js = nc.jetstream()
    await ensure(js, layout)

    async def never(entry: KeyValue.Entry) -> None:
        raise AssertionError(f"an empty bucket gave {entry}")

    follower = await follow_bucket(js, layout.nodes_bucket.bucket, never)
    await asyncio.wait_for(follower.caught_up.wait(), WAIT)
    await follower.stop()


async def test_several_subjects_interleave_in_stream_order(nc: Client, layout: Layout) -> None:
    js = nc.jetstream()
    await ensure(js, layout)
    subjects = layout.subjects
    published = [
        subjects.tasks("i"),
        subjects.task_status("i", "node-a"),
        subjects.tasks("other"),
        subjects.task_status("i", "node-b"),
        subjects.tasks("i"),
    ]
    for n, subject in enumerate(published):
        await js.publish(subject, str(n).encode())
    seen: list[bytes] = []

    async def keep(msg: Msg) -> None:
        seen.append(msg.data)

    follower = await follow(js, subjects.tasks("i"), keep, also=[subjects.task_statuses("i")])
    await asyncio.wait_for(follower.caught_up.wait(), WAIT)
    assert seen == [b"0", b"1", b"3", b"4"]  # not the other instance's task
    await follower.stop()
