"""What `rankscope record` costs a program, recorded vs plain, interleaved in one run.

Programs with two ranks (a core each), each run plain and recorded (into a real `rankscope
up`) in alternating order, round after round:
- a data-parallel loop under `mlx.launch` (ring, loopback) whose steps take ~10 ms of
  compute and one `all_sum` of the gradients: mean step time (target: recorded within 1%
  of plain);
- the same loop, its two ranks started without a launcher (each with the ring's hostfile
  and its rank, as `mlx.launch` starts them) and each recorded on its own: `mlx.launch`
  (0.32) relays each rank's output in a thread that selects on the rank's stdin pipe for
  writing, always writable, so it keeps a core busy for the whole job; on two cores that
  core is the ranks' and the first row measures the launcher's contention as much as the
  recording;
- `mlx_lm.benchmark` on a generated model: generation tokens/s (target: no measurable
  change);
- with `--torch-python` (a Python with torch: the tests make one, see tests/torch_env.py),
  a DDP training loop under `torchrun` (gloo) whose steps take ~10 ms: mean step time
  (target: within 1%).
Printed per program: the median of the paired per-round ratios with their spread.

    .venv/bin/python bench/record_overhead.py [--rounds 5] [--steps 300] [--tokens 64]
        [--torch-python ~/.cache/rankscope-tests/torch-2.13.0-py311/bin/python]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from common import free_port

from rankscope.shared.tiny_model import TinyModelSpec, write_tiny_model

LAUNCH = str(Path(sys.executable).parent / "mlx.launch")

STEPS = """
import sys, time
import mlx.core as mx
group = mx.distributed.init()
size, steps = int(sys.argv[1]), int(sys.argv[2])
weights = mx.random.normal((size, size), key=mx.random.key(group.rank()))
batch = mx.random.normal((size, size), key=mx.random.key(7))
times = []
for step in range(steps):
    started = time.perf_counter()
    gradient = (batch @ weights) @ weights.T / size
    gradient = mx.distributed.all_sum(gradient) / group.size()
    weights = weights - 1e-4 * gradient
    mx.eval(weights)
    times.append(time.perf_counter() - started)
