"""Cold replay of single-entry telemetry messages, next to a bare consumer of the same
stream, and restarts from a snapshot.

1. Cold replay: the stream holds `--replay` single-entry phase batches (the worst case:
   one message per entry). A bare follower that only counts reads it, then the real
   aggregator rebuilds from it; messages/s of both, their ratio, time to ready and the
   process's peak RSS (target: 1.2M ready in <= 60 s). It snapshots on the way out.
2. Catch-up: the stream grows to `--restart` messages while no aggregator runs; a new one
   restores the snapshot and replays only what came after it.
3. Restart: the aggregator restarts at `--restart` stored messages, as after any stop
   (target: 2M ready in <= 10 s), next to a full replay of the same stream in this run.

Every figure is checked: the aggregator must hold every entry, the bare follower must see
every message.

    .venv/bin/python bench/aggregator_replay.py [--replay 1200000] [--restart 2000000]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import tempfile
import time
from pathlib import Path

import nats
from common import publish_placements, runner_ref, token_entry
from nats.aio.msg import Msg

from rankscope.services.aggregator.service import AggregatorService
from rankscope.services.aggregator.snapshot import SnapshotFile
from rankscope.services.aggregator.store import EntryStore
from rankscope.services.aggregator.views import ClusterState
from rankscope.shared.jetstream import Layout, ensure
from rankscope.shared.nats_server import EmbeddedNats
from rankscope.shared.replay import follow
from rankscope.shared.wire import PhaseEntries, encode

RUNNERS = 16
LAYOUT = Layout(telemetry_max_bytes=8 << 30, telemetry_max_msgs_per_subject=10_000_000)


def _message(index: int) -> tuple[str, bytes, str]:
    """Entry `index` of the synthetic cluster: runner `index % RUNNERS`, its own seq."""
    ref, seq = runner_ref(index % RUNNERS), index // RUNNERS
    subject = LAYOUT.subjects.runner(ref.nodeId, ref.instanceId, ref.deviceRank, "phase")
    batch = PhaseEntries(runner=ref, entries=[token_entry(seq)])
    return subject, encode(batch), f"{ref.runnerId}:{seq}"


async def _fill(url: str, first: int, last: int) -> None:
    nc = await nats.connect(url)
    js = nc.jetstream()
    await ensure(js, LAYOUT)
    if not first:
        await publish_placements(js, LAYOUT, RUNNERS)
    for start in range(first, last, 4000):
        acks = []
        for index in range(start, min(start + 4000, last)):
            subject, payload, msg_id = _message(index)
            acks.append(await js.publish_async(subject, payload, headers={"Nats-Msg-Id": msg_id}))
        await asyncio.gather(*acks)
    await nc.close()


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def _bare(url: str, count: int) -> float:
    """Seconds for a follower that only counts to see `count` messages."""
    nc = await nats.connect(url)
    seen, done = 0, asyncio.Event()

    async def count_only(msg: Msg) -> None:
        nonlocal seen
        seen += 1
        if seen == count:
            done.set()

    started = time.perf_counter()
    follower = await follow(nc.jetstream(), LAYOUT.subjects.runner_all(), count_only)
    await done.wait()
    elapsed = time.perf_counter() - started
    await follower.stop()
    await nc.close()
    return elapsed


async def _aggregator(
    url: str, snapshots: SnapshotFile | None, expected: int
) -> tuple[float, float]:
    """Seconds until a new aggregator is ready holding all `expected` entries, and the
    seconds its snapshot on the way out took."""
    nc = await nats.connect(url)
    state = ClusterState(store=EntryStore(total=10_000_000, per_runner=10_000_000))
    service = AggregatorService(
        nc=nc, js=nc.jetstream(), layout=LAYOUT, state=state, node_id="bench", snapshots=snapshots
    )
    stop = asyncio.Event()
    started = time.perf_counter()
    running = asyncio.create_task(service.run(stop))
    await service.ready.wait()
    elapsed = time.perf_counter() - started
    stop.set()
    stopping = time.perf_counter()
    await running
    snapshot_s = time.perf_counter() - stopping
    await nc.close()
    assert state.store.size == expected, f"aggregator held {state.store.size:,} of {expected:,}"
    return elapsed, snapshot_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replay", type=int, default=1_200_000)
    parser.add_argument("--restart", type=int, default=2_000_000)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp())
    snapshots = SnapshotFile(root / "aggregator.snapshot")
    with EmbeddedNats(store_dir=root / "nats") as server:
        asyncio.run(_fill(server.url, 0, args.replay))
        bare = asyncio.run(_bare(server.url, args.replay))
        took, _ = asyncio.run(_aggregator(server.url, snapshots, args.replay))
        print(
            f"cold replay of {args.replay:,} single-entry messages: bare follower "
            f"{args.replay / bare:,.0f} msgs/s | aggregator {args.replay / took:,.0f} msgs/s "
            f"| ratio {bare / took:.2f} | ready in {took:.1f} s | peak RSS {_rss_mib():,.0f} MiB"
        )
        asyncio.run(_fill(server.url, args.replay, args.restart))
        took, _ = asyncio.run(_aggregator(server.url, snapshots, args.restart))
        print(
            f"catch-up from a snapshot of {args.replay:,} with {args.restart - args.replay:,} "
            f"messages after it: ready in {took:.1f} s"
        )
        full, _ = asyncio.run(_aggregator(server.url, None, args.restart))
        took, snapshot_s = asyncio.run(_aggregator(server.url, snapshots, args.restart))
        print(
            f"restart at {args.restart:,} stored messages: from the snapshot ready in "
            f"{took:.1f} s | full replay {full:.1f} s | ratio {full / took:.1f}x | snapshot "
            f"{snapshots.path.stat().st_size / 2**20:,.0f} MiB written in {snapshot_s:.1f} s "
            f"| peak RSS {_rss_mib():,.0f} MiB"
        )


if __name__ == "__main__":
    main()
