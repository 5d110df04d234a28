"""Aggregator throughput, query latency and memory, each next to its bare baseline.

1. Ingest: the same stream is read by a bare ordered consumer that only decodes, then
   rebuilt by the aggregator; entries/s of both and their ratio (target >= 0.7). Twice:
   in this process, and as users run it, a `rankscope aggregator` process (its real
   settings, a fresh data dir) timed from its start until its health counts every entry,
   beside a bare follower process timed from its start until it decoded every message.
2. Timeline query at 1M stored entries: p50/p99 of `limit=1000` including JSON encoding
   (target p99 <= 20 ms).
3. Memory per stored entry, by tracemalloc (target <= 300 bytes).

    .venv/bin/python bench/aggregator_ingest.py [--entries 200000] [--stored 1000000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

import nats
from common import placements, publish_placements, runner_ref, token_entry
from nats.js.api import DeliverPolicy
from processes import aggregator_until_ready, bare_follower

from rankscope.services.aggregator import answers
from rankscope.services.aggregator.service import AggregatorService
from rankscope.services.aggregator.store import EntryStore
from rankscope.services.aggregator.views import ClusterState
from rankscope.shared.jetstream import Layout
from rankscope.shared.nats_server import EmbeddedNats
from rankscope.shared.provision import ensure
from rankscope.shared.wire import (
    PhaseEntries,
    RunnerTelemetry,
    TimelineQuery,
    decode,
    encode,
)

RUNNERS = 16


def _batches(total: int, per_batch: int) -> list[tuple[str, bytes, str]]:
    """(subject, payload, msg id) of `total` entries over RUNNERS runners."""
    layout, out = Layout(), []
    per_runner = total // RUNNERS
    for r in range(RUNNERS):
        ref = runner_ref(r)
        subject = layout.subjects.runner(ref.nodeId, ref.instanceId, ref.deviceRank, "phase")
        for first in range(0, per_runner, per_batch):
            batch = PhaseEntries(
                runner=ref,
                entries=[
                    token_entry(s, rank=r % 8, src=0, dst=1, world_size=8)
                    for s in range(first, min(first + per_batch, per_runner))
                ],
            )
            # exact-size bytes, as the NATS client hands payloads over (msgspec's own
            # buffers keep spare capacity that would inflate the memory figure)
            payload = bytes(bytearray(encode(batch)))
            out.append((subject, payload, f"{ref.runnerId}:{first}"))
    return out


async def _fill(url: str, messages: list[tuple[str, bytes, str]]) -> Layout:
    layout = Layout()
    nc = await nats.connect(url)
    js = nc.jetstream()
    await ensure(js, layout)
    await publish_placements(js, layout, RUNNERS)
    for start in range(0, len(messages), 2000):
        acks = [
            await js.publish_async(s, p, headers={"Nats-Msg-Id": i})
            for s, p, i in messages[start : start + 2000]
        ]
        await asyncio.gather(*acks)
    await nc.close()
    return layout


async def _bare(url: str, layout: Layout, count: int) -> float:
    nc = await nats.connect(url)
    done = asyncio.Event()
    seen = 0

    async def decode_only(msg: nats.aio.msg.Msg) -> None:
        nonlocal seen
        decode(msg.data, RunnerTelemetry)
        seen += 1
        if seen == count:
            done.set()

    started = time.perf_counter()
    sub = await nc.jetstream().subscribe(
        layout.subjects.runner_all(),
        cb=decode_only,
        ordered_consumer=True,
        deliver_policy=DeliverPolicy.ALL,
    )
    await done.wait()
    elapsed = time.perf_counter() - started
    await sub.unsubscribe()
    await nc.close()
    return elapsed


async def _aggregator(url: str, layout: Layout) -> tuple[float, int]:
    nc = await nats.connect(url)
    state = ClusterState(store=EntryStore(total=10_000_000, per_runner=10_000_000))
    service = AggregatorService(
        nc=nc, js=nc.jetstream(), layout=layout, state=state, node_id="bench"
    )
    stop = asyncio.Event()
    started = time.perf_counter()
    running = asyncio.create_task(service.run(stop))
    await service.ready.wait()
    elapsed = time.perf_counter() - started
    stop.set()
    await running
    await nc.close()
    return elapsed, state.store.size


def _ingest(entries: int, per_batch: int) -> None:
    entries -= entries % RUNNERS
    messages = _batches(entries, per_batch)
    with EmbeddedNats(store_dir=Path(tempfile.mkdtemp())) as server:
        layout = asyncio.run(_fill(server.url, messages))
        bare = asyncio.run(_bare(server.url, layout, len(messages)))
        took, stored = asyncio.run(_aggregator(server.url, layout))
        subject = layout.subjects.runner_all()
        bare_process = bare_follower(server.url, subject, len(messages), decode_each=True)
        shipped, _ = asyncio.run(
            aggregator_until_ready(
                server.url,
                entries,
                Path(tempfile.mkdtemp()),
                retention_total=str(10 * entries),
                retention_per_runner=str(10 * entries),
            )
        )
    assert stored == entries, f"aggregator stored {stored} of {entries}"
    print(
        f"ingest, {per_batch:>2}-entry batches: bare decode {entries / bare:>9,.0f} entries/s "
        f"| aggregator {entries / took:>9,.0f} entries/s | ratio {bare / took:.2f}"
    )
    print(
        f"ingest, {per_batch:>2}-entry batches, processes from their start: bare follower "
        f"{bare_process:.1f} s | rankscope aggregator {shipped:.1f} s "
        f"| ratio {bare_process / shipped:.2f}"
    )


def _query_and_memory(stored: int) -> None:
    state = ClusterState(store=EntryStore(total=stored, per_runner=stored))
    for created in placements(RUNNERS):
        state.apply_placement(created)
    state.arrive(time.monotonic(), time.time())
    tracemalloc.start()
    payloads = [payload for _, payload, _ in _batches(stored, 64)]
    for payload in payloads:
        state.apply_telemetry(decode(payload, PhaseEntries), payload)
    del payloads  # what remains is what the store holds
    used = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    latencies = []
    for _ in range(200):
        started = time.perf_counter()
        encode(
            answers.timeline(
                state, TimelineQuery(limit=1000), local_node_id="bench", now=time.time()
            )
        )
        latencies.append((time.perf_counter() - started) * 1000)
    latencies.sort()
    print(
        f"timeline limit=1000 at {state.store.size:,} entries: p50 "
        f"{statistics.median(latencies):.1f} ms, p99 {latencies[int(len(latencies) * 0.99)]:.1f} ms"
    )
    print(
        f"memory: {used / state.store.size:.0f} bytes per stored entry (views and dedupe included)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=200_000)
    parser.add_argument("--stored", type=int, default=1_000_000)
    args = parser.parse_args()
    _ingest(args.entries // 4, 1)
    _ingest(args.entries, 32)
    _query_and_memory(args.stored)


if __name__ == "__main__":
    main()
