"""On a 3-server NATS cluster, every stream and bucket keeps `RANKSCOPE_REPLICAS` copies:
at creation, and after `ensure` on ones that exist with another count (up and down)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client

from shared.connection import close, connect
from shared.jetstream import Layout, ensure
from shared.nats_server import EmbeddedNats
from shared.settings import Settings, SettingsError, load
from tests.nats_cluster import nats_cluster, until_jetstream_answers


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EmbeddedNats]]:
    with nats_cluster(tmp_path_factory.mktemp("cluster")) as servers:
        yield servers


@pytest.fixture
async def nc(cluster: list[EmbeddedNats]) -> AsyncIterator[Client]:
    urls = [s.url for s in cluster]
    await until_jetstream_answers(urls)
    client = await connect(Settings(nats_url=",".join(urls)), "test-replicas")
    yield client
    await close(client)


async def _copies(nc: Client, layout: Layout) -> set[tuple[int, int]]:
    """(copies asked, copies the cluster holds) of every stream, buckets' included."""
    js, found = nc.jetstream(), set()
    for name in [s.name for s in layout.streams] + [b.stream_name for b in layout.buckets]:
        info = await js.stream_info(name)
        peers = info.cluster.replicas if info.cluster and info.cluster.replicas else []
        found.add((info.config.num_replicas or 1, 1 + len(peers)))
    return found


async def _until_held(nc: Client, layout: Layout, copies: int) -> None:
    """Wait until every stream is held `copies` times (the cluster moves them meanwhile)."""
    for _ in range(100):
        if await _copies(nc, layout) == {(copies, copies)}:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"not {copies} copies each: {await _copies(nc, layout)}")


async def test_every_stream_and_bucket_is_kept_three_times_and_can_scale(nc: Client) -> None:
    layout, js = Layout(replicas=3), nc.jetstream()
    await ensure(js, layout)
    await _until_held(nc, layout, 3)
    await js.publish(layout.subjects.placement("i"), b"{}", headers={"Nats-Msg-Id": "one"})
    await ensure(js, Layout(replicas=1))  # down
    await _until_held(nc, layout, 1)
    await ensure(js, layout)  # and up again
    await _until_held(nc, layout, 3)
    kept = await js.get_last_msg(layout.placement_stream.name, layout.subjects.placement("i"))
    assert kept.data == b"{}"  # what they held is kept through both


def test_the_setting_takes_what_jetstream_can_keep(tmp_path: Path) -> None:
    assert load(None, {"RANKSCOPE_REPLICAS": "3"}).replicas == 3
    with pytest.raises(SettingsError, match="at most 5 copies"):
        load(None, {"RANKSCOPE_REPLICAS": "7"})
    with pytest.raises(SettingsError, match="positive"):
        load(None, {"RANKSCOPE_REPLICAS": "0"})
