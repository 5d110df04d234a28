"""A recorded job's sampled steps, read back from a stopped `rankscope up`'s JetStream store,
judged again by the arrivals rule (`services/aggregator/arrivals.py`) second by second:
what it named, when, and every rank's share, last-arrival rate and work meanwhile. For
tuning the rule on a run already made (`bench/soak.py` prints its data directory).

    .venv/bin/python bench/arrivals_replay.py DATA_DIR --job soak [--share 0.1]
        [--certainty 4] [--window 20] [--dominance 2.5] [--near 0.07]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
from pathlib import Path

import nats
from nats.errors import TimeoutError as NatsTimeoutError

from rankscope.services.aggregator.arrivals import ArrivalLimits, Arrivals, judge_arrivals
from rankscope.shared.jetstream import Layout
from rankscope.shared.nats_server import EmbeddedNats
from rankscope.shared.wire import MemorySampled, SampledStep, decode

Stored = list[tuple[float, int, str, list[SampledStep]]]
"""When NATS stored each pace sample, its rank, the rank's node, its sampled steps."""


async def _read(url: str, job: str) -> Stored:
    """Every pace sample of `job`'s ranks, in the order NATS stored them."""
    client = await nats.connect(url)
    found: Stored = []
    try:
        subject = Layout().subjects.runner_all()
        sub = await client.jetstream().subscribe(subject, ordered_consumer=True)
        while True:
            try:
                msg = await sub.next_msg(timeout=3)
            except NatsTimeoutError:
                break
            if not msg.subject.endswith(".memory"):
                continue
            sample = decode(msg.data, MemorySampled)
            if sample.runner.instanceId == job and sample.pace is not None:
                stored = msg.metadata.timestamp.timestamp()
                runner = sample.runner
                found.append((stored, runner.deviceRank, runner.nodeId, list(sample.pace.sampled)))
    finally:
        await client.close()
    return found


def _replay(stored: Stored, limits: ArrivalLimits, near: float) -> None:
    """Judge the samples second by second as the aggregator would have, printing each
    second that names a rank or comes within `near` of the share that would."""
    world = max(rank for _, rank, _, _ in stored) + 1
    ranks = [Arrivals() for _ in range(world)]
    nodes = [next(node for _, r, node, _ in stored if r == rank) for rank in range(world)]
    start, end = stored[0][0], stored[-1][0]
    named: frozenset[int] = frozenset()
    seconds_named, next_sample, moment = 0, 0, start
    while moment <= end:
        while next_sample < len(stored) and stored[next_sample][0] <= moment:
            at, rank, _, steps = stored[next_sample]
            ranks[rank].add(at, steps)
            next_sample += 1
        straggle = judge_arrivals(ranks, moment, limits, named, nodes)
        named = frozenset(straggle.stragglers) if straggle else frozenset()
        seconds_named += bool(named)
        if straggle is not None and (named or max(straggle.waited_on) >= near):
            print(
                f"{moment - start:7.0f}s named {sorted(named)!s:8} share "
                f"{[round(s, 3) for s in straggle.waited_on]} last "
                f"{[round(s, 2) for s in straggle.last]} work ms "
                f"{[round(w, 1) for w in straggle.work_ms]} ({straggle.steps} steps)"
            )
        moment += 1.0
    print(f"{end - start:.0f} s judged, a rank named for {seconds_named} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = ArrivalLimits()
    parser.add_argument("data", type=Path, help="the stopped stack's data directory")
    parser.add_argument("--job", required=True)
    parser.add_argument("--share", type=float, default=defaults.share)
    parser.add_argument("--certainty", type=float, default=defaults.certainty)
    parser.add_argument("--window", type=float, default=defaults.window)
    parser.add_argument("--dominance", type=float, default=defaults.dominance)
    parser.add_argument("--near", type=float, default=0.07, help="print seconds above this")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:  # the store copied: left as it was
        store = Path(scratch) / "nats"
        shutil.copytree(args.data / "nats", store)
        with EmbeddedNats(store_dir=store) as server:
            stored = asyncio.run(_read(server.url, args.job))
    if not stored:
        sys.exit(f"no pace samples of job {args.job!r} in {args.data}")
    stored.sort(key=lambda sample: sample[0])
    limits = ArrivalLimits(
        window=args.window, share=args.share, certainty=args.certainty, dominance=args.dominance
    )
    _replay(stored, limits, args.near)


if __name__ == "__main__":
    main()
