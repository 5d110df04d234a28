"""The embedded nats-server starts with JetStream, stops cleanly and never outlives us."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import nats
import pytest

from rankscope.shared.nats_server import EmbeddedNats, NatsServerError, find_binary

pytestmark = pytest.mark.nats


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for every purpose that matters here.
    status = Path(f"/proc/{pid}/stat")
    return status.exists() and status.read_text().split()[2] != "Z"


def test_binary_comes_from_the_environment() -> None:
    assert find_binary().name == "nats-server"


async def test_serves_jetstream_on_a_free_port(tmp_path: Path) -> None:
    with EmbeddedNats(store_dir=tmp_path) as server:
        nc = await nats.connect(server.url)
        info = await nc.jetstream().account_info()
        await nc.close()
    assert info.limits is not None
    assert (tmp_path / "jetstream").is_dir()


def test_stop_leaves_no_process(tmp_path: Path) -> None:
    server = EmbeddedNats(store_dir=tmp_path).start()
    pid = server.pid
    assert pid is not None
    assert _alive(pid)
    server.stop()
    assert not _alive(pid)
    server.stop()  # stopping twice is harmless


def test_two_servers_get_two_ports(tmp_path: Path) -> None:
    with (
        EmbeddedNats(store_dir=tmp_path / "a") as a,
        EmbeddedNats(store_dir=tmp_path / "b") as b,
    ):
        assert a.url != b.url


def test_busy_port_fails_with_the_servers_reason(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = EmbeddedNats(store_dir=tmp_path, port=port, startup_timeout=5)
        with pytest.raises(NatsServerError, match=r"exited|not ready"):
            server.start()
        assert server.pid is None


def test_server_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from rankscope.shared.nats_server import EmbeddedNats
        server = EmbeddedNats(store_dir=Path({str(tmp_path)!r})).start()
        print(server.pid, flush=True)
        time.sleep(60)
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parent.parent,
    )
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())
    exited = os.pidfd_open(pid)
    try:
        assert not select.select([exited], [], [], 0)[0]
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        parent.stdout.close()
        assert select.select([exited], [], [], 10)[0], "nats-server outlived its parent"
    finally:
        os.close(exited)
