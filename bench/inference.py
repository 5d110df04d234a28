"""Inference through the stack next to plain mlx_lm, in one run, on one model.

1. Decode tokens/s: plain `mlx_lm` in one process, then a 2-rank instance run by two
   `rankscope agent` processes over a real NATS and an mlx ring (tokens counted from the
   output chunks a client receives). Target: stack >= 0.9x plain: the median of each
   round's stack/plain ratio, with the lowest and highest. Between them, the same split
   without agents, recorder, watchdog or NATS (the runner's own ring joining and shard
   loading, mlx-lm's loop): what the ring and the split cost by themselves. Below, the CPU
   each process used while the stack decoded (runners, agents, the client, NATS).
2. A 1-token chat: time from submitting the task to its last chunk, next to plain
   prompt-to-first-token; p50 and p99 of the difference. Target: added p50 <= 10 ms.
3. Idle: CPU of each runner process over a quiet window. Target: <= 2% each.

1 and 2 are measured twice, interleaved: with every process free to use every core, and
with each rank's runner and its agent on a core of their own and plain mlx_lm on one
core, as ranks on machines of their own would be, each with the cores plain mlx_lm has
(a rank waiting on its peer spins a core in mlx's ring backend: sharing cores, it takes
them from the rank that computes). The client and NATS, elsewhere in a deployment, use
both cores.

    .venv/bin/python bench/inference.py [--layers 8] [--hidden 512] [--tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection
from multiprocessing.queues import Queue
from pathlib import Path

import mlx.core as mx
import mlx_lm
from common import free_port
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from rankscope.services.agent.runner.shard import connect_group, load_shard, ring_hosts
from rankscope.shared.connection import connect
from rankscope.shared.jetstream import Layout
from rankscope.shared.nats_server import EmbeddedNats
from rankscope.shared.provision import ensure
from rankscope.shared.settings import Settings, to_environ
from rankscope.shared.timestamps import now
from rankscope.shared.tiny_model import TinyModelSpec, write_tiny_model
from rankscope.shared.wire import (
    GenerationRequest,
    InstanceCreated,
    NodeDiagnostics,
    RunnerAssignment,
    RunnerStatusKind,
    TaskCreated,
    TaskKind,
    TokenChunk,
    decode,
    encode,
)

REPO = Path(__file__).parent.parent
PROMPT = "Which node holds layer seven? How much memory does it hold?"
NODES = ("node-a", "node-b")
CHATS = 30
ROUNDS = 7
CORES = sorted(os.sched_getaffinity(0))
SETTINGS = {
    "shared": "every process on every core",
    **(
        {"own": "a core per rank and its agent, plain mlx_lm on one core"}
        if len(CORES) >= len(NODES)
        else {}
    ),
}
"""Where the ranks and plain mlx_lm run: "own" gives each a core of its own."""


class _Plain:
    """Plain mlx_lm in this process, on the same model."""

    def __init__(self, model_dir: Path) -> None:
        self.model, tokenizer = mlx_lm.load(str(model_dir))[:2]
        self.prompt = mx.array(tokenizer.encode(PROMPT))

    def generate(self, limit: int) -> tuple[float, float, int]:
        """(prompt-to-first-token s, first-to-last-token s, tokens) of one generation."""
        started, first, count = time.perf_counter(), 0.0, 0
        cache = make_prompt_cache(self.model)
        for _ in generate_step(self.prompt, self.model, max_tokens=limit, prompt_cache=cache):
            count += 1
            if count == 1:
                first = time.perf_counter()
        return first - started, time.perf_counter() - first, count


class _Stack:
    def __init__(self, nc: Client, layout: Layout) -> None:
        self.nc = nc
        self.layout = layout
        self.chunks: asyncio.Queue[tuple[float, TokenChunk]] = asyncio.Queue()

    async def on_chunk(self, msg: Msg) -> None:
        await self.chunks.put((time.perf_counter(), decode(msg.data, TokenChunk)))

    async def generate(self, command: str, tokens: int) -> tuple[float, float, int]:
        """(submit-to-first-chunk s, first-to-last-chunk s, tokens) of one generation."""
        task = TaskCreated(
            at=now(),
            taskId=f"task-{command}",
            instanceId="i",
            taskKind=TaskKind.TEXT_GENERATION,
            commandId=command,
            request=GenerationRequest(prompt=PROMPT, maxTokens=tokens),
        )
        started = time.perf_counter()
        await self.nc.jetstream().publish(self.layout.subjects.tasks("i"), encode(task))
        first = None
        while True:
            at, chunk = await asyncio.wait_for(self.chunks.get(), 120)
            if chunk.commandId != command:
                continue
            first = first or at
            if chunk.finishReason:
                return first - started, at - first, chunk.completionTokens or 0


def _pin(pid: int, cores: Collection[int]) -> None:
    """Run every thread of process `pid` on `cores` only (threads it starts later inherit
    the cores of the thread that starts them)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(int(task.name), cores)


