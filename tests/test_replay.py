"""Following streams and buckets: the backlog is handled before `caught_up`, in order, and
live changes keep coming after it; no backlog, lost consumer or NATS restart loses or
repeats a message."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import SlowConsumerError
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from rankscope.shared.buckets import follow_bucket
from rankscope.shared.connection import connect
from rankscope.shared.jetstream import Layout
from rankscope.shared.nats_server import EmbeddedNats
from rankscope.shared.provision import ensure
from rankscope.shared.replay import follow, stored_ns
from rankscope.shared.settings import Settings
from rankscope.shared.subjects import Subjects
from tests.stack_up import free_port

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


@pytest.mark.parametrize("plain", [True, False], ids=["plain handler", "async handler"])
async def test_a_handler_plain_or_async_that_fails_loses_only_its_message(
    nc: Client, layout: Layout, plain: bool, caplog: pytest.LogCaptureFixture
) -> None:
    js = nc.jetstream()
    await ensure(js, layout)
    subject = layout.subjects.tasks("i")
    await _publish(js, subject, 0, 300)
    seen: list[int] = []
    all_taken = asyncio.Event()

    def keep(msg: Msg) -> None:
        if int(msg.data) == 399:
            all_taken.set()
        if int(msg.data) % 7 == 3:
            raise RuntimeError(f"cannot take {msg.data!r}")
        seen.append(int(msg.data))

    async def keep_async(msg: Msg) -> None:
        await asyncio.sleep(0)
        keep(msg)

    follower = await follow(js, subject, keep if plain else keep_async, batch=64)
    await asyncio.wait_for(follower.caught_up.wait(), WAIT)
    await _publish(js, subject, 300, 100)  # and live ones after
    await asyncio.wait_for(all_taken.wait(), WAIT)
    assert seen == [n for n in range(400) if n % 7 != 3]
    assert (follower.handled, follower.restarts) == (400, 0)
    assert sum("failed; skipped" in r.getMessage() for r in caplog.records) == 57
    await follower.stop()


async def _publish(js: JetStreamContext, subject: str, first: int, count: int) -> None:
    for start in range(first, first + count, 1000):
        acks = [
            await js.publish_async(subject, str(n).encode())
            for n in range(start, min(start + 1000, first + count))
        ]
        await asyncio.gather(*acks)


class _Slow:
    """A handler that keeps what it sees and pauses now and then, as a busy view does."""

    def __init__(self, every: int = 500) -> None:
        self.seen: list[int] = []
        self.every = every
        self.arrived = asyncio.Condition()

    async def __call__(self, msg: Msg) -> None:
        self.seen.append(int(msg.data))
        if len(self.seen) % self.every == 0:
            await asyncio.sleep(0.01)
        async with self.arrived:
            self.arrived.notify_all()

    async def until(self, count: int) -> None:
        async with self.arrived:
            await asyncio.wait_for(self.arrived.wait_for(lambda: len(self.seen) >= count), WAIT)


async def test_a_backlog_far_bigger_than_the_client_buffer_is_handled_whole(
    settings: Settings, layout: Layout
) -> None:
    errors: list[Exception] = []

    async def keep_error(error: Exception) -> None:
        errors.append(error)

    nc = await connect(settings, "replay-test", error_cb=keep_error)
    js = nc.jetstream()
    await ensure(js, layout)
    subject = layout.subjects.tasks("i")
    await _publish(js, subject, 0, 20_000)
    slow = _Slow()
    follower = await follow(js, subject, slow, batch=64)
    await asyncio.wait_for(follower.caught_up.wait(), WAIT)
    assert slow.seen == list(range(20_000))  # caught up means every stored message handled
    await _publish(js, subject, 20_000, 20_000)  # and a live burst of the same size
    await slow.until(40_000)
    assert slow.seen == list(range(40_000))
    assert not [e for e in errors if isinstance(e, SlowConsumerError)]
    assert follower.restarts == 0
    await follower.stop()
    await nc.close()


async def test_what_handling_leaves_to_settle_is_done_before_any_other_task_runs(
    nc: Client, layout: Layout
) -> None:
    """A handler may leave work of many messages to `settle` (ingest moves a runner's
    synopsis once per run): no other task (a query, a snapshot, whoever `caught_up` wakes)
    ever finds it undone, through a backlog, a lost consumer and live messages."""
    js = nc.jetstream()
    await ensure(js, layout)
    subject = layout.subjects.tasks("i")
    await _publish(js, subject, 0, 5_000)
    held: list[int] = []
    settled: list[int] = []
    undone: list[int] = []  # what other tasks found held

    async def hold(msg: Msg) -> None:
        held.append(int(msg.data))

    all_settled = asyncio.Event()

    def settle() -> None:
        settled.extend(held)
        held.clear()
        if len(settled) == 6_000:
            all_settled.set()

    async def look() -> None:
        while True:
            undone.extend(held)
            await asyncio.sleep(0)

    looking = asyncio.create_task(look())
    follower = await follow(js, subject, hold, settle=settle, batch=50, heartbeat=0.2)
    await asyncio.wait_for(follower.caught_up.wait(), WAIT)
    assert settled == list(range(5_000))
    stream = layout.tasks_stream.name
    for consumer in await js.consumers_info(stream):
        await js.delete_consumer(stream, consumer.name)
    await _publish(js, subject, 5_000, 1_000)
    await asyncio.wait_for(all_settled.wait(), WAIT)
    looking.cancel()
    assert (settled, undone) == (list(range(6_000)), [])
    await follower.stop()


async def test_a_consumer_lost_mid_replay_resumes_after_the_last_handled_message(
    nc: Client, layout: Layout
) -> None:
    js = nc.jetstream()
    await ensure(js, layout)
    subject = layout.subjects.tasks("i")
    await _publish(js, subject, 0, 5_000)
    slow = _Slow(every=100)
    follower = await follow(js, subject, slow, batch=50, heartbeat=0.2)
    await slow.until(1_000)
    stream = layout.tasks_stream.name
    for consumer in await js.consumers_info(stream):
        await js.delete_consumer(stream, consumer.name)
    await asyncio.wait_for(follower.caught_up.wait(), WAIT)
    await _publish(js, subject, 5_000, 1_000)
    await slow.until(6_000)
    assert slow.seen == list(range(6_000))  # nothing lost, nothing twice
    assert follower.restarts >= 1
    await follower.stop()


async def test_a_nats_restart_mid_follow_loses_and_repeats_nothing(tmp_path: Path) -> None:
    server = EmbeddedNats(store_dir=tmp_path / "nats", port=free_port()).start()
    settings = Settings(nats_url=server.url, subject_prefix="restart", data_dir=tmp_path)
    layout = Layout(subjects=Subjects("restart"))
    reconnected = asyncio.Event()

    async def on_reconnect() -> None:
        reconnected.set()

    nc = await connect(settings, "replay-test", reconnected_cb=on_reconnect)
    js = nc.jetstream()
    await ensure(js, layout)
    subject = layout.subjects.tasks("i")
    await _publish(js, subject, 0, 2_000)
    slow = _Slow()
    follower = await follow(js, subject, slow, heartbeat=0.2)
    await asyncio.wait_for(follower.caught_up.wait(), WAIT)
    server.stop()
    server.start()
    await asyncio.wait_for(reconnected.wait(), WAIT)  # else publishes go to the old socket
    await _publish(js, subject, 2_000, 2_000)
    await slow.until(4_000)
    assert slow.seen == list(range(4_000))
    await follower.stop()
    await nc.close()
    server.stop()


@pytest.mark.parametrize(
    ("reply", "stored"),
    [
        ("$JS.ACK.S.C.1.20.7.1763900000123456789.0", 1763900000123456789),
        ("$JS.ACK.hub.ACCHASH.S.C.1.20.7.1763900000123456789.0.tok", 1763900000123456789),
        ("$JS.ACK.hub.ACCHASH.S.C.1.20.7.1763900000123456789.0", 1763900000123456789),
        ("$JS.ACK.S.C.1.20.7.soon.0", None),
        ("_INBOX.abc", None),
        (None, None),
    ],
)
def test_the_stored_time_is_read_off_the_ack_subject(reply: str | None, stored: int | None) -> None:
    assert stored_ns(reply) == stored


async def test_a_handler_reads_each_message_s_own_stored_time(nc: Client, layout: Layout) -> None:
    """The stored time a follower read as it took a delivery is the one its handler gets
    for that delivery, and a subject read before or elsewhere is parsed anew."""
    js = nc.jetstream()
    await ensure(js, layout)
    subject = layout.subjects.tasks("i")
    acks = [await js.publish(subject, str(n).encode()) for n in range(20)]
    stored: list[int | None] = []
    parsed: list[int | None] = []
    replies: list[str] = []

    def keep(msg: Msg) -> None:
        assert msg.reply is not None
        replies.append(msg.reply)
        stored.append(stored_ns(msg.reply))
        parsed.append(stored_ns("".join(msg.reply)))  # an equal subject, another object

    follower = await follow(js, subject, keep)
    await asyncio.wait_for(follower.caught_up.wait(), WAIT)
    await follower.stop()
    assert stored == parsed
    times = [at for at in stored if at is not None]
    assert len(times) == len(acks) == len(stored)
    assert times == sorted(times)
    assert len(set(times)) > 1
    assert [stored_ns(reply) for reply in replies] == stored  # each read anew, in any order


async def test_subjects_added_while_following_come_from_their_start_each_message_once(
    nc: Client, layout: Layout
) -> None:
    js = nc.jetstream()
    await ensure(js, layout)
    subjects = layout.subjects
    a, b, c = (subjects.runner_of_instance(i) for i in "abc")

    def sent(instance: str, n: int) -> str:
        return subjects.runner("n", instance, 0, "phase") + f"|{n}"

    async def publish(instance: str, n: int) -> None:
        await js.publish(subjects.runner("n", instance, 0, "phase"), str(n).encode())

    seen: list[str] = []
    changed = asyncio.Event()

    async def keep(msg: Msg) -> None:
        seen.append(f"{msg.subject}|{msg.data.decode()}")
        changed.set()

    async def until(count: int) -> None:
        while len(seen) < count:
            changed.clear()
            await asyncio.wait_for(changed.wait(), WAIT)

    for n in range(3):
        for instance in "abc":
            await publish(instance, n)
    follower = await follow(js, a, keep)
    await until(3)
    assert seen == [sent("a", n) for n in range(3)]

    def of(*tokens: str) -> Callable[[str], bool]:
        return lambda subject: subjects.instance_token(subject) in tokens

    await follower.widen([b], of("b"))  # b's messages went by before: gone over again
    await follower.widen([c], of("c"))  # and c's, while b's are gone over
    await publish("a", 3)
    await publish("b", 3)
    await until(11)
    expected = [sent(i, n) for i in "abc" for n in range(4) if (i, n) != ("c", 3)]
    assert sorted(seen) == sorted(expected)  # each once
    for instance in "abc":  # each subject's in order
        mine = [m for m in seen if m.startswith(sent(instance, 0)[:-1])]
        assert mine == sorted(mine)
    assert seen.index(sent("a", 3)) > max(seen.index(sent(i, 2)) for i in "bc")
    follower.narrow([b])
    await publish("b", 4)
    await publish("a", 4)
    await until(12)
    assert seen[-1] == sent("a", 4)  # b no longer followed
    assert sent("b", 4) not in seen
    assert follower.restarts == 0  # refilters are not restarts
    with pytest.raises(ValueError, match="subject left"):
        follower.narrow([a, c])  # it would then get everything
    await follower.stop()
