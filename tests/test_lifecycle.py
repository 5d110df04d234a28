"""A service told to stop exits even when NATS went away first, or never answered."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import nats
import pytest
import uvloop

from rankscope.services.gateway.deps import NOT_YET
from rankscope.services.lifecycle import quiet_closed_writes
from rankscope.shared.jetstream import Layout
from rankscope.shared.nats_server import EmbeddedNats
from rankscope.shared.provision import ensure
from tests.stack_up import free_port

pytestmark = pytest.mark.nats

REPO = Path(__file__).parent.parent


@pytest.mark.parametrize("service", [["aggregator"], ["ranktable", "--serve"], ["agent"]])
def test_sigterm_after_nats_is_gone_ends_the_process_cleanly_at_once(
    tmp_path: Path, service: list[str]
) -> None:
    server = EmbeddedNats(store_dir=tmp_path / "nats").start()
    asyncio.run(_made(server.url))  # an agent waits for the streams the others make
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rankscope.services.cli",
            *service,
            "--grpc-port",
            "0",
            "--data-dir",
            str(tmp_path / "data"),
        ],
        cwd=REPO,
        env={**os.environ, "RANKSCOPE_NATS_URL": server.url},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None
    try:
        for line in process.stderr:  # wait until it is up and talking to NATS
            if "caught up" in line or "service up" in line or "agent up" in line:
                break
        server.stop()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0  # asked to stop: no failure to restart
        left = process.stderr.read()
        assert "Traceback" not in left, left
        assert "drain incomplete: timed out" not in left, left
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stderr.close()
        server.stop()


async def _made(url: str) -> None:
    nc = await nats.connect(url)
    try:
        await ensure(nc.jetstream(), Layout())
    finally:
        await nc.close()


def test_a_gateway_that_cannot_reach_nats_serves_not_ready_and_stops_when_asked(
    tmp_path: Path,
) -> None:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "rankscope.services.cli", "gateway", "--gateway-port", str(port)],
        cwd=REPO,
        env={**os.environ, "RANKSCOPE_NATS_URL": f"nats://127.0.0.1:{free_port()}"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):  # it serves while it keeps trying NATS
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{base}/healthz").status_code == 200:
                    break
            time.sleep(0.1)
        ready = httpx.get(f"{base}/readyz")
        assert (ready.status_code, ready.json()["reason"]) == (503, NOT_YET)
        placement = httpx.get(f"{base}/v1/placement/runners")
        assert (placement.status_code, placement.json()["detail"]) == (503, NOT_YET)
        process.send_signal(signal.SIGTERM)
        # uvicorn shuts down, then ends by the signal it caught, as a supervisor expects
        assert process.wait(timeout=10) == -signal.SIGTERM
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


async def _write_after_close() -> RuntimeError:
    """What uvloop raises for a write to a connection it closed (asyncio's loop would let
    it pass)."""
    server = await asyncio.start_server(lambda _, writer: writer.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.transport.close()
    await asyncio.sleep(0.05)
    try:
        writer.transport.writelines([b"PUB late 0\r\n\r\n"])
    except RuntimeError as late:
        return late
    finally:
        server.close()
    raise AssertionError("the write after close passed")


def test_a_write_after_the_connection_closed_is_no_traceback_other_errors_are(
    caplog: pytest.LogCaptureFixture,
) -> None:
    late = uvloop.run(_write_after_close())
    loop = uvloop.new_event_loop()
    with caplog.at_level(logging.DEBUG):
        reset = ConnectionResetError("Connection lost")  # its flush met a dropped connection
        for error in (late, reset, RuntimeError("something else")):
            quiet_closed_writes(
                loop, {"message": "Task exception was never retrieved", "exception": error}
            )
    loop.close()
    assert [(r.name, r.levelno, r.exc_info is not None) for r in caplog.records] == [
        ("rankscope", logging.DEBUG, False),
        ("rankscope", logging.DEBUG, False),
        ("asyncio", logging.ERROR, True),
    ]