def _plain_on(own: bool) -> None:
    _pin(os.getpid(), CORES[:1] if own else CORES)


def _stack_on(machines: list[list[int]], own: bool) -> None:
    """Pin each machine's processes (its agent and runner) to a core of its own, or all to
    every core; this process (the client) and NATS use every core."""
    _pin(os.getpid(), CORES)
    for core, pids in zip(CORES, machines, strict=False):
        for pid in pids:
            _pin(pid, [core] if own else CORES)


def _agent(settings: Settings) -> subprocess.Popen[bytes]:
    """`rankscope agent` for one node, as an operator runs it (its log in its data dir)."""
    settings.data_dir.mkdir(parents=True)
    with (settings.data_dir / "agent.log").open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "rankscope.services.cli", "agent"],
            cwd=REPO,
            env={**os.environ, **to_environ(settings)},
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks


def _assignments(layers: int) -> list[RunnerAssignment]:
    """Half the layers on each node's rank, each rank listening on a port of its own."""
    half = layers // 2
    return [
        RunnerAssignment(
            runnerId=f"i-a0-r{rank}",
            nodeId=node,
            deviceRank=rank,
            worldSize=2,
            startLayer=start,
            endLayer=end,
            nLayers=layers,
            host="127.0.0.1",
            port=free_port(),
        )
        for rank, (node, start, end) in enumerate(
            zip(NODES, (0, half), (half, layers), strict=True)
        )
    ]


def _bare_rank(
    model_dir: Path,
    assignments: list[RunnerAssignment],
    rank: int,
    commands: Queue[int | None],
    results: Queue[tuple[float, int]],
) -> None:
    """One rank of the bare split: the runner's own ring joining and shard loading, then
    mlx-lm's generation loop for each token count it is given."""
    group = connect_group(assignments[rank], ring_hosts(assignments))
    shard = load_shard(model_dir, group, assignments, assignments[rank])
    prompt = mx.array(shard.tokenizer.encode(PROMPT))
    while (limit := commands.get()) is not None:
        first, count = 0.0, 0
        cache = make_prompt_cache(shard.model)
        for _ in generate_step(prompt, shard.model, max_tokens=limit, prompt_cache=cache):
            count += 1
            if count == 1:
                first = time.perf_counter()
        results.put((time.perf_counter() - first, count))


class _Bare:
    """The same split without agents, recorder, watchdog or NATS: what the ring and the
    split cost by themselves."""

    def __init__(self, model_dir: Path, layers: int) -> None:
        context = multiprocessing.get_context("spawn")
        assignments = _assignments(layers)
        self.commands: list[Queue[int | None]] = [context.Queue() for _ in assignments]
        self.results: Queue[tuple[float, int]] = context.Queue()
        self.ranks = [
            context.Process(
                target=_bare_rank,
                args=(model_dir, assignments, rank, commands, self.results),
                daemon=True,
            )
            for rank, commands in enumerate(self.commands)
        ]
        for process in self.ranks:
            process.start()

    def generate(self, limit: int) -> tuple[float, int]:
        """(first-to-last-token s, tokens) of one generation, the slower rank's."""
        for commands in self.commands:
            commands.put(limit)
        return max(self.results.get(timeout=120) for _ in self.commands)

    def close(self) -> None:
        for commands in self.commands:
            commands.put(None)
        for process in self.ranks:
            process.join()


