"""Fixtures: a real nats-server per test (or a shared container / given server), with a
unique subject prefix per test so tests never see each other's streams."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client

from shared.connection import connect, slow_consumer_drops
from shared.jetstream import Layout
from shared.nats_server import EmbeddedNats
from shared.settings import Settings
from shared.subjects import Subjects

FIXTURES = Path(__file__).parent / "fixtures"


def _docker_engine_answers() -> bool:
    if not os.environ.get("DOCKER_HOST") and not Path("/var/run/docker.sock").exists():
        return False
    import docker

    try:
        client = docker.from_env(timeout=2)
    except Exception:
        return False
    try:
        return bool(client.ping())
    except Exception:
        return False
    finally:
        client.close()


@pytest.fixture(scope="session")
def shared_nats_url() -> Iterator[str | None]:
    """A server every test may share: `RANKSCOPE_TEST_NATS_URL`, else a NATS container
    when a Docker engine answers, else None (each test gets an embedded server)."""
    given = os.environ.get("RANKSCOPE_TEST_NATS_URL")
    if given:
        yield given
    elif _docker_engine_answers():
        from testcontainers.community.nats import NatsContainer

        with NatsContainer("nats:2.11", jetstream=True) as container:
            yield container.nats_uri()
    else:
        yield None


@pytest.fixture
def nats_url(shared_nats_url: str | None, tmp_path: Path) -> Iterator[str]:
    """URL of a real nats-server with JetStream."""
    if shared_nats_url is not None:
        yield shared_nats_url
        return
    with EmbeddedNats(store_dir=tmp_path / "nats") as server:
        yield server.url


@pytest.fixture
def settings(nats_url: str, tmp_path: Path) -> Settings:
    """Settings pointing at the test server, under a prefix of this test's own."""
    return Settings(
        nats_url=nats_url,
        subject_prefix=f"t{uuid.uuid4().hex[:12]}",
        data_dir=tmp_path / "data",
    )


@pytest.fixture
def layout(settings: Settings) -> Layout:
    """This test's streams and buckets."""
    return Layout(subjects=Subjects(settings.subject_prefix), node_ttl_s=settings.heartbeat_ttl)


@pytest.fixture
async def nc(settings: Settings) -> AsyncIterator[Client]:
    """A connected NATS client."""
    client = await connect(settings, "rankscope-tests")
    yield client
    with contextlib.suppress(Exception):
        await client.close()


@pytest.fixture(autouse=True)
def _no_message_dropped() -> Iterator[None]:
    """A NATS client of this process dropping a message for a slow subscription is a bug in
    whatever test it happens: followers pull only what they can hold."""
    before = slow_consumer_drops()
    yield
    assert slow_consumer_drops() == before, "a NATS client dropped messages (slow consumer)"
