"""`rankscope up --demo` for end-to-end tests: launched until its demo is ready, read over
HTTP, stopped as Ctrl-C stops it."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.stack_up import REPO, free_ports, stop_up, up_command

__all__ = ["Demo", "launch_demo", "stop_up"]


class Demo:
    """A running demo as its HTTP API answers."""

    def __init__(self, process: subprocess.Popen[str], base: str, data: Path) -> None:
        self.process = process
        self.base = base
        self.data = data

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.base + path, timeout=30) as reply:
            return json.loads(reply.read())

    def post(self, path: str, body: Any) -> Any:
        request = urllib.request.Request(
            self.base + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as reply:
            return json.loads(reply.read())

    def until(self, check: Callable[[], Any], seconds: float) -> Any:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                found = check()
            except (urllib.error.URLError, OSError, KeyError, IndexError):
                found = None
            if found:
                return found
            time.sleep(0.25)
        raise AssertionError(f"not reached within {seconds:g}s")


def launch_demo(
    data: Path,
    port: int,
    *flags: str,
    nats_port: int = 0,
    extra: dict[str, str] | None = None,
) -> subprocess.Popen[str]:
    """`rankscope up --demo` on `port` (NATS on `nats_port`, 0: any) with `data` and the
    `extra` variables, returned once its demo is ready."""
    env = {**os.environ, "RANKSCOPE_STALL_THRESHOLD": "3s", "RANKSCOPE_LOG_LEVEL": "warning"}
    env.update(extra or {})
    ring = ("--ring-port-base", str(free_ports(2)))
    process = subprocess.Popen(
        up_command(data, "--demo", *ring, *flags, gateway_port=port, nats_port=nats_port),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=REPO,
        env=env,
    )
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("demo ready"):
            return process
    raise AssertionError("the demo never became ready")
