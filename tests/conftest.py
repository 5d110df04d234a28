"""Fixtures: a real nats-server per test (or a shared container / given server), with a
unique subject prefix per test so tests never see each other's streams."""

from __future__ import annotations

import contextlib
import gc
import os
import uuid
import warnings
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client

from rankscope.shared.connection import connect, slow_consumer_drops
from rankscope.shared.jetstream import Layout
from rankscope.shared.nats_server import EmbeddedNats
from rankscope.shared.settings import Settings
from rankscope.shared.subjects import Subjects

# A test process runs gRPC (the rank-table service) and starts nats-servers. grpcio's
# post-fork handler starts a poller in the child that dies on the descriptors Popen closes
# before exec (grpc/grpc#43055), and the child exits -6 instead of running nats-server.
# Read by gRPC when it starts, after this.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

FIXTURES = Path(__file__).parent / "fixtures"


def _docker_engine_answers() -> bool:
    if not os.environ.get("DOCKER_HOST") and not Path("/var/run/docker.sock").exists():
        return False
    import docker

    with warnings.catch_warnings():
        # docker-py leaves the socket of a refused connection (a stale docker.sock) to the
        # garbage collector: collect it here, not in whichever test runs next
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            client = docker.from_env(timeout=2)
            try:
                return bool(client.ping())
            finally:
                client.close()
        except Exception:
            return False
        finally:
            gc.collect()


@pytest.fixture(scope="session")
def shared_nats_url(request: pytest.FixtureRequest) -> Iterator[str | None]:
    """A server every test may share: `RANKSCOPE_TEST_NATS_URL`, else a NATS container
    when a Docker engine answers and can start one, else None (each test gets an embedded
    server; one line says why when the engine could not start the container)."""
    given = os.environ.get("RANKSCOPE_TEST_NATS_URL")
    if given:
        yield given
        return
    if not _docker_engine_answers():
        yield None
        return
    try:
        with warnings.catch_warnings():  # testcontainers' own deprecations
            warnings.simplefilter("ignore", DeprecationWarning)
            from testcontainers.community.nats import NatsContainer

            container = NatsContainer("nats:2.11", jetstream=True).start()
    except Exception as exc:  # an engine without the images or a registry to pull them
        why = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        capture = request.config.pluginmanager.get_plugin("capturemanager")
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if capture is not None and reporter is not None:
            with capture.global_and_fixture_disabled():
                reporter.write_line(f"NATS container not started ({why}): embedded servers")
        yield None
        return
    try:
        yield container.nats_uri()
    finally:
        container.stop()


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
