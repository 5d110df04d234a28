"""The web timeline with 64 ranks and 50,000 entries on screen: headless Chromium loads
the page from a real stack (aggregator and gateway processes) and prints its status line.
Headless Chromium runs on virtual time here, so the page's own timings are not real ones.

    .venv/bin/python bench/web_timeline.py [--ranks 64] [--entries 50000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import nats
from common import free_port, publish_placements, runner_ref

from rankscope.shared.jetstream import Layout
from rankscope.shared.nats_server import EmbeddedNats
from rankscope.shared.provision import ensure
from rankscope.shared.timestamps import format_ts
from rankscope.shared.wire import (
    FlightEntry,
    Memory,
    MlxMemorySnapshot,
    Phase,
    PhaseEntries,
    encode,
)

CYCLE = [
    Phase.TASK_AGREEMENT,
    Phase.PROMPT_BUILD,
    Phase.PREFILL_PIPELINE,
    Phase.DECODE_BARRIER,
    Phase.DECODE_STREAM,
    Phase.DECODE_STREAM,
    Phase.DECODE_STREAM,
    Phase.COMPLETION,
    Phase.IDLE,
]


async def _fill(url: str, ranks: int, entries: int) -> None:
    layout = Layout()
    nc = await nats.connect(url)
    js = nc.jetstream()
    await ensure(js, layout)
    per_rank = entries // ranks
    await publish_placements(js, layout, ranks)
    start = datetime.now(UTC) - timedelta(seconds=15)  # ends ~5 s ahead: all on screen at load
    for r in range(ranks):
        ref = runner_ref(r)
        subject = layout.subjects.runner(ref.nodeId, ref.instanceId, ref.deviceRank, "phase")
        acks = []
        for first in range(0, per_rank, 64):
            batch = PhaseEntries(
                runner=ref,
                entries=[
                    FlightEntry(
                        seq=s,
                        at=format_ts(start + timedelta(seconds=25 * s / per_rank)),
                        phase=CYCLE[s % len(CYCLE)],
                        event="e",
                        attrs={"step": s},
                        mlxMemory=MlxMemorySnapshot(
                            generatedAt=format_ts(start),
                            source="mlx.core",
                            active=Memory(inBytes=1 << 30 + s % 7),
                        )
                        if s % 50 == 0
                        else None,
                    )
                    for s in range(first, min(first + 64, per_rank))
                ],
            )
            acks.append(await js.publish_async(subject, encode(batch)))
        await asyncio.gather(*acks)
    await nc.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--entries", type=int, default=50_000)
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("needs headless Chromium (Debian package chromium)")
    port = free_port()
    with EmbeddedNats(store_dir=Path(tempfile.mkdtemp())) as server:
        asyncio.run(_fill(server.url, args.ranks, args.entries))
        env = {
            **os.environ,
            "RANKSCOPE_NATS_URL": server.url,
            "RANKSCOPE_LOG_LEVEL": "warning",
            "RANKSCOPE_GATEWAY_PORT": str(port),
        }
        services = [
            subprocess.Popen([sys.executable, "-m", "rankscope.services.cli", name], env=env)
            for name in ("aggregator", "gateway")
        ]
        try:
            time.sleep(4)
            dom = subprocess.run(
                [
                    chromium,
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--no-first-run",
                    "--disable-background-networking",
                    f"--user-data-dir={tempfile.mkdtemp()}",
                    "--window-size=1600,2400",
                    "--virtual-time-budget=15000",
                    "--dump-dom",
                    f"http://127.0.0.1:{port}/",
                ],
                capture_output=True,
                text=True,
                timeout=120,
            ).stdout
        finally:
            for process in services:
                process.terminate()
                process.wait()
    status = re.search(r'<span id="status">([^<]*)</span>', dom)
    print(status.group(1) if status else "no status rendered")


if __name__ == "__main__":
    main()
