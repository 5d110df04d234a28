"""A service whose NATS connection the server closes for good (here: its credentials
revoked by a config reload) exits non-zero, so that its supervisor starts it afresh,
instead of living on deaf to NATS."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from rankscope.shared.connection import close, connect
from rankscope.shared.jetstream import Layout
from rankscope.shared.nats_auth import OPERATOR, ROLES, agent_user, render
from rankscope.shared.nats_server import EmbeddedNats
from rankscope.shared.provision import ensure
from rankscope.shared.settings import Settings, to_environ
from tests.stack_up import free_port

pytestmark = [pytest.mark.nats, pytest.mark.timeout(120)]

LAYOUT = Layout()
NODES = ("node-a",)
PASSWORDS = {user: f"pw-{user}" for user in (*ROLES, OPERATOR, *(agent_user(n) for n in NODES))}
EXIT_WITHIN_S = 30.0


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    with EmbeddedNats(
        store_dir=tmp_path / "nats", monitor=True, config=render(LAYOUT, NODES, PASSWORDS)
    ) as server:
        yield server


def _connected(server: EmbeddedNats, name: str) -> bool:
    with urllib.request.urlopen(f"{server.monitor_url}/connz", timeout=2) as reply:
        return any(c.get("name") == name for c in json.load(reply)["connections"])


def _revoke(server: EmbeddedNats, user: str) -> None:
    """Change `user`'s password in the server's config and reload it."""
    config = server.store_dir / "nats.conf"
    config.write_text(render(LAYOUT, NODES, {**PASSWORDS, user: "rotated"}))
    assert server.pid is not None
    os.kill(server.pid, signal.SIGHUP)


@pytest.mark.parametrize(
    ("command", "user", "name"),
    [
        (["aggregator"], "aggregator", "rankscope-aggregator"),
        (["ranktable", "--serve"], "ranktable", "rankscope-ranktable"),
        (["gateway"], "gateway", "rankscope-gateway"),
        (["agent"], agent_user("node-a"), "rankscope-agent-node-a"),
    ],
)
async def test_a_service_whose_connection_is_closed_for_good_exits_non_zero(
    server: EmbeddedNats, tmp_path: Path, command: list[str], user: str, name: str
) -> None:
    owner = Settings(nats_url=server.url, nats_user="aggregator", nats_password="pw-aggregator")
    nc = await connect(owner, "test-owner")
    await ensure(nc.jetstream(), LAYOUT)
    await close(nc)
    settings = Settings(
        nats_url=server.url,
        nats_user=user,
        nats_password=PASSWORDS[user],
        node_id="node-a",
        data_dir=tmp_path / "data",
        gateway_port=free_port(),
        grpc_port=free_port(),
    )
    service = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "rankscope.services.cli",
        *command,
        env={**os.environ, **to_environ(settings)},
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + EXIT_WITHIN_S
        while not _connected(server, name):
            assert service.returncode is None, "the service exited before connecting"
            assert time.monotonic() < deadline, f"{name} did not connect"
            await asyncio.sleep(0.2)
        _revoke(server, user)
        code = await asyncio.wait_for(service.wait(), EXIT_WITHIN_S)
        assert service.stderr is not None
        errors = (await service.stderr.read()).decode()
        assert code == 1, errors
        assert "closed for good" in errors
        assert "Traceback" not in errors
    finally:
        if service.returncode is None:
            service.kill()
            await service.wait()
