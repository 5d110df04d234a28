"""`rankscope up` brings up NATS with every stream, and SIGTERM leaves nothing behind."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import nats
import pytest

from services.ranktable.grpcapi import config_pb2, config_pb2_grpc
from shared.jetstream import Layout

pytestmark = pytest.mark.nats

REPO = Path(__file__).parent.parent


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _children_running(command: str, pid: int) -> list[int]:
    def cmdline(child: int) -> str:
        return Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()

    return [child for child in _children(pid) if command in cmdline(child)]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], dict[str, str]]]:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "up",
            "--nats-port",
            "0",
            "--gateway-port",
            str(_free_port()),
            "--grpc-port",
            str(_free_port()),
            "--data-dir",
            str(tmp_path / "data"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert process.stdout is not None
    shown: dict[str, str] = {}
    for line in process.stdout:
        if line.startswith("Ctrl-C"):
            break
        parts = re.split(r"\s{2,}", line.strip(), maxsplit=1)
        if len(parts) == 2:
            shown[parts[0]] = parts[1]
    yield process, shown
    if process.poll() is None:
        process.kill()
    process.wait()
    process.stdout.close()
    assert process.stderr is not None
    process.stderr.close()


async def test_streams_and_buckets_are_ready(
    stack: tuple[subprocess.Popen[str], dict[str, str]],
) -> None:
    _, shown = stack
    url = shown["NATS"].split()[0]
    nc = await nats.connect(url)
    js = nc.jetstream()
    names = [stream.name for stream in Layout().streams]
    infos = [await js.stream_info(name) for name in names]
    await nc.close()
    assert [info.config.name for info in infos] == names


async def _register(target: str) -> int:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = config_pb2_grpc.ConfigStub(channel)
        reply = await stub.Register(
            config_pb2.ClientInfo(jobId="job"), wait_for_ready=True, timeout=30
        )
        return int(reply.code)


async def test_rank_table_service_answers_grpc(
    stack: tuple[subprocess.Popen[str], dict[str, str]],
) -> None:
    _, shown = stack
    assert await _register(shown["ranktable"].split()[-1]) == 0


async def test_the_aggregator_answers_queries(
    stack: tuple[subprocess.Popen[str], dict[str, str]],
) -> None:
    _, shown = stack
    nc = await nats.connect(shown["NATS"].split()[0])
    health: dict[str, object] = {}
    for _ in range(300):  # it may still be starting: up to 30 s
        with contextlib.suppress(nats.errors.Error):
            reply = await nc.request("rankscope.query.health", b"", timeout=1)
            health = json.loads(reply.data)
            if health["ready"]:
                break
        await asyncio.sleep(0.1)
    await nc.close()
    assert health["ready"] is True


async def test_a_crashed_service_is_restarted_and_reported(
    stack: tuple[subprocess.Popen[str], dict[str, str]],
) -> None:
    process, shown = stack
    target = shown["ranktable"].split()[-1]
    assert await _register(target) == 0
    (first,) = _children_running("services.cli ranktable", process.pid)
    os.kill(first, signal.SIGKILL)
    assert process.stderr is not None
    for line in process.stderr:
        if "ranktable stopped (SIGKILL); restart 1" in line:
            break
    assert await _register(target) == 0
    (second,) = _children_running("services.cli ranktable", process.pid)
    assert second != first


def test_sigterm_stops_everything(stack: tuple[subprocess.Popen[str], dict[str, str]]) -> None:
    process, _ = stack
    children = _children(process.pid)
    assert len(children) == 4, "nats-server, the aggregator, rank-table service and gateway"
    watches = [os.pidfd_open(pid) for pid in children]
    try:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
        ready, _, _ = select.select(watches, [], [], 10)
        assert len(ready) == len(watches), "a child outlived `rankscope up`"
    finally:
        for fd in watches:
            os.close(fd)
