"""A job's pace samples, read back from a stopped `rankscope up`'s JetStream store, judged
again second by second by the rule that names the rank a job waits on: a recorded job's
ranks step by step (`services/aggregator/arrivals.py`), a pipeline's stages per layer
(`services/aggregator/stages.py`, with `--layers`: the whole pipeline rule, each stage's
own usual backed by the stages compared, `slowness.py`). Prints what it named, when, and every
rank's share, how often it was the one waited on, and its work meanwhile. For tuning the
rules on a run already made (`bench/soak.py` and `bench/detection.py` print their data
directories).

    .venv/bin/python bench/straggler_replay.py DATA_DIR --job soak [--share 0.1]
        [--certainty 4] [--window 20] [--dominance 2.5] [--alone 0.05] [--near 0.07]
    .venv/bin/python bench/straggler_replay.py DATA_DIR --job demo-0 --layers 2,2
        [--apart 1.25] [--certainty 2] [--share 0.03] [--slice 2] [--glance 8] [--spins 0.25]
        [--spread 0.95]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import nats
from nats.errors import TimeoutError as NatsTimeoutError

from rankscope.services.aggregator.arrivals import ArrivalLimits, Straggle, judge_arrivals
from rankscope.services.aggregator.pace import PaceHistory, SlowVerdict
from rankscope.services.aggregator.rules import Thresholds
from rankscope.services.aggregator.slowness import Ranks, judge_slowness
from rankscope.services.aggregator.stages import StageLimits
from rankscope.shared.jetstream import Layout
from rankscope.shared.nats_server import EmbeddedNats
from rankscope.shared.wire import MemorySampled, StepPace, decode

Stored = list[tuple[float, int, str, StepPace]]
"""When NATS stored each pace sample, its rank, the rank's node, the sample."""
Judged = Callable[[list[PaceHistory], float, frozenset[int]], Straggle | SlowVerdict | None]


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
                found.append((stored, runner.deviceRank, runner.nodeId, sample.pace))
    finally:
        await client.close()
    return found


def _replay(stored: Stored, judge: Judged, near: float) -> None:
    """Judge the samples second by second as the aggregator would have, printing each
    second that names a rank or comes within `near` of the share that would."""
    world = max(rank for _, rank, _, _ in stored) + 1
    ranks = [PaceHistory() for _ in range(world)]
    start, end = stored[0][0], stored[-1][0]
    named: frozenset[int] = frozenset()
    seconds_named, next_sample, moment = 0, 0, start
    began = time.process_time()
    while moment <= end:
        while next_sample < len(stored) and stored[next_sample][0] <= moment:
            at, rank, _, pace = stored[next_sample]
            ranks[rank].add(at, pace)
            next_sample += 1
        found = judge(ranks, moment, named)
        if isinstance(found, SlowVerdict):  # a stage named by its own usual, backed
            named = frozenset(found.slow)
            seconds_named += 1
            print(
                f"{time.strftime('%H:%M:%S', time.gmtime(moment))} "
                f"{moment - start:7.0f}s named {sorted(named)!s:8} by its own usual "
                f"{[p.ratio for p in found.paces]} vs peers per layer {found.backed}"
            )
            moment += 1.0
            continue
        straggle = found
        named = frozenset(straggle.stragglers) if straggle else frozenset()
        seconds_named += bool(named)
        if straggle is not None and (named or max(straggle.waited_on) >= near):
            print(
                f"{time.strftime('%H:%M:%S', time.gmtime(moment))} "
                f"{moment - start:7.0f}s named {sorted(named)!s:8} share "
                f"{[round(s, 3) for s in straggle.waited_on]} last "
                f"{[round(s, 2) for s in straggle.last]} work ms "
                f"{[round(w, 2) for w in straggle.work_ms]} vs peers "
                f"{[round(straggle.work_vs_peers(r), 2) for r in range(world)]} "
                f"({straggle.steps} steps)"
            )
        moment += 1.0
    took = time.process_time() - began
    print(
        f"{end - start:.0f} s judged, a rank named for {seconds_named} s "
        f"({1000 * took / max(1.0, end - start):.2f} ms of CPU a second judged, printing included)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    arrivals, stages = ArrivalLimits(), StageLimits()
    parser.add_argument("data", type=Path, help="the stopped stack's data directory")
    parser.add_argument("--job", required=True)
    parser.add_argument("--layers", help="a pipeline's layers per stage, comma separated")
    parser.add_argument("--share", type=float)
    parser.add_argument("--certainty", type=float)
    parser.add_argument("--window", type=float, default=arrivals.window)
    parser.add_argument("--dominance", type=float, default=arrivals.dominance)
    parser.add_argument("--alone", type=float, default=arrivals.alone)
    parser.add_argument("--apart", type=float, default=stages.apart)
    parser.add_argument("--beyond", type=float, default=stages.beyond)
    parser.add_argument("--slice", type=float, default=stages.slice)
    parser.add_argument("--clear", type=float, default=stages.clear, help="a stage held")
    parser.add_argument("--glance", type=float, default=stages.glance)
    parser.add_argument("--spins", type=float, default=stages.spins, help="> 1: CPU unread")
    parser.add_argument("--starved", type=float, default=stages.starved)
    parser.add_argument("--spread", type=float, default=stages.spread)
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
    world = max(rank for _, rank, _, _ in stored) + 1
    nodes = [next(node for _, r, node, _ in stored if r == rank) for rank in range(world)]
    limits: StageLimits | ArrivalLimits
    if args.layers:
        layers = [int(count) for count in args.layers.split(",")]
        limits = StageLimits(
            window=args.window,
            share=stages.share if args.share is None else args.share,
            certainty=stages.certainty if args.certainty is None else args.certainty,
            apart=args.apart,
            beyond=args.beyond,
            slice=args.slice,
            clear=args.clear,
            glance=args.glance,
            spins=args.spins,
            starved=args.starved,
            spread=args.spread,
        )
    else:
        limits = ArrivalLimits(
            window=args.window,
            share=arrivals.share if args.share is None else args.share,
            certainty=arrivals.certainty if args.certainty is None else args.certainty,
            dominance=args.dominance,
            alone=args.alone,
        )

    def judge(
        ranks: list[PaceHistory], now: float, named: frozenset[int]
    ) -> Straggle | SlowVerdict | None:
        if isinstance(limits, StageLimits):  # the whole pipeline rule, own usual included
            return judge_slowness(
                Ranks(ranks, nodes, layers), now, Thresholds(stages=limits), named
            )
        return judge_arrivals([r.arrivals for r in ranks], now, limits, named, nodes)

    _replay(stored, judge, args.near)


if __name__ == "__main__":
    main()
