"""The canary check on a real server paused (SIGSTOP): a late answer is asked again before
it counts, a server silent past both tries is an outage with its reason, and the end of
one is seen by the first check the server answers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psutil
import pytest
from nats.aio.client import Client

from rankscope.shared.connection import connect
from rankscope.shared.jetstream import Layout
from rankscope.shared.nats_server import EmbeddedNats
from rankscope.shared.provision import ensure
from rankscope.shared.settings import Settings
from rankscope.shared.storage import Storage

TIMEOUT = 1.0


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    """A server of this test's own, to pause."""
    with EmbeddedNats(store_dir=tmp_path / "nats") as started:
        yield started


@pytest.fixture
async def storage(server: EmbeddedNats) -> AsyncIterator[Storage]:
    client: Client = await connect(Settings(nats_url=server.url), "test")
    layout, js = Layout(), client.jetstream()
    await ensure(js, layout)
    yield Storage(js, layout.subjects.canary("test"), timeout=TIMEOUT, streams=layout.stream_names)
    with contextlib.suppress(Exception):
        await client.close()


def _pause(server: EmbeddedNats) -> None:
    """Stop the server now, and see it stopped."""
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)
    process = psutil.Process(server.pid)
    for _ in range(100):
        if process.status() == psutil.STATUS_STOPPED:
            return
        time.sleep(0.01)
    raise AssertionError(f"nats-server {server.pid} is {process.status()} after SIGSTOP")


def _resume(server: EmbeddedNats) -> None:
    """Let a stopped server go on."""
    assert server.pid is not None
    os.kill(server.pid, signal.SIGCONT)


async def _answered(storage: Storage) -> bool:
    """Whether a running server answers a check within ten: a loaded machine can keep a
    healthy one's answers late twice in a row."""
    for _ in range(10):
        if await storage.check():
            return True
    return False


def _pause_for(server: EmbeddedNats, seconds: float) -> None:
    """Stop the server now, and let it go on after `seconds`."""
    _pause(server)
    asyncio.get_running_loop().call_later(seconds, _resume, server)


async def test_a_server_late_once_is_asked_again_and_still_storing(
    server: EmbeddedNats, storage: Storage
) -> None:
    assert await _answered(storage), storage.reason
    _pause_for(server, TIMEOUT * 1.2)  # the first try times out, the second is answered
    assert await storage.check(), storage.reason
    assert storage.storing
    assert storage.why() == ""


async def test_a_server_silent_past_both_tries_is_an_outage_until_it_answers(
    server: EmbeddedNats, storage: Storage
) -> None:
    assert await _answered(storage), storage.reason
    _pause(server)  # until both tries are over, however long a loaded machine takes
    try:
        assert not await storage.check()
    finally:
        _resume(server)
    assert not storage.storing
    assert f"did not answer within {TIMEOUT:g}s" in storage.reason
    assert storage.why().startswith("JetStream not storing since ")
    assert await _answered(storage), storage.reason  # as soon as it answers
    assert storage.storing
    assert storage.why() == ""
