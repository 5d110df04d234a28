"""`GET /v1/cluster/timeline?limit=1000` through the gateway, next to a bare Starlette
endpoint that serves the same bytes, in the same run (target: >= 0.8 of bare).

Aggregator, gateway and the bare endpoint each run in their own process, as deployed;
the same client makes the same requests with the same concurrency to both, alternating.

    .venv/bin/python bench/gateway_timeline.py [--requests 400] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import nats
from common import free_port, publish_placements, runner_ref

from rankscope.shared.jetstream import Layout
from rankscope.shared.nats_server import EmbeddedNats
from rankscope.shared.provision import ensure
from rankscope.shared.wire import FlightEntry, Phase, PhaseEntries, encode

BARE = """
import sys, uvicorn
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route
body = open(sys.argv[1], "rb").read()
async def timeline(request):
    return Response(body, media_type="application/json")
app = Starlette(routes=[Route("/v1/cluster/timeline", timeline)])
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning", access_log=False)
"""


async def _fill(url: str) -> None:
    layout = Layout()
    nc = await nats.connect(url)
    js = nc.jetstream()
    await ensure(js, layout)
    await publish_placements(js, layout, 8)
    for r in range(8):
        ref = runner_ref(r)
        subject = layout.subjects.runner(ref.nodeId, ref.instanceId, r, "phase")
        acks = []
        for first in range(0, 20_000, 64):
            batch = PhaseEntries(
                runner=ref,
                entries=[
                    FlightEntry(
                        seq=s,
                        at=f"2026-11-21T12:{s // 6000 % 60:02d}:{s // 100 % 60:02d}."
                        f"{s % 100:02d}0000Z",
                        phase=Phase.DECODE_STREAM,
                        event="token",
                        attrs={"step": s, "rank": r},
                    )
                    for s in range(first, first + 64)
                ],
            )
            acks.append(await js.publish_async(subject, encode(batch)))
        await asyncio.gather(*acks)
    await nc.close()


async def _ready(url: str) -> bytes:
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        for _ in range(600):
            try:
                if (await client.get("/readyz")).status_code == 200:
                    reply = await client.get("/v1/cluster/timeline", params={"limit": 1000})
                    return reply.content
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} never became ready")


async def _load(url: str, requests: int, concurrency: int) -> tuple[float, list[float]]:
    latencies: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:

        async def worker(count: int) -> None:
            for _ in range(count):
                started = time.perf_counter()
                reply = await client.get("/v1/cluster/timeline", params={"limit": 1000})
                reply.raise_for_status()
                latencies.append((time.perf_counter() - started) * 1000)

        started = time.perf_counter()
        await asyncio.gather(*(worker(requests // concurrency) for _ in range(concurrency)))
        return requests // concurrency * concurrency / (time.perf_counter() - started), latencies


async def _compare(gateway: str, bare: str, requests: int, concurrency: int) -> None:
    rates: dict[str, list[float]] = {"bare": [], "gateway": []}
    latencies: dict[str, list[float]] = {"bare": [], "gateway": []}
    for _ in range(3):
        for name, url in (("bare", bare), ("gateway", gateway)):
            rate, lat = await _load(url, requests, concurrency)
            rates[name].append(rate)
            latencies[name] += lat
    for name in ("bare", "gateway"):
        lat = sorted(latencies[name])
        print(
            f"{name:<8} {statistics.median(rates[name]):7.1f} requests/s  "
            f"p50 {statistics.median(lat):6.1f} ms  p99 {lat[int(len(lat) * 0.99)]:6.1f} ms"
        )
    ratio = statistics.median(rates["gateway"]) / statistics.median(rates["bare"])
    print(f"gateway/bare: {ratio:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    gateway_port, bare_port = free_port(), free_port()
    with EmbeddedNats(store_dir=Path(tempfile.mkdtemp())) as server:
        asyncio.run(_fill(server.url))
        env = {
            **os.environ,
            "RANKSCOPE_NATS_URL": server.url,
            "RANKSCOPE_LOG_LEVEL": "warning",
            "RANKSCOPE_GATEWAY_PORT": str(gateway_port),
        }
        services = [
            subprocess.Popen([sys.executable, "-m", "rankscope.services.cli", name], env=env)
            for name in ("aggregator", "gateway")
        ]
        try:
            body = asyncio.run(_ready(f"http://127.0.0.1:{gateway_port}"))
            with tempfile.NamedTemporaryFile(delete=False) as saved:
                saved.write(body)
            services.append(
                subprocess.Popen([sys.executable, "-c", BARE, saved.name, str(bare_port)])
            )
            print(f"{len(body):,} bytes a response (1000 of 160,000 entries)")
            asyncio.run(_wait_bare(f"http://127.0.0.1:{bare_port}"))
            asyncio.run(
                _compare(
                    f"http://127.0.0.1:{gateway_port}",
                    f"http://127.0.0.1:{bare_port}",
                    args.requests,
                    args.concurrency,
                )
            )
        finally:
            for process in services:
                process.terminate()
                process.wait()


async def _wait_bare(url: str) -> None:
    async with httpx.AsyncClient(base_url=url) as client:
        for _ in range(100):
            try:
                await client.get("/v1/cluster/timeline")
                return
            except httpx.TransportError:
                await asyncio.sleep(0.1)


if __name__ == "__main__":
    main()
