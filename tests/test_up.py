"""`rankscope up` brings up NATS with every stream, and SIGTERM leaves nothing behind."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import nats
import pytest

from rankscope.services.ranktable.grpcapi import config_pb2, config_pb2_grpc
from rankscope.shared.connection import close, connect
from rankscope.shared.jetstream import Layout
from rankscope.shared.processes import PORTABLE_ENV
from rankscope.shared.settings import Settings
from tests.stack_up import running_up

pytestmark = pytest.mark.nats

REPO = Path(__file__).parent.parent


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _children_running(command: str, pid: int) -> list[int]:
    def cmdline(child: int) -> str:
        return Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()

    return [child for child in _children(pid) if command in cmdline(child)]


def _ended(pidfds: list[int], seconds: float) -> set[int]:
    """The process fds among `pidfds` whose process ended within `seconds`."""
    ended: set[int] = set()
    deadline = time.monotonic() + seconds
    while len(ended) < len(pidfds) and (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd for fd in pidfds if fd not in ended], [], [], left)
        ended.update(ready)
    return ended


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], dict[str, str]]]:
    with running_up(tmp_path / "data") as started:
        yield started


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
    assert await _aggregator_ready(Settings(nats_url=shown["NATS"].split()[0]))
    command = shown["try"].split()[0]  # runs as printed, on the PATH or not
    assert shutil.which(command) is not None, command


async def _aggregator_ready(settings: Settings) -> bool:
    nc = await connect(settings, "test")
    health: dict[str, object] = {}
    for _ in range(300):  # it may still be starting: up to 30 s
        with contextlib.suppress(nats.errors.Error):
            reply = await nc.request("rankscope.query.health", b"", timeout=1)
            health = json.loads(reply.data)
            if health["ready"]:
                break
        await asyncio.sleep(0.1)
    await close(nc)
    return health.get("ready") is True


def _get(url: str) -> str:
    """The body of `url`, retried while the gateway is still starting (up to 30 s)."""
    for _ in range(300):
        try:
            with urllib.request.urlopen(url, timeout=10) as answer:
                return str(answer.read().decode())
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"{url} did not answer")


async def test_with_nats_auth_every_service_works_and_no_secret_shows(tmp_path: Path) -> None:
    token = "api-token-that-must-not-show"
    with running_up(tmp_path / "data", "--nats-auth", "--api-token", token) as (process, shown):
        assert "one user per role" in shown["NATS"]
        config = (tmp_path / "data" / "nats" / "nats.conf").read_text()
        passwords = re.findall(r'password: "([^"]+)"', config)
        assert len(passwords) == 4, "aggregator, rank-table service, gateway, operator"
        secret = tmp_path / "data" / "operator.password"
        assert secret.read_text().strip() == passwords[3]
        assert secret.stat().st_mode & 0o777 == 0o600
        assert f'--user operator --password "$(cat {secret})"' in shown["watch"]
        url = shown["NATS"].split()[0]
        gateway = Settings(nats_url=url, nats_user="gateway", nats_password=passwords[2])
        assert await _aggregator_ready(gateway)
        web = shown["web"].split()[0].rstrip("/")
        assert "timeline" in await asyncio.to_thread(_get, f"{web}/v1/cluster/timeline")
        metrics = await asyncio.to_thread(_get, f"{web}/metrics")
        process.send_signal(signal.SIGTERM)
        _, logs = process.communicate(timeout=20)
    server_log = (tmp_path / "data" / "nats" / "nats-server.log").read_text()
    assert "Violation" not in server_log, server_log
    for secret in (token, *passwords):
        assert secret not in logs
        assert secret not in metrics
        assert secret not in server_log


async def test_a_crashed_service_is_restarted_and_reported(
    stack: tuple[subprocess.Popen[str], dict[str, str]],
) -> None:
    process, shown = stack
    target = shown["ranktable"].split()[-1]
    assert await _register(target) == 0
    (first,) = _children_running("rankscope ranktable", process.pid)
    os.kill(first, signal.SIGKILL)
    assert process.stderr is not None
    for line in process.stderr:
        if "ranktable stopped (SIGKILL); restart 1" in line:
            break
    assert await _register(target) == 0
    (second,) = _children_running("rankscope ranktable", process.pid)
    assert second != first


async def test_a_killed_nats_server_is_started_again_and_the_stack_recovers(
    stack: tuple[subprocess.Popen[str], dict[str, str]],
) -> None:
    process, shown = stack
    web = shown["web"].split()[0].rstrip("/")
    assert "timeline" in await asyncio.to_thread(_get, f"{web}/v1/cluster/timeline")
    (first,) = _children_running("nats-server", process.pid)
    os.kill(first, signal.SIGKILL)
    assert process.stderr is not None
    for line in process.stderr:
        if "nats-server running again on" in line:
            break
    (second,) = _children_running("nats-server", process.pid)
    assert second != first
    assert not await asyncio.to_thread(Path(f"/proc/{first}").exists), "not reaped"
    assert await _aggregator_ready(Settings(nats_url=shown["NATS"].split()[0]))
    assert "ready" in await asyncio.to_thread(_get, f"{web}/readyz")  # reconnected


@contextlib.contextmanager
def _small_disk(where: Path, size: str) -> Iterator[Path]:
    """A filesystem of its own at `where` (tmpfs), to be filled: skipped, saying why, where
    none can be mounted."""
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"no disk of its own to fill here (mount: {mounted.stderr.strip()})")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


async def test_a_store_broken_on_a_full_disk_is_restarted_once_there_is_room(
    tmp_path: Path,
) -> None:
    with _small_disk(tmp_path / "disk", "1300m") as disk:
        small = {"RANKSCOPE_TELEMETRY_MAX_BYTES": "64Mi"}  # the streams' reservations fit
        with running_up(disk / "data", env=small) as (process, shown):
            nc = await connect(Settings(nats_url=shown["NATS"].split()[0]), "test")
            js = nc.jetstream(timeout=2)
            filler = disk / "filler"
            with filler.open("wb") as out:  # the disk full but for 2 MiB
                out.truncate(0)
                out.write(b"\0" * (shutil.disk_usage(disk).free - (2 << 20)))
            layout = Layout()
            for job in range(200):
                try:
                    await js.publish(layout.subjects.ranktable(f"job-{job}"), b"x" * (64 << 10))
                except (nats.errors.Error, TimeoutError):
                    break
            assert process.stderr is not None
            for line in process.stderr:
                if "JetStream cannot store" in line:
                    break
            filler.unlink()
            for line in process.stderr:
                if "nats-server running again on" in line:
                    break
            for _ in range(100):  # the services reconnect to it
                with contextlib.suppress(nats.errors.Error, TimeoutError):
                    await js.publish(layout.subjects.ranktable("after"), b"stored again")
                    break
                await asyncio.sleep(0.2)
            else:
                raise AssertionError("JetStream never stored again")
            await close(nc)


def test_sigterm_stops_everything(stack: tuple[subprocess.Popen[str], dict[str, str]]) -> None:
    process, _ = stack
    children = _children(process.pid)
    assert len(children) == 4, "nats-server, the aggregator, rank-table service and gateway"
    watches = [os.pidfd_open(pid) for pid in children]
    try:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
        assert len(_ended(watches, 10)) == len(watches), "a child outlived `rankscope up`"
    finally:
        for fd in watches:
            os.close(fd)


def test_each_service_is_named_in_ps(stack: tuple[subprocess.Popen[str], dict[str, str]]) -> None:
    process, _ = stack
    assert Path(f"/proc/{process.pid}/cmdline").read_bytes().startswith(b"rankscope up")
    names = ("aggregator", "ranktable", "gateway")
    deadline = time.monotonic() + 20  # each names itself once it has started Python
    while time.monotonic() < deadline:
        named = [n for n in names if _children_running(f"rankscope {n}", process.pid)]
        if len(named) == len(names):
            break
        time.sleep(0.1)
    assert named == list(names)


def test_up_killed_takes_its_services_along_on_the_portable_path(tmp_path: Path) -> None:
    with running_up(tmp_path / "data", env={PORTABLE_ENV: "1"}) as (
        process,
        _,
    ):  # as on macOS: no kernel tie
        services = [
            c for c in _children(process.pid) if c not in _children_running("nats", process.pid)
        ]
        server = _children_running("nats-server", process.pid)
        watches = [os.pidfd_open(pid) for pid in services]
        try:
            process.kill()
            assert len(_ended(watches, 15)) == len(watches) == 3, "a service outlived `up`"
        finally:
            for fd in watches:
                os.close(fd)
            for pid in server:  # a binary of its own: no lifeline without the kernel's tie
                os.kill(pid, signal.SIGKILL)


def test_requests_leave_no_access_log_lines(
    stack: tuple[subprocess.Popen[str], dict[str, str]],
) -> None:
    process, shown = stack
    web = shown["web"].split()[0].rstrip("/")
    answered = []
    for _ in range(120):
        with contextlib.suppress(OSError), urllib.request.urlopen(web + "/healthz") as reply:
            answered.append(reply.status)
            break
        time.sleep(0.25)
    assert answered == [200]
    with contextlib.suppress(OSError):  # a 404
        urllib.request.urlopen(web + "/v1/nope", timeout=10).close()
    time.sleep(0.5)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=10) == 0
    assert process.stderr is not None
    logged = process.stderr.read()
    assert "/healthz" not in logged, logged
    assert "/v1/nope" not in logged, logged


@pytest.mark.parametrize("flag", ["--nats-port", "--gateway-port", "--grpc-port"])
def test_a_taken_port_stops_up_at_once_with_one_line(tmp_path: Path, flag: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = {"--nats-port": "0", "--gateway-port": "0", "--grpc-port": "0", flag: str(port)}
        done = subprocess.run(
            [sys.executable, "-m", "rankscope.services.cli", "up", "--data-dir", str(tmp_path),
             *(word for pair in ports.items() for word in pair)],
            capture_output=True, text=True, cwd=REPO, timeout=60,
        )  # fmt: skip
    assert done.returncode == 1
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"rankscope up: port {port} for ")
    assert line.endswith(f"set {flag} / RANKSCOPE_{flag[2:].replace('-', '_').upper()}")