async def _stack(model_dir: Path, layers: int, tokens: int, idle_s: float) -> dict[str, object]:
    root = Path(tempfile.mkdtemp(prefix="rankscope-bench-"))
    server = EmbeddedNats(store_dir=root / "nats", port=free_port()).start()
    layout = Layout()
    nc = await connect(Settings(nats_url=server.url), "bench")
    await ensure(nc.jetstream(), layout)
    agents = [_agent(Settings(nats_url=server.url, node_id=n, data_dir=root / n)) for n in NODES]
    assignments = _assignments(layers)
    stack = _Stack(nc, layout)
    await nc.subscribe(layout.subjects.output_of_node(NODES[-1]), cb=stack.on_chunk)
    placed = InstanceCreated(
        at=now(),
        instanceId="i",
        runnerSpecId="bench",
        modelId="bench",
        modelPath=str(model_dir),
        assignments=assignments,
    )
    await nc.jetstream().publish(layout.subjects.placement("i"), encode(placed))
    try:
        runners = await _ready_pids(nc, layout)
        machines = [[a.pid, r] for a, r in zip(agents, runners, strict=True)]
        plain = _Plain(model_dir)
        plain.generate(4)
        bare = _Bare(model_dir, layers)
        bare.generate(4)
        await stack.generate("warm", 4)
        tps: dict[tuple[str, str], list[float]] = {}
        firsts: dict[tuple[str, str], list[float]] = {}
        # while the stack decodes, CPU (cores) of: each runner, each agent, this process
        # (the client), NATS
        watched = [*runners, *(a.pid for a in agents), os.getpid(), server.pid or 0]
        busy: dict[str, list[list[float]]] = {}
        for round_ in range(ROUNDS):  # interleaved, so drifts of the machine hit all alike
            for setting in SETTINGS:
                own = setting == "own"
                _plain_on(own)
                _, seconds, count = plain.generate(tokens)
                tps.setdefault(("plain", setting), []).append((count - 1) / seconds)
                _stack_on([[p.pid or 0] for p in bare.ranks], own)
                seconds, count = bare.generate(tokens)
                tps.setdefault(("bare", setting), []).append((count - 1) / seconds)
                _stack_on(machines, own)
                before = [_cpu_seconds(p) for p in watched]
                started = time.perf_counter()
                _, seconds, count = await stack.generate(f"decode-{setting}-{round_}", tokens)
                elapsed = time.perf_counter() - started
                tps.setdefault(("stack", setting), []).append((count - 1) / seconds)
                busy.setdefault(setting, []).append(
                    [(_cpu_seconds(p) - b) / elapsed for p, b in zip(watched, before, strict=True)]
                )
        bare.close()
        for i in range(CHATS):
            for setting in SETTINGS:
                own = setting == "own"
                _plain_on(own)
                firsts.setdefault(("plain", setting), []).append(plain.generate(1)[0])
                _stack_on(machines, own)
                chat = await stack.generate(f"chat-{setting}-{i}", 1)
                firsts.setdefault(("stack", setting), []).append(chat[0])
        _stack_on(machines, False)
        await asyncio.sleep(1)
        quiet = [*runners, *(a.pid for a in agents)]
        before = [_cpu_seconds(p) for p in quiet]
        await asyncio.sleep(idle_s)
        idle = [(_cpu_seconds(p) - b) / idle_s for p, b in zip(quiet, before, strict=True)]
        return {
            "tps": tps,
            "firsts": firsts,
            "idle": idle,
            "busy": {
                setting: [statistics.median(column) for column in zip(*rows, strict=True)]
                for setting, rows in busy.items()
            },
        }
    finally:
        for agent in agents:
            agent.terminate()
        for agent in agents:
            agent.wait()
        await nc.close()
        server.stop()