if group.rank() == 0:
    kept = sorted(times[steps // 10:])
    print(f"step_ms {1000 * sum(kept) / len(kept):.4f}", flush=True)
"""


DDP = """
import sys, time
import atexit, os
import torch, torch.distributed as dist
atexit.register(os._exit, 0)  # the last to run: torch 2.13's teardown aborts 1 exit in 4
dist.init_process_group("gloo")
width, steps = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
nn = torch.nn
layers = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
model = torch.nn.parallel.DistributedDataParallel(layers)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
batch = torch.randn(64, width)
times = []
for step in range(steps):
    started = time.perf_counter()
    loss = model(batch).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    times.append(time.perf_counter() - started)
if dist.get_rank() == 0:
    kept = sorted(times[steps // 10:])
    print(f"step_ms {1000 * sum(kept) / len(kept):.4f}", flush=True)
dist.destroy_process_group()
"""


@contextlib.contextmanager
def _stack(data: Path) -> Iterator[str]:
    """`rankscope up` without a demo until the block ends; its NATS URL."""
    nats = free_port()
    ports = ["--nats-port", str(nats), "--gateway-port", str(free_port())]
    command = [sys.executable, "-m", "rankscope.services.cli", "up", *ports]
    command += ["--grpc-port", str(free_port()), "--data-dir", str(data)]
    quiet = {**os.environ, "RANKSCOPE_LOG_LEVEL": "warning"}
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=quiet) as up:
        assert up.stdout is not None
        next(line for line in up.stdout if line.startswith("Ctrl-C"))
        try:
            yield f"nats://127.0.0.1:{nats}"
        finally:
            up.send_signal(signal.SIGINT)


def _launch(*program: str) -> list[str]:
    """`program` on two ring ranks, each pinned to a core of its own (as on machines of
    their own; the watchers of a recorded run share their rank's core)."""
    ring = ["--backend", "ring", "--hosts", "127.0.0.1", "-n", "2", "-p", str(free_port())]
    pinned = ["sh", "-c", 'exec taskset -c "$MLX_RANK" "$0" "$@"', sys.executable]
    return [LAUNCH, *ring, "--", *pinned, *program]


def _torchrun(python: str, *program: str) -> list[str]:
    """`program` on two torchrun ranks, each pinned to a core of its own."""
    torchrun = str(Path(python).parent / "torchrun")
    where = ["--nnodes", "1", "--nproc-per-node", "2", "--master-port", str(free_port())]
    pinned = ["sh", "-c", 'exec taskset -c "$LOCAL_RANK" "$0" "$@"', python]
    return [torchrun, *where, "--no-python", *pinned, *program]


def _by_hand(hostfile: Path, *program: str) -> list[tuple[list[str], dict[str, str]]]:
    """`program` on two ring ranks started without a launcher, each pinned to a core of
    its own: each rank's command and environment (the ring's hostfile and its rank)."""
    hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(2)]))
    return [
        (
            ["taskset", "-c", str(rank), sys.executable, *program],
            {"MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(rank)},
        )
        for rank in range(2)
    ]


def _recorded(command: list[str], nats: str | None) -> tuple[list[str], dict[str, str]]:
    """`command` as run: under `rankscope record` into `nats`, or plain (None)."""
    if nats is None:
        return command, dict(os.environ)
    record = [sys.executable, "-m", "rankscope.services.cli", "record", "--"]
    return [*record, *command], {**os.environ, "RANKSCOPE_NATS_URL": nats}


def _run(command: list[str], nats: str | None) -> str:
    command, env = _recorded(command, nats)
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"{command} failed: {done.stderr[-2000:]}")
    return done.stdout


def _run_ranks(ranks: list[tuple[list[str], dict[str, str]]], nats: str | None) -> str:
    """Each rank's command run at once, each recorded on its own or plain; rank 0's
    output."""
    running = []
    for command, env in ranks:
        command, environment = _recorded(command, nats)
        running.append(
            subprocess.Popen(command, env={**environment, **env}, stdout=subprocess.PIPE, text=True)
        )
    outputs = [process.communicate(timeout=600)[0] for process in running]
    if any(process.returncode for process in running):
        raise SystemExit(f"ranks failed: {[process.returncode for process in running]}")
    return outputs[0]


def _paired(
    name: str, rounds: int, measure: Callable[[str | None], float], nats: str, higher: bool
) -> None:
    ratios, plain_all, recorded_all = [], [], []
    for round_ in range(rounds):
        order = [None, nats] if round_ % 2 == 0 else [nats, None]
        found = {which: measure(which) for which in order}
        plain, recorded = found[None], found[nats]
        plain_all.append(plain)
        recorded_all.append(recorded)
        ratios.append(recorded / plain if higher else plain / recorded)
    print(
        f"{name}: plain median {statistics.median(plain_all):.3f}, recorded median "
        f"{statistics.median(recorded_all):.3f}; speed recorded/plain: median "
        f"{statistics.median(ratios):.4f} (rounds {min(ratios):.4f}-{max(ratios):.4f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--size", type=int, default=160, help="~10 ms a step on 2 shared cores")
    parser.add_argument("--tokens", type=int, default=64, help="mlx_lm.benchmark's -g")
    parser.add_argument("--torch-python", help="a Python with torch: adds the DDP row")
    parser.add_argument("--width", type=int, default=700, help="~10 ms a DDP step on 2 cores")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        script = work / "steps.py"
        script.write_text(STEPS)
        ddp = work / "ddp.py"
        ddp.write_text(DDP)
        model = write_tiny_model(work / "model", TinyModelSpec(layers=4, hidden=256))
        with _stack(work / ".rankscope") as nats:

            def step_ms(which: str | None) -> float:
                out = _run(_launch(str(script), str(args.size), str(args.steps)), which)
                return float(re.search(r"step_ms (\S+)", out).group(1))  # type: ignore[union-attr]

            def by_hand_step_ms(which: str | None) -> float:
                ranks = _by_hand(work / "hosts.json", str(script), str(args.size), str(args.steps))
                out = _run_ranks(ranks, which)
                return float(re.search(r"step_ms (\S+)", out).group(1))  # type: ignore[union-attr]

            def tokens_per_s(which: str | None) -> float:
                benchmark = ["-m", "mlx_lm", "benchmark", "--model", str(model)]
                tokens = str(args.tokens)
                out = _run(_launch(*benchmark, "-p", "64", "-g", tokens, "-n", "2"), which)
                return float(re.search(r"Averages:.*generation_tps=([0-9.]+)", out).group(1))  # type: ignore[union-attr]

            def ddp_step_ms(which: str | None) -> float:
                command = _torchrun(args.torch_python, str(ddp), str(args.width), str(args.steps))
                return float(re.search(r"step_ms (\S+)", _run(command, which)).group(1))  # type: ignore[union-attr]

            print(f"2 ranks a core each, {args.rounds} rounds, plain and recorded interleaved")
            if args.torch_python:
                _paired("torch DDP step (ms)", args.rounds, ddp_step_ms, nats, higher=False)
            _paired("data-parallel step (ms)", args.rounds, step_ms, nats, higher=False)
            _paired(
                "data-parallel step, no launcher (ms)",
                args.rounds,
                by_hand_step_ms,
                nats,
                higher=False,
            )
            _paired(
                "mlx_lm.benchmark generation tokens/s", args.rounds, tokens_per_s, nats, higher=True
            )


if __name__ == "__main__":
    main()
