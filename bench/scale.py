"""A simulated cluster of 10,000 nodes x 8 ranks driven into real aggregators: one, then
the same load into several partitioned aggregators, each figure next to the other.

Every simulated node is an agent's real publish path: one `TelemetryPublisher` (batches,
`Nats-Msg-Id`, acks), a `Heartbeat` in the nodes bucket, and answers to the aggregator's
live-diagnostics probes. Each node runs one 8-rank instance whose ranks move together
through tasks (prompt build, KV lookup, prefill barrier and forward, decode barrier, one
`decode_stream` entry per token, parser, idle), and every rank sends an MLX memory snapshot
every `--memory-every` seconds. The aggregators are
real `rankscope aggregator` processes (`RANKSCOPE_AGGREGATOR_PARTITION` each) behind a real
`rankscope gateway`, which every query goes through.

Measured while the load runs, from this process:
- sustained events/s (flight entries + memory snapshots acknowledged by JetStream) and
  entries/s the aggregators stored;
- end-to-end lag: a probe node records an entry, then asks the gateway's timeline for it
  every 5 ms until it is there (publish batching included);
- query p99: timeline of one instance (limit 1000) and the diagnosis, 10 a second each;
- aggregators' CPU and RSS (VmRSS, peak VmHWM).

    .venv/bin/python bench/scale.py [--nodes 10000] [--ranks 8] [--partitions 4] [--seconds 60]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import heapq
import itertools
import logging
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

import httpx
import nats
from common import free_port
from nats.aio.client import Client
from nats.aio.msg import Msg

from rankscope.shared.heartbeat import Heartbeat
from rankscope.shared.jetstream import Layout
from rankscope.shared.nats_server import EmbeddedNats
from rankscope.shared.partitions import partition_of
from rankscope.shared.provision import ensure
from rankscope.shared.subjects import token as subject_token
from rankscope.shared.subjects import untoken
from rankscope.shared.telemetry import TelemetryPublisher
from rankscope.shared.timestamps import now
from rankscope.shared.wire import (
    ClusterTimeline,
    Diagnosis,
    FlightEntry,
    InstanceCreated,
    Memory,
    MemorySampled,
    MlxMemorySnapshot,
    NodeDiagnostics,
    NodeInfo,
    Phase,
    RunnerAssignment,
    RunnerRef,
    RunnerSupervisorDiagnostics,
    TimelineQuery,
    decode,
    encode,
)

REPO = Path(__file__).parent.parent
GIB = 1 << 30
PROBE_NODE = "probe"


@dataclass(frozen=True, slots=True)
class Load:
    """What every simulated node does."""

    ranks: int
    memory_every: float
    tokens_per_s: float
    idle_s: tuple[float, float]
    tokens: tuple[int, int]


def _refs(node: str, ranks: int) -> list[RunnerRef]:
    return [
        RunnerRef(
            runnerId=f"{node}-r{r}",
            nodeId=node,
            instanceId=f"{node}-job",
            modelId="bench-model",
            deviceRank=r,
            worldSize=ranks,
        )
        for r in range(ranks)
    ]


def _placed(node: str, ranks: int) -> InstanceCreated:
    return InstanceCreated(
        at=now(),
        instanceId=f"{node}-job",
        runnerSpecId="bench",
        modelId="bench-model",
        assignments=[
            RunnerAssignment(
                runnerId=ref.runnerId,
                nodeId=node,
                deviceRank=ref.deviceRank,
                worldSize=ranks,
                startLayer=ref.deviceRank * 10,
                endLayer=ref.deviceRank * 10 + 10,
                nLayers=ranks * 10,
                host="10.0.0.1",
                port=50000 + ref.deviceRank,
            )
            for ref in _refs(node, ranks)
        ],
    )


_STARTUP = [
    (Phase.CREATED, "spawned"),
    (Phase.CONNECT_GROUP, "joined"),
    (Phase.LOAD_MODEL, "loaded"),
    (Phase.WARMUP, "done"),
    (Phase.IDLE, "ready"),
]


class _Node:
    """One simulated agent: its ranks' telemetry through the real publisher."""

    def __init__(self, node_id: str, load: Load, layout: Layout, publisher: TelemetryPublisher):
        self.node_id = node_id
        self.refs = _refs(node_id, load.ranks)
        self._load = load
        self._publisher = publisher
        self._phase = [layout.subjects.runner(node_id, r.instanceId, r.deviceRank, "phase")
                       for r in self.refs]  # fmt: skip
        self._memory = [layout.subjects.runner(node_id, r.instanceId, r.deviceRank, "memory")
                        for r in self.refs]  # fmt: skip
        self._seq = [0] * load.ranks
        self.events = 0

    def _next(self, rank: int) -> int:
        seq, self._seq[rank] = self._seq[rank], self._seq[rank] + 1
        self.events += 1
        return seq

    def record(self, phase: Phase, event: str, task: str | None, **attrs: int) -> None:
        """Every rank records the same transition."""
        at = now()
        for rank, ref in enumerate(self.refs):
            entry = FlightEntry(
                seq=self._next(rank),
                at=at,
                phase=phase,
                event=event,
                attrs={**attrs, "rank": rank},
                taskId=task,
                commandId=task,
            )
            self._publisher.entry(ref, self._phase[rank], entry)

    def sample_memory(self) -> None:
        """One MLX memory snapshot per rank."""
        at = now()
        for rank, ref in enumerate(self.refs):
            snapshot = MlxMemorySnapshot(
                generatedAt=at,
                active=Memory(inBytes=3 * GIB + rank),
                cache=Memory(inBytes=GIB // 2),
                peak=Memory(inBytes=4 * GIB),
                source="mlx.core",
            )
            seq = self._next(rank)
            sample = MemorySampled(runner=ref, seq=seq, snapshot=snapshot)
            self._publisher.telemetry(self._memory[rank], encode(sample), ref.runnerId, seq)

    def script(self, rng: random.Random) -> Iterator[float]:
        """Tasks back to back with idle gaps; yields the seconds until its next step."""
        load = self._load
        for phase, event in _STARTUP:
            self.record(phase, event, None)
        yield rng.uniform(0, load.idle_s[1])  # nodes start at random points of the cycle
        for number in itertools.count(1):
            task = f"{self.node_id}-t{number}"
            self.record(Phase.PROMPT_BUILD, "start", task)
            self.record(Phase.KV_CACHE_LOOKUP, "fresh_cache", task, prompt_tokens=48)
            self.record(Phase.PREFILL_BARRIER, "enter", task)
            yield 0.05
            self.record(Phase.PREFILL_PIPELINE, "done", task, prompt_tokens=48)
            self.record(Phase.DECODE_BARRIER, "enter", task)
            self.record(Phase.DECODE_WAIT_FIRST_TOKEN, "first_token", task)
            for token in range(rng.randint(*load.tokens)):
                yield 1 / load.tokens_per_s
                self.record(Phase.DECODE_STREAM, "token", task, token_index=token, step=token)
            self.record(Phase.PARSER, "finalize", task)
            self.record(Phase.COMPLETION, "done", task)
            self.record(Phase.IDLE, "ready", None)
            yield rng.uniform(*load.idle_s)


def _describe(node_id: str) -> NodeInfo:
    return NodeInfo(
        nodeId=node_id,
        friendlyName=node_id,
        address="10.0.0.1",
        memoryTotalBytes=192 * GIB,
        memoryAvailableBytes=160 * GIB,
        lastHeartbeat=now(),
    )


def _diagnostics(node_id: str, ranks: int) -> NodeDiagnostics:
    """What the node's agent answers a probe: it supervises its instance's ranks."""
    return NodeDiagnostics(
        nodeId=node_id,
        friendlyName=node_id,
        address="10.0.0.1",
        generatedAt=now(),
        runners=[
            RunnerSupervisorDiagnostics(
                runnerId=a.runnerId,
                nodeId=node_id,
                instanceId=f"{node_id}-job",
                modelId="bench-model",
                deviceRank=a.deviceRank,
                worldSize=a.worldSize,
                startLayer=a.startLayer,
                endLayer=a.endLayer,
                nLayers=a.nLayers,
                processAlive=True,
                statusKind="RunnerReady",
            )
            for a in _placed(node_id, ranks).assignments
        ],
    )


async def _be_nodes(
    nc: Client, layout: Layout, names: list[str], ranks: int, stop: asyncio.Event
) -> None:
    """What an agent does for the aggregator besides telemetry: heartbeats (every node once
    per 3 s, a thirtieth of them every 0.1 s) and answers to live-diagnostics probes."""
    mine = set(names)

    async def answer(msg: Msg) -> None:
        node_id = untoken(msg.subject.split(".")[-2])
        if node_id in mine:
            await msg.respond(encode(_diagnostics(node_id, ranks)))

    probes = await nc.subscribe(f"{layout.subjects.prefix}.node.*.diagnostics", cb=answer)
    kv = await nc.jetstream().key_value(layout.nodes_bucket.bucket)
    beats = [Heartbeat(kv=kv, describe=functools.partial(_describe, n), interval=3.0)
             for n in names]  # fmt: skip
    rounds = 30
    while not stop.is_set():
        for share in range(rounds):
            await asyncio.gather(*(b.beat() for b in beats[share::rounds]), return_exceptions=True)
            await asyncio.sleep(3.0 / rounds)
    await probes.unsubscribe()


async def _simulate(
    url: str, names: list[str], load: Load, seconds: float, out: Queue[tuple[int, int]]
) -> None:
    """The nodes `names` for `seconds`: one scheduler drives every node's script and memory
    sampler; the nodes of this process share one publisher (one pump, as one agent's)."""
    layout = Layout()
    nc = await nats.connect(url, pending_size=64 << 20)
    stop, rng = asyncio.Event(), random.Random(names[0])
    publisher = TelemetryPublisher(nc=nc, max_buffered=1_000_000, max_in_flight=1024)
    nodes = {n: _Node(n, load, layout, publisher) for n in names}
    scripts = {n: node.script(rng) for n, node in nodes.items()}

    pumping = asyncio.create_task(publisher.run(stop))
    beating = asyncio.create_task(_be_nodes(nc, layout, names, load.ranks, stop))
    begun = time.monotonic()
    due = [(begun + rng.random() * load.memory_every, n, "memory") for n in names]
    due += [(begun + next(scripts[n]), n, "task") for n in names]
    heapq.heapify(due)
    while (moment := time.monotonic()) < begun + seconds:
        while due[0][0] <= moment:
            at, name, kind = heapq.heappop(due)
            if kind == "memory":
                nodes[name].sample_memory()
                heapq.heappush(due, (at + load.memory_every, name, kind))
            else:
                heapq.heappush(due, (at + next(scripts[name]), name, kind))
        await asyncio.sleep(min(max(due[0][0] - time.monotonic(), 0.0), 0.02))
    stop.set()
    await asyncio.gather(pumping, beating)
    out.put((publisher.published_entries, publisher.dropped_entries))
    await nc.close()


def _worker(
    url: str, names: list[str], load: Load, seconds: float, out: Queue[tuple[int, int]]
) -> None:
    logging.getLogger("rankscope.shared.telemetry").setLevel(logging.ERROR)  # drops are counted
    os.nice(10)  # stands in for agents on other machines: the system under test comes first
    asyncio.run(_simulate(url, names, load, seconds, out))


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(len(ordered) * q), len(ordered) - 1)]


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss(pid: int) -> tuple[int, int]:
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return int(fields["VmRSS"].split()[0]) << 10, int(fields["VmHWM"].split()[0]) << 10


