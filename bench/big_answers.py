"""Small queries while big timelines are built.

The aggregator holds `--stored` entries over 16 runners. In one process 12 clients fetch
75,000-entry timelines back to back; in another, a prober asks for the diagnosis and a
100-entry timeline 10 times a second. The prober's p50/p99 are printed for three runs side
by side: no big clients; big clients with big timelines in their own lane (as shipped);
and big clients with every timeline built in one go on the query path (as before).
Target: p99 <= 250 ms with the big clients.

    .venv/bin/python bench/big_answers.py [--stored 1000000] [--seconds 15]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

import nats
from common import placements, runner_ref, token_entry

import rankscope.services.aggregator.queries as aggregator_queries
from rankscope.services.aggregator.service import AggregatorService
from rankscope.services.aggregator.store import EntryStore
from rankscope.services.aggregator.views import ClusterState
from rankscope.shared.jetstream import Layout
from rankscope.shared.nats_server import EmbeddedNats
from rankscope.shared.provision import ensure
from rankscope.shared.wire import PhaseEntries, decode, encode

RUNNERS, BIG_CLIENTS, BIG_LIMIT = 16, 12, 75_000
LAYOUT = Layout()


def _state(stored: int) -> ClusterState:
    state = ClusterState(store=EntryStore(total=stored, per_runner=stored))
    for created in placements(RUNNERS):
        state.apply_placement(created)
    state.arrive(time.monotonic(), time.time())
    per_runner = stored // RUNNERS
    for r in range(RUNNERS):
        ref = runner_ref(r)
        for first in range(0, per_runner, 64):
            batch = PhaseEntries(
                runner=ref,
                entries=[token_entry(s) for s in range(first, min(first + 64, per_runner))],
            )
            payload = encode(batch)
            state.apply_telemetry(decode(payload, PhaseEntries), payload)
    return state


async def _big(url: str, seconds: float) -> None:
    nc = await nats.connect(url, max_reconnect_attempts=0)
    subject = LAYOUT.subjects.query("timeline")
    deadline = time.monotonic() + seconds
    asked = 0

    async def client() -> None:
        nonlocal asked
        while time.monotonic() < deadline:
            asked += 1  # a different `until` each time: no answer is shared, as under ingest
            until = f"2026-11-22T00:00:00.{asked % 1_000_000:06d}Z"
            body = encode({"limit": BIG_LIMIT, "until": until})
            # a request of its own per answer: tens of MB each overflow a shared inbox
            await nc.request(subject, body, timeout=300, old_style=True)

    await asyncio.gather(*(client() for _ in range(BIG_CLIENTS)))
    await nc.close()


async def _probe(url: str, seconds: float) -> list[float]:
    nc = await nats.connect(url, max_reconnect_attempts=0)
    latencies = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for view, body in (("diagnosis", b"{}"), ("timeline", encode({"limit": 100}))):
            started = time.perf_counter()
            await nc.request(LAYOUT.subjects.query(view), body, timeout=60)
            latencies.append((time.perf_counter() - started) * 1000)
        await asyncio.sleep(0.1)
    await nc.close()
    return latencies


def _big_process(url: str, seconds: float) -> None:
    asyncio.run(_big(url, seconds))


def _probe_process(url: str, seconds: float, out: multiprocessing.Queue[list[float]]) -> None:
    out.put(asyncio.run(_probe(url, seconds)))


async def _run(url: str, state: ClusterState, seconds: float, big: bool) -> list[float]:
    nc = await nats.connect(url)
    service = AggregatorService(
        nc=nc, js=nc.jetstream(), layout=LAYOUT, state=state, node_id="bench"
    )
    stop = asyncio.Event()
    running = asyncio.create_task(service.run(stop))
    await service.ready.wait()
    spawn = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue[list[float]] = spawn.Queue()
    workers = [spawn.Process(target=_probe_process, args=(url, seconds, results))]
    if big:
        workers.append(spawn.Process(target=_big_process, args=(url, seconds)))
    for worker in workers:
        worker.start()
    while (latencies := await asyncio.to_thread(_poll, results)) is None:
        pass
    for worker in workers:
        await asyncio.to_thread(worker.join)
    stop.set()
    await running
    await nc.close()
    return latencies


def _poll(results: multiprocessing.Queue[list[float]]) -> list[float] | None:
    try:
        return results.get(timeout=1)
    except Exception:
        return None


def _line(label: str, latencies: list[float]) -> str:
    latencies.sort()
    p99 = latencies[int(len(latencies) * 0.99)]
    return (
        f"{label:<44} diagnosis + 100-entry timeline: p50 {statistics.median(latencies):6.1f} ms"
        f", p99 {p99:7.1f} ms ({len(latencies)} queries)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stored", type=int, default=1_000_000)
    parser.add_argument("--seconds", type=float, default=15.0)
    args = parser.parse_args()
    state = _state(args.stored)
    print(f"aggregator holding {state.store.size:,} entries of {RUNNERS} runners")
    with EmbeddedNats(store_dir=Path(tempfile.mkdtemp())) as server:
        asyncio.run(_ensure(server.url))
        quiet = asyncio.run(_run(server.url, state, args.seconds, big=False))
        print(_line("no big clients", quiet))
        lane = asyncio.run(_run(server.url, state, args.seconds, big=True))
        print(_line(f"{BIG_CLIENTS} clients x {BIG_LIMIT:,} entries, own lane", lane))
        aggregator_queries.HEAVY_ENTRIES = 10**9  # every timeline on the query path
        one_go = asyncio.run(_run(server.url, state, args.seconds, big=True))
        print(_line(f"{BIG_CLIENTS} clients x {BIG_LIMIT:,} entries, one lane", one_go))


async def _ensure(url: str) -> None:
    nc = await nats.connect(url)
    await ensure(nc.jetstream(), LAYOUT)
    await nc.close()


if __name__ == "__main__":
    main()
