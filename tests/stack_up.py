"""`rankscope up` as a user runs it, for tests that need the whole stack in its own
processes, and free ports to give it."""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

__all__ = ["free_port", "free_ports", "running_up", "stop_up", "up_command"]

REPO = Path(__file__).parent.parent


def free_port() -> int:
    """A TCP port nobody listens on right now, below the ephemeral range: one the kernel
    handed out (port 0) may be another test's client port by the time it is bound."""
    return free_ports(1)


_GIVEN: set[int] = set()
"""Ports this process handed out: each is free when drawn but bound only later, by a
process not started yet, so a second draw must not hand it out again (a gateway and a
rank-table service of one deployment once drew the same port)."""


def free_ports(count: int) -> int:
    """The first of `count` consecutive TCP ports nobody listens on right now and this
    process has not handed out, below the ephemeral range (where the kernel picks other
    tests' client ports): a ring of ranks binds one port a rank from a base."""
    draw = random.Random()
    for _ in range(200):
        base = draw.randrange(20_000, 32_000 - count)
        if _GIVEN.intersection(range(base, base + count)):
            continue
        try:
            with contextlib.ExitStack() as held:
                for port in range(base, base + count):
                    probe = held.enter_context(socket.socket())
                    probe.bind(("127.0.0.1", port))
        except OSError:
            continue
        _GIVEN.update(range(base, base + count))
        return base
    raise OSError(f"no {count} consecutive free ports")


def up_command(
    data: Path, *extra: str, gateway_port: int | None = None, nats_port: int = 0
) -> list[str]:
    """`rankscope up` with its data in `data`, on free ports unless given, and `extra`."""
    return [
        sys.executable,
        "-m",
        "rankscope.services.cli",
        "up",
        "--nats-port",
        str(nats_port),
        "--gateway-port",
        str(gateway_port or free_port()),
        "--grpc-port",
        str(free_port()),
        "--data-dir",
        str(data),
        *extra,
    ]


@contextlib.contextmanager
def running_up(
    data: Path, *extra: str, env: dict[str, str] | None = None, nats_port: int = 0
) -> Iterator[tuple[subprocess.Popen[str], dict[str, str]]]:
    """`rankscope up` (its data in `data`) running until the block ends, stopped as
    Ctrl-C stops it, and the lines it printed at start by their label (`NATS`, `web`)."""
    process = subprocess.Popen(
        up_command(data, *extra, nats_port=nats_port),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )
    assert process.stdout is not None
    shown: dict[str, str] = {}
    for line in process.stdout:
        if line.startswith("Ctrl-C"):
            break
        parts = re.split(r"\s{2,}", line.strip(), maxsplit=1)
        if len(parts) == 2:
            shown[parts[0]] = parts[1]
    try:
        yield process, shown
    finally:
        stop_up(process)


def stop_up(process: subprocess.Popen[str]) -> None:
    """Stop `up` as Ctrl-C does, so it stops its NATS server too (on the portable path
    nothing else would), and by force only if it does not end."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
    process.wait()
    for pipe in (process.stdout, process.stderr):
        if pipe is not None:
            pipe.close()
