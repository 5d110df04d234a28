"""A service told to stop exits even when NATS went away first."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shared.nats_server import EmbeddedNats

pytestmark = pytest.mark.nats

REPO = Path(__file__).parent.parent


@pytest.mark.parametrize("service", ["aggregator", "ranktable", "agent"])
def test_sigterm_after_nats_is_gone_still_ends_the_process(tmp_path: Path, service: str) -> None:
    server = EmbeddedNats(store_dir=tmp_path / "nats").start()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            service,
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
        assert process.wait(timeout=15) in (0, 1)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stderr.close()
        server.stop()
