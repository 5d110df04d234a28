"""`rankscope up` brings up NATS with every stream, and SIGTERM leaves nothing behind."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from shared.jetstream import Layout

pytestmark = pytest.mark.nats

REPO = Path(__file__).parent.parent


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], dict[str, str]]]:
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--demo", "--nats-port", "0",
         "--data-dir", str(tmp_path / "data")],
        stdout=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    assert process.stdout is not None
    shown: dict[str, str] = {}
    for line in process.stdout:
        if line.startswith("Ctrl-C"):
            break
        name, value = re.split(r"\s{2,}", line.strip(), maxsplit=1)
        shown[name] = value
    yield process, shown
    if process.poll() is None:
        process.kill()
    process.wait()
    process.stdout.close()


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


def test_demo_model_is_generated(stack: tuple[subprocess.Popen[str], dict[str, str]]) -> None:
    _, shown = stack
    assert Path(shown["demo model"], "model.safetensors").exists()


def test_sigterm_stops_everything(stack: tuple[subprocess.Popen[str], dict[str, str]]) -> None:
    process, _ = stack
    children = _children(process.pid)
    assert children, "the embedded nats-server should be a child of `rankscope up`"
    watches = [os.pidfd_open(pid) for pid in children]
    try:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
        ready, _, _ = select.select(watches, [], [], 10)
        assert len(ready) == len(watches), "a child outlived `rankscope up`"
    finally:
        for fd in watches:
            os.close(fd)