async def _ready_pids(nc: Client, layout: Layout) -> list[int]:
    for _ in range(600):
        pids = []
        for node in NODES:
            with contextlib.suppress(NatsError, TimeoutError):  # an agent still starting
                reply = await nc.request(layout.subjects.node_diagnostics(node), b"", 5)
                pids += [
                    r.pid
                    for r in decode(reply.data, NodeDiagnostics).runners
                    if r.statusKind == RunnerStatusKind.READY and r.pid is not None
                ]
        if len(pids) == len(NODES):
            return pids
        await asyncio.sleep(0.2)
    raise SystemExit("the runners did not get ready in 2 minutes")


def _ms(seconds: list[float], q: float) -> float:
    return statistics.quantiles(seconds, n=100)[int(q) - 1] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--idle", type=float, default=10.0, help="idle window, seconds")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(
            Path(tmp) / "model", TinyModelSpec(layers=args.layers, hidden=args.hidden)
        )
        got = asyncio.run(_stack(model, args.layers, args.tokens, args.idle))
    tps: dict[tuple[str, str], list[float]] = got["tps"]  # type: ignore[assignment]
    firsts: dict[tuple[str, str], list[float]] = got["firsts"]  # type: ignore[assignment]
    print(f"model: {args.layers} layers, hidden {args.hidden}; 2 ranks on one machine; "
          f"medians of {ROUNDS} interleaved rounds")  # fmt: skip
    for setting, heading in SETTINGS.items():
        plain = tps[("plain", setting)]
        plain_firsts, stack_firsts = firsts[("plain", setting)], firsts[("stack", setting)]
        added = [s - p for s, p in zip(stack_firsts, plain_firsts, strict=True)]
        print(f"{heading}:")
        print(f"  decode tokens/s, plain mlx_lm      {statistics.median(plain):6.1f}")
        for kind, what in (("bare", "split, no agents"), ("stack", "the stack")):
            split = tps[(kind, setting)]
            ratios = [s / p for s, p in zip(split, plain, strict=True)]  # a round's pair each
            print(f"    {what:<18} {statistics.median(split):6.1f}   ratio "
                  f"{statistics.median(ratios):.2f} (rounds {min(ratios):.2f}-{max(ratios):.2f})"
                  + ("  (target >= 0.9)" if kind == "stack" else ""))  # fmt: skip
        print(f"  time to 1st token  plain p50 {_ms(plain_firsts, 50):6.1f} ms   "
              f"stack p50 {_ms(stack_firsts, 50):6.1f} ms")  # fmt: skip
        print(f"  added on a 1-token chat, paired  p50 {_ms(added, 50):6.1f} ms   "
              f"p99 {_ms(added, 99):6.1f} ms  (target p50 <= 10 ms)")  # fmt: skip
    idle: list[float] = got["idle"]  # type: ignore[assignment]
    runners, agents = idle[: len(NODES)], idle[len(NODES) :]
    print("idle CPU per runner  " + "  ".join(f"{c:.1%}" for c in runners)
          + "  (target <= 2%), per agent " + "  ".join(f"{c:.1%}" for c in agents))  # fmt: skip
    busy: dict[str, list[float]] = got["busy"]  # type: ignore[assignment]
    for setting, cpu in busy.items():
        n = len(NODES)
        runners, agents, (client, nats) = cpu[:n], cpu[n : 2 * n], cpu[2 * n :]
        print(f"CPU while the stack decodes, {setting}: runners "
              + "  ".join(f"{c:.0%}" for c in runners) + ", agents "
              + "  ".join(f"{c:.1%}" for c in agents)
              + f", client {client:.1%}, NATS {nats:.1%}")  # fmt: skip


if __name__ == "__main__":
    main()
