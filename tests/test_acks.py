"""A publish awaits JetStream's ack on the shared inbox; whatever answers instead, or
nothing, ends that publish with a clear error and leaves nothing behind."""

from __future__ import annotations

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import APIError, NoStreamResponseError

from rankscope.shared.acks import AckInbox
from rankscope.shared.jetstream import Layout
from rankscope.shared.provision import ensure

pytestmark = pytest.mark.nats


async def test_an_ack_ends_the_publish_and_a_retry_is_deduplicated(
    nc: Client, layout: Layout
) -> None:
    await ensure(nc.jetstream(), layout)
    acks, subject = AckInbox(nc, patience=5), layout.subjects.placement("i")
    for _ in range(2):
        await acks.publish(subject, b"{}", {"Nats-Msg-Id": "one"})
    info = await nc.jetstream().stream_info(layout.placement_stream.name)
    assert info.state.messages == 1
    assert acks.waiting == 0


async def test_a_refusal_names_jetstreams_reason(nc: Client, layout: Layout) -> None:
    await ensure(nc.jetstream(), layout)
    acks = AckInbox(nc, patience=5)
    with pytest.raises(APIError) as refused:
        await acks.publish(
            layout.subjects.placement("i"),
            b"{}",
            {"Nats-Expected-Stream": "not-this-one"},
        )
    assert "stream" in (refused.value.description or "")
    assert acks.waiting == 0


async def test_no_stream_no_answer_and_a_stranger_answer_each_fail_clearly(
    nc: Client, layout: Layout
) -> None:
    acks, prefix = AckInbox(nc, patience=5), layout.subjects.prefix
    with pytest.raises(NoStreamResponseError):  # no stream holds the subject
        await acks.publish(f"{prefix}.nowhere", b"", {})

    async def mute(msg: Msg) -> None:
        del msg

    async def stranger(msg: Msg) -> None:
        await msg.respond(b"\xff not json")

    await nc.subscribe(f"{prefix}.mute", cb=mute)
    await nc.subscribe(f"{prefix}.stranger", cb=stranger)
    with pytest.raises(TimeoutError):
        await AckInbox(nc, patience=0.3).publish(f"{prefix}.mute", b"", {})
    with pytest.raises(APIError, match="not a JetStream ack"):
        await acks.publish(f"{prefix}.stranger", b"", {})
    assert acks.waiting == 0
