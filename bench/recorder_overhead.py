"""Decode tokens/s of one runner with the flight recorder off, on, and on with the pace
(each sampled step's wait and work timed apart), side by side.

The same process, model and prompt run alternately with the recorder on (entries go
through the real bounded queue to a thread that drains it, as the agent does) and off;
the ratio of the medians is the recorder's cost. The pace runs through the same layer
wrappers a pipeline rank's do (here in a group of one), and its cost is its ratio to the
recorder on without it. Target: under 1% each.

    .venv/bin/python bench/recorder_overhead.py [--rounds 5] [--tokens 128] [--hidden 768]
"""

from __future__ import annotations

import argparse
import multiprocessing
import queue
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from rankscope.services.agent.runner.config import RunnerConfig
from rankscope.services.agent.runner.generation import Generation
from rankscope.services.agent.runner.memory import snapshot
from rankscope.services.agent.runner.pace import Pace
from rankscope.services.agent.runner.recorder import Recorder
from rankscope.services.agent.runner.shard import load_shard
from rankscope.services.agent.runner.watchdog import Watchdog
from rankscope.shared.timestamps import now
from rankscope.shared.tiny_model import TinyModelSpec, write_tiny_model
from rankscope.shared.wire import (
    GenerationRequest,
    RunnerAssignment,
    RunnerRef,
    TaskCreated,
    TaskKind,
)


def _drain(telemetry: Any, control: Any) -> None:
    """The agent's side, in its own process as in production: read everything."""
    while True:
        for channel in (telemetry, control):
            try:
                channel.get(timeout=0.05)
            except queue.Empty:
                continue


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=768)
    args = parser.parse_args()

    model = write_tiny_model(
        Path(tempfile.mkdtemp()) / "m", TinyModelSpec(layers=args.layers, hidden=args.hidden)
    )
    rank = RunnerAssignment(
        runnerId="bench",
        nodeId="bench",
        deviceRank=0,
        worldSize=1,
        startLayer=0,
        endLayer=args.layers,
        nLayers=args.layers,
        host="127.0.0.1",
        port=1,
    )
    ref = RunnerRef(
        runnerId="bench",
        nodeId="bench",
        instanceId="bench",
        modelId="bench",
        deviceRank=0,
        worldSize=1,
    )
    config = RunnerConfig(runner=ref, assignment=rank, assignments=(rank,), model_path=str(model))
    group = mx.distributed.init()
    shard = load_shard(model, group, (rank,), rank)
    pace = Pace()
    paced = load_shard(model, group, (rank,), rank, pace)
    context = multiprocessing.get_context("spawn")
    telemetry, control = context.Queue(1024), context.Queue()
    agent = context.Process(target=_drain, args=(telemetry, control), daemon=True)
    agent.start()
    task = TaskCreated(
        at=now(),
        taskId="t",
        instanceId="bench",
        taskKind=TaskKind.TEXT_GENERATION,
        commandId="c",
        request=GenerationRequest(prompt="Which rank is stuck?", maxTokens=args.tokens),
    )
    variants = ("off", "on", "pace")
    rates: dict[str, list[float]] = {v: [] for v in variants}
    for round_ in range(args.rounds + 1):
        for variant in variants if round_ % 2 else variants[::-1]:
            recorder = Recorder(
                telemetry=telemetry,
                control=control,
                memory=snapshot,
                pace=pace if variant == "pace" else None,
                enabled=variant != "off",
            )
            generation = Generation(
                config=config,
                shard=paced if variant == "pace" else shard,
                group=group,
                recorder=recorder,
                watchdog=Watchdog(recorder),
                cancelled=lambda _: False,
            )
            started = time.perf_counter()
            generation.run(task)
            elapsed = time.perf_counter() - started
            if round_:  # round 0 warms caches for all
                rates[variant].append(args.tokens / elapsed)
    off, on, timed = (statistics.median(rates[v]) for v in variants)
    agent.terminate()
    for channel in (telemetry, control):  # what the drain no longer reads is not waited for
        channel.cancel_join_thread()
    print(
        f"model: {args.layers} layers, hidden {args.hidden}; {args.tokens} tokens x "
        f"{args.rounds} rounds each, alternating"
    )
    print(f"recorder off:    {off:8.1f} tokens/s (median)")
    print(f"recorder on:     {on:8.1f} tokens/s (median)")
    print(f"on, with pace:   {timed:8.1f} tokens/s (median; {pace.take().steps} steps sampled)")
    print(f"recorder on/off: {on / off:.4f}  (cost {100 * (1 - on / off):+.2f}%)")
    print(f"pace/on:         {timed / on:.4f}  (cost {100 * (1 - timed / on):+.2f}%)")


if __name__ == "__main__":
    main()