@dataclass(slots=True)
class _Measured:
    lags: list[float]
    queries: dict[str, list[float]]
    stored: int
    findings: dict[str, int]


async def _measure(
    url: str, gateway: str, nodes: int, seconds: float, partitions: int
) -> _Measured:
    """Probe lag and query latency through the gateway while the simulated cluster runs."""
    layout = Layout()
    nc = await nats.connect(url)
    js = nc.jetstream()
    http = httpx.AsyncClient(base_url=gateway, timeout=10)
    publisher = TelemetryPublisher(nc=nc)
    probe = _Node(PROBE_NODE, Load(1, 1.0, 1.0, (0, 0), (0, 0)), layout, publisher)
    await js.publish(layout.subjects.placement(f"{PROBE_NODE}-job"), encode(_placed(PROBE_NODE, 1)))
    stop = asyncio.Event()
    pumping = asyncio.create_task(publisher.run(stop))
    being = asyncio.create_task(_be_nodes(nc, layout, [PROBE_NODE], 1, stop))
    lags: list[float] = []
    queries: dict[str, list[float]] = {"timeline": [], "direct": [], "diagnosis": []}
    rng = random.Random(7)
    kinds: collections.Counter[str] = collections.Counter()

    async def ask(view: str, path: str, **params: object) -> bytes:
        started = time.perf_counter()
        reply = await http.get(path, params=params)
        queries[view].append((time.perf_counter() - started) * 1000)
        reply.raise_for_status()
        return reply.content

    async def lag_probes() -> None:
        for number in range(1_000_000):
            if stop.is_set():
                return
            probe.record(Phase.IDLE, "probe", None, probe=number)  # not working: never stuck
            sent = time.perf_counter()
            while True:
                reply = await http.get(
                    "/v1/cluster/timeline", params={"instanceId": f"{PROBE_NODE}-job", "limit": 1}
                )
                shown = decode(reply.content, ClusterTimeline).timeline
                if shown and shown[-1].attrs.get("probe") == number:
                    break
                await asyncio.sleep(0.005)
            lags.append((time.perf_counter() - sent) * 1000)
            await asyncio.sleep(0.2)

    async def query_load() -> None:
        while not stop.is_set():
            instance = f"node-{rng.randrange(nodes)}-job"
            await ask("timeline", "/v1/cluster/timeline", instanceId=instance, limit=1000)
            # the same, straight from its partition's aggregator: what the gateway adds
            index = partition_of(subject_token(instance), partitions)
            started = time.perf_counter()
            await nc.request(
                layout.subjects.query("timeline", index, partitions),
                encode(TimelineQuery(instanceId=instance, limit=1000)),
                timeout=10,
            )
            queries["direct"].append((time.perf_counter() - started) * 1000)
            findings = decode(await ask("diagnosis", "/v1/cluster/diagnosis"), Diagnosis).findings
            kinds.update(f.kind.value for f in findings)
            await asyncio.sleep(0.1)

    tasks = [asyncio.create_task(lag_probes()), asyncio.create_task(query_load())]
    entries_before = sum(int(h["entries"]) for h in await _health(nc, layout, partitions))
    await asyncio.sleep(seconds)
    entries_after = sum(int(h["entries"]) for h in await _health(nc, layout, partitions))
    stop.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, pumping, being, return_exceptions=True)
    await http.aclose()
    await nc.close()
    return _Measured(lags, queries, entries_after - entries_before, dict(kinds))


