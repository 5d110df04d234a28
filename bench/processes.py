"""The processes benchmarks time, run as users run them: a `rankscope aggregator` with its
real settings, and the bare followers it is measured against."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nats

from rankscope.shared.jetstream import Layout
from rankscope.shared.wire import AggregatorHealth, WireError, decode

__all__ = ["aggregator_until_ready", "bare_follower"]

BARE = """
import asyncio, sys, nats
from nats.js.api import DeliverPolicy
from rankscope.shared.replay import follow
from rankscope.shared.wire import RunnerTelemetry, decode

async def main(url, subject, count, mode):
    nc, done, seen = await nats.connect(url), asyncio.Event(), 0
    async def handle(msg):
        nonlocal seen
        if mode == "decode":
            decode(msg.data, RunnerTelemetry)
        seen += 1
        if seen == count:
            done.set()
    if mode == "decode":  # a push consumer that decodes each message: the least a reader does
        await nc.jetstream().subscribe(
            subject, cb=handle, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL
        )
    else:  # the aggregator's own follower, counting: what replay costs before any work
        await follow(nc.jetstream(), subject, handle)
    await done.wait()
    await nc.close()

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]))
"""

HEALTH_POLL_S = 0.05
"""How often the aggregator's health is asked for, as a gateway's /readyz would."""


def bare_follower(url: str, subject: str, count: int, *, decode_each: bool) -> float:
    """Seconds from the start of a process that reads `count` messages of `subject` (and
    decodes each, or only counts them) to its end."""
    started = time.perf_counter()
    mode = "decode" if decode_each else "count"
    subprocess.run([sys.executable, "-c", BARE, url, subject, str(count), mode], check=True)
    return time.perf_counter() - started


async def aggregator_until_ready(
    url: str, entries: int, data_dir: Path, **settings: str
) -> tuple[float, float]:
    """Seconds from the start of a `rankscope aggregator` process (data in `data_dir`,
    `settings` as `RANKSCOPE_*` variables) until its health says ready with `entries`
    entries, and the seconds it then takes to stop (its snapshot on the way out).

    Raises:
        AssertionError: it holds more entries than `entries`.
    """
    env = {
        **os.environ,
        "RANKSCOPE_NATS_URL": url,
        "RANKSCOPE_DATA_DIR": str(data_dir),
        "RANKSCOPE_LOG_LEVEL": "warning",
        **{f"RANKSCOPE_{name.upper()}": value for name, value in settings.items()},
    }
    nc = await nats.connect(url)
    started = time.perf_counter()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rankscope.services.cli", "aggregator", "--node-id", "bench",
        env=env,
    )  # fmt: skip
    try:
        while True:
            try:
                reply = await nc.request(Layout().subjects.query("health"), b"{}", timeout=1)
                health = decode(reply.data, AggregatorHealth)
            except (nats.errors.Error, TimeoutError, WireError):
                health = None
            if health is not None and health.ready and health.entries >= entries:
                ready = time.perf_counter() - started
                assert health.entries == entries, f"aggregator holds {health.entries:,}"
                break
            await asyncio.sleep(HEALTH_POLL_S)
        stopping = time.perf_counter()
        process.send_signal(signal.SIGTERM)
        await process.wait()
        return ready, time.perf_counter() - stopping
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await nc.close()
