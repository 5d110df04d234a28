"""Cold replay of single-entry telemetry messages through a `rankscope aggregator`
process, next to a bare follower process of the same stream, and restarts from a snapshot.

1. Cold replay: the stream holds `--replay` single-entry phase batches (the worst case:
   one message per entry). A bare follower process that only counts reads it, then a
   `rankscope aggregator` process rebuilds from it; seconds from each one's start until it
   has every message (the aggregator: ready, its health counting every entry), their
   ratio (target >= 0.5, ready <= 30 s at 1.2M) and the aggregator's peak RSS. It
   snapshots on the way out.
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
from pathlib import Path

import nats
from common import publish_placements, runner_ref, token_entry
from processes import aggregator_until_ready, bare_follower

from rankscope.shared.jetstream import Layout
from rankscope.shared.nats_server import EmbeddedNats
from rankscope.shared.provision import ensure
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


def _peak_rss_mib() -> float:
    """The largest peak RSS of the processes this one has waited for."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def _aggregator(url: str, data: Path, expected: int) -> tuple[float, float]:
    """A `rankscope aggregator` keeping its snapshot in `data`: seconds until ready with
    `expected` entries, and seconds it took to stop."""
    return asyncio.run(
        aggregator_until_ready(
            url,
            expected,
            data,
            telemetry_max_bytes=str(LAYOUT.telemetry_max_bytes),
            telemetry_max_msgs_per_subject=str(LAYOUT.telemetry_max_msgs_per_subject),
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replay", type=int, default=1_200_000)
    parser.add_argument("--restart", type=int, default=2_000_000)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp())
    data = root / "aggregator"
    with EmbeddedNats(store_dir=root / "nats") as server:
        asyncio.run(_fill(server.url, 0, args.replay))
        subject = LAYOUT.subjects.runner_all()
        bare = bare_follower(server.url, subject, args.replay, decode_each=False)
        took, _ = _aggregator(server.url, data, args.replay)
        print(
            f"cold replay of {args.replay:,} single-entry messages, processes from their start: "
            f"bare follower {bare:.1f} s | rankscope aggregator ready in {took:.1f} s "
            f"| ratio {bare / took:.2f} | peak RSS {_peak_rss_mib():,.0f} MiB"
        )
        asyncio.run(_fill(server.url, args.replay, args.restart))
        took, _ = _aggregator(server.url, data, args.restart)
        print(
            f"catch-up from a snapshot of {args.replay:,} with {args.restart - args.replay:,} "
            f"messages after it: ready in {took:.1f} s"
        )
        full, _ = _aggregator(server.url, root / "fresh", args.restart)
        took, snapshot_s = _aggregator(server.url, data, args.restart)
        size = sum(f.stat().st_size for f in data.glob("*.snapshot"))
        print(
            f"restart at {args.restart:,} stored messages: from its snapshot ready in "
            f"{took:.1f} s | full replay {full:.1f} s | ratio {full / took:.1f}x | snapshot "
            f"{size / 2**20:,.0f} MiB written in {snapshot_s:.1f} s on the way out "
            f"| peak RSS {_peak_rss_mib():,.0f} MiB"
        )


if __name__ == "__main__":
    main()