async def _health(nc: Client, layout: Layout, partitions: int) -> list[dict[str, Any]]:
    """The health of each partition's aggregator."""
    subjects = layout.subjects
    replies = [
        await nc.request(subjects.query("health", i, partitions), b"", timeout=30)
        for i in range(partitions)
    ]
    return [decode(reply.data, dict[str, Any]) for reply in replies]


async def _settled(url: str, partitions: int) -> list[dict[str, Any]]:
    nc = await nats.connect(url)
    try:
        return await _health(nc, Layout(), partitions)
    finally:
        await nc.close()


async def _place(url: str, names: list[str], ranks: int) -> None:
    nc = await nats.connect(url)
    js = nc.jetstream()
    await ensure(js, Layout())
    layout = Layout()
    for first in range(0, len(names), 1000):
        acks = [
            await js.publish_async(layout.subjects.placement(f"{n}-job"), encode(_placed(n, ranks)))
            for n in names[first : first + 1000]
        ]
        await asyncio.gather(*acks)
    await nc.close()


async def _until_ready(gateway: str) -> None:
    async with httpx.AsyncClient(base_url=gateway) as http:
        for _ in range(1200):
            with contextlib.suppress(httpx.TransportError):
                if (await http.get("/readyz")).status_code == 200:
                    return
            await asyncio.sleep(0.1)
    raise RuntimeError("the gateway never became ready")


@dataclass(slots=True)
class _Run:
    partitions: int
    measured: _Measured
    published: float
    dropped: int
    cpu: float
    rss: list[int]
    gaps: int
    bad: dict[str, int]


def _run(args: argparse.Namespace, load: Load, names: list[str], partitions: int) -> _Run:
    """The whole load into `partitions` aggregators, on a NATS server of its own."""
    with EmbeddedNats(store_dir=Path(tempfile.mkdtemp())) as server:
        asyncio.run(_place(server.url, names, args.ranks))
        port = free_port()
        env = {
            **os.environ,
            "RANKSCOPE_NATS_URL": server.url,
            "RANKSCOPE_LOG_LEVEL": "error",
            "RANKSCOPE_AGGREGATOR_PARTITIONS": str(partitions),
            "RANKSCOPE_GATEWAY_PORT": str(port),
            "RANKSCOPE_DATA_DIR": tempfile.mkdtemp(),
            "RANKSCOPE_ACCESS_LOG": "false",
        }
        aggregators = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "rankscope.services.cli",
                    "aggregator",
                    "--node-id",
                    f"bench-{i}",
                ],
                cwd=REPO,
                env={**env, "RANKSCOPE_AGGREGATOR_PARTITION": str(i)},
            )
            for i in range(partitions)
        ]
        gateway = subprocess.Popen(
            [sys.executable, "-m", "rankscope.services.cli", "gateway"], cwd=REPO, env=env
        )
        url = f"http://127.0.0.1:{port}"
        asyncio.run(_until_ready(url))
        context = multiprocessing.get_context("spawn")
        out = context.Queue()
        total = args.warmup + args.seconds + 2
        workers = [
            context.Process(
                target=_worker, args=(server.url, names[w :: args.workers], load, total, out)
            )
            for w in range(args.workers)
        ]
        for worker in workers:
            worker.start()
        time.sleep(args.warmup)
        before = sum(_cpu_seconds(a.pid) for a in aggregators)
        measured = asyncio.run(_measure(server.url, url, args.nodes, args.seconds, partitions))
        cpu = sum(_cpu_seconds(a.pid) for a in aggregators) - before
        rss = [_rss(a.pid)[1] for a in aggregators]
        totals = [out.get() for _ in workers]
        for worker in workers:
            worker.join()
        time.sleep(2)
        final = asyncio.run(_settled(server.url, partitions))
        for process in [*aggregators, gateway]:
            process.terminate()
            process.wait()
    bad: collections.Counter[str] = collections.Counter()
    for health in final:
        bad.update(health["badMessages"])
    return _Run(
        partitions=partitions,
        measured=measured,
        published=sum(t[0] for t in totals) / total,
        dropped=sum(t[1] for t in totals),
        cpu=cpu / args.seconds,
        rss=rss,
        gaps=sum(len(h["missingSeqs"]) for h in final),
        bad=dict(bad),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--warmup", type=float, default=20.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--memory-every", type=float, default=30.0)
    parser.add_argument("--tokens-per-s", type=float, default=10.0)
    parser.add_argument(
        "--idle", type=float, nargs=2, default=(1200.0, 2800.0), metavar=("MIN", "MAX")
    )
    args = parser.parse_args()
    load = Load(
        ranks=args.ranks,
        memory_every=args.memory_every,
        tokens_per_s=args.tokens_per_s,
        idle_s=args.idle,
        tokens=(16, 64),
    )
    names = [f"node-{i}" for i in range(args.nodes)]
    runs = [_run(args, load, names, p) for p in sorted({1, args.partitions})]
    print(f"{args.nodes:,} nodes x {args.ranks} ranks, {args.seconds:.0f} s measured each")
    rows = {
        "published, events/s acknowledged": lambda r: f"{r.published:,.0f}",
        "stored, flight entries/s": lambda r: f"{r.measured.stored / args.seconds:,.0f}",
        "lag publish -> query, p50 / p99 ms": lambda r: _summary(r.measured.lags),
        "timeline of one instance, p50 / p99 ms": lambda r: _summary(
            r.measured.queries["timeline"]
        ),
        "the same from its aggregator over NATS, ms": lambda r: _summary(
            r.measured.queries["direct"]
        ),
        "diagnosis, p50 / p99 ms": lambda r: _summary(r.measured.queries["diagnosis"]),
        "aggregators' CPU, cores": lambda r: f"{r.cpu:.2f}",
        "largest aggregator peak RSS, MiB": lambda r: f"{max(r.rss) / 2**20:,.0f}",
        "lost: publisher drops / runners with gaps": lambda r: f"{r.dropped} / {r.gaps}",
        "bad messages / findings seen": lambda r: (
            f"{sum(r.bad.values())} / {sum(r.measured.findings.values())}"
        ),
    }
    print(f"{'':44}" + "".join(f"{f'{r.partitions} aggregator(s)':>24}" for r in runs))
    for label, shown in rows.items():
        print(f"{label:44}" + "".join(f"{shown(r):>24}" for r in runs))
    for run in runs:
        print(f"findings seen by kind, {run.partitions} aggregator(s): {run.measured.findings}")
    if len(runs) == 2:
        single, split = runs
        ratio = _percentile(split.measured.queries["timeline"], 0.99) / _percentile(
            single.measured.queries["timeline"], 0.99
        )
        print(f"timeline p99, {split.partitions} partitions / 1: {ratio:.2f}")


def _summary(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.1f} / {_percentile(values, 0.99):.1f}"


if __name__ == "__main__":
    main()
