"""How fast and how right the diagnosis is: each fault injected many times, at random
moments, into the demo's 2-rank pipeline under a steady chat load (`rankscope up --demo`,
the shipped processes), the diagnosis sampled twice a second.

Per fault: time from the injection to the first finding naming the right rank (p50, p90,
max), the share of samples naming the right culprit while the fault lasts (after the
first), findings that named a wrong rank, and the time from the fault's end to no
finding. Faults:

- `sigstop`: a rank's process stopped (expected: `stalled_rank` naming it);
- `sigkill`: a rank's process killed (`dead_rank`; its agent starts it again);
- `slow2`, `slow1.3`: a rank made 2x and 1.3x slower by a stop/continue duty cycle
  (`slow_rank`);
- `hog2`, `hog1.3`: a rank's core shared with a busy process niced to leave it 1/2 or
  3/4 of it (the two ranks kept on a core each while it lasts), as a noisy neighbour or a
  throttled core slows it (`slow_rank`; Linux);
- `pfirst1.3`: the demo's instance placed anew (its spec deleted and created again: no
  finding), its rank's core shared so from the rank's start, timed from its ranks ready
  (`slow_rank`; Linux);
- `work2`, `work1.3`: in a recorded 4-rank data-parallel `mlx.launch` job of its own (the
  one `tests/test_slow_rank.py` records, two ranks to a core), a rank given twice and 4/3
  of its work a step, as a slower device takes longer (`slow_rank`);
- `first1.3`: such a job started with a rank given 4/3 of its work from its first step,
  timed from its four ranks showing (`slow_rank`), a new job each time;
- `tfirst1.3`, `tfirst1.5`, `tfirst2`: the same for a recorded 4-rank torch DDP job under
  `torchrun` (gloo; the one `tests/test_record_torch.py` records, two ranks to a core), its
  rank given 4/3, 1.5x or twice its own work (twelve 256-wide matrix products, 60% of its
  step: 1.5x of it makes the whole step 1.3x) from its first step; needs `--torch-python`;
- `nats`: the NATS server paused (SIGSTOP; `nats_unreachable`, naming no rank);
- `linkcut`: the network link of node-b cut (in a deployment of its own, every service its
  own process and node-b behind a veth pair in a network namespace, as
  `tests/reliability/test_partition.py` builds it; default heartbeat TTL): `dead_rank`
  naming node-b's rank. Needs root and `ip netns`.

    .venv/bin/python bench/detection.py [--injections 10] [--faults sigstop:50,sigkill,...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402

from rankscope.services.stack.demo import spec  # noqa: E402
from rankscope.shared.nats_server import EmbeddedNats  # noqa: E402
from tests.reliability.deployment import Deployment, deployed  # noqa: E402
from tests.reliability.netns import Link, behind  # noqa: E402
from tests.slowdown import apart, crowded, slowed  # noqa: E402
from tests.stack_up import free_port, free_ports, running_up  # noqa: E402
from tests.test_record_torch import STRAGGLER  # noqa: E402
from tests.test_slow_rank import Gateway, chatting, more_work, recorded  # noqa: E402

EXPECTED = {
    "sigstop": "stalled_rank",
    "sigkill": "dead_rank",
    "slow2": "slow_rank",
    "slow1.3": "slow_rank",
    "hog2": "slow_rank",
    "hog1.3": "slow_rank",
    "pfirst1.3": "slow_rank",
    "work2": "slow_rank",
    "work1.3": "slow_rank",
    "first1.3": "slow_rank",
    "tfirst1.3": "slow_rank",
    "tfirst1.5": "slow_rank",
    "tfirst2": "slow_rank",
    "nats": "nats_unreachable",
    "linkcut": "dead_rank",
}
DEMO_FAULTS = ("sigstop", "sigkill", "nats", "slow2", "slow1.3", "hog2", "hog1.3", "pfirst1.3")
"""The faults injected into the demo's pipeline."""
HOLD_S = {
    "sigstop": 15.0,
    "slow2": 30.0,
    "slow1.3": 45.0,
    "hog2": 30.0,
    "hog1.3": 45.0,
    "pfirst1.3": 30.0,
    "work2": 30.0,
    "work1.3": 45.0,
    "first1.3": 30.0,
    "tfirst1.3": 30.0,
    "tfirst1.5": 30.0,
    "tfirst2": 30.0,
    "nats": 10.0,
}
"""How long each fault lasts; a kill or a cut link, until it is named (the rank is then
started again, or the job placed again once the node is back)."""
NAMED_WITHIN_S = {
    "linkcut": 45.0,
    "work1.3": 30.0,
    "pfirst1.3": 30.0,
    "first1.3": 30.0,
    "tfirst1.3": 30.0,
    "tfirst1.5": 30.0,
    "tfirst2": 30.0,
}
"""Longest wait for the first finding, if not 20 s (a lost node is known after up to two
heartbeat TTLs)."""
SPACING_S = {"sigkill": 31.0}
"""Least time between two injections, if any: the agent gives a rank up after 3 crashes
in 60 s (a crash loop), which a kill every 20 s would be."""
SETTLE_S = 60.0
"""Longest wait for no finding before the next injection."""
_SERVING = frozenset({"RunnerReady", "RunnerRunning"})
"""A rank's statuses once it serves."""


@dataclass
class Tally:
    """One fault's injections."""

    named: list[float] = field(default_factory=list)
    missed: int = 0
    right: int = 0
    samples: int = 0
    wrong: list[str] = field(default_factory=list)
    why: dict[str, str] = field(default_factory=dict)
    """The first summary of each wrong finding."""
    cleared: list[float] = field(default_factory=list)
    """Per injection named: seconds from the fault's end to no finding."""


def _pid(title: str) -> int:
    for process in psutil.process_iter(["cmdline"]):
        if " ".join(process.info["cmdline"] or []).startswith(title):
            return int(process.pid)
    raise LookupError(title)


def _rank_pid(rank: int) -> int:
    return _pid(f"rankscope runner demo-0 rank {rank} ")


@contextlib.contextmanager
def _fault(kind: str, rank: int, nats_pid: int) -> Iterator[None]:
    pid = _rank_pid(rank)
    if kind.startswith("slow"):
        with slowed(pid, float(kind.removeprefix("slow"))):
            yield
        return
    if kind.startswith("hog"):
        others = apart(pid, _rank_pid(1 - rank), rank)
        with crowded(pid, float(kind.removeprefix("hog")), rank, others):
            yield
        return
    target, stop, go = {
        "sigstop": (pid, signal.SIGSTOP, signal.SIGCONT),
        "sigkill": (pid, signal.SIGKILL, None),
        "nats": (nats_pid, signal.SIGSTOP, signal.SIGCONT),
    }[kind]
    os.kill(target, stop)
    try:
        yield
    finally:
        if go is not None:
            os.kill(target, go)


def _findings(gateway: Gateway) -> list[dict[str, Any]]:
    try:
        return list(gateway.get("/v1/cluster/diagnosis")["findings"])
    except OSError:
        return [{"kind": "gateway unanswered", "culpritRanks": []}]


def _right(kind: str, rank: int) -> Callable[[dict[str, Any]], bool]:
    def check(finding: dict[str, Any]) -> bool:
        if finding["kind"] != EXPECTED[kind]:
            return False
        return kind == "nats" or finding["culpritRanks"] == [rank]

    return check


def inject(
    gateway: Gateway, kind: str, rank: int, fault: AbstractContextManager[None], tally: Tally
) -> None:
    """`fault` (to `rank`) at a random moment of the load, sampled until it ends."""
    right = _right(kind, rank)
    time.sleep(random.uniform(0, 3))  # a random moment of the load: between or inside steps
    begun = time.strftime("%H:%M:%S")
    hold, wait = HOLD_S.get(kind, 0.0), NAMED_WITHIN_S.get(kind, 20.0)
    with fault:
        started = time.monotonic()  # once the fault is in place (a new job: its ranks up)
        first: float | None = None
        while time.monotonic() - started < (max(hold, wait) if first is None else hold):
            found = _findings(gateway)
            for finding in found:
                if right(finding):
                    first = first if first is not None else time.monotonic() - started
                elif finding["kind"] != "gateway unanswered":
                    wrong = f"{finding['kind']} {finding['culpritRanks']}"
                    tally.wrong.append(wrong)
                    tally.why.setdefault(wrong, finding["summary"])
            if first is not None:
                tally.samples += 1
                tally.right += any(right(f) for f in found)
            time.sleep(0.5)
    ended = time.monotonic()
    while _findings(gateway) and time.monotonic() - ended < SETTLE_S:
        time.sleep(0.5)
    if first is None:
        tally.missed += 1
        named = "missed"
    else:
        tally.named.append(first)
        tally.cleared.append(time.monotonic() - ended)
        named = f"named after {first:.1f} s, cleared after {tally.cleared[-1]:.1f} s"
    print(f"  {begun} {kind} rank {rank}: {named}; wrong so far {len(tally.wrong)}", flush=True)


def _quantile(values: list[float], q: float) -> float:
    return (
        statistics.quantiles(values, n=10, method="inclusive")[int(q * 10) - 1]
        if len(values) > 1
        else values[0]
    )


def _on_demo(faults: list[tuple[str, int]], tallies: dict[str, Tally]) -> None:
    """Inject `faults` into one `rankscope up --demo`, chats back to back."""
    data = Path(tempfile.mkdtemp()) / ".rankscope"
    print(f"the demo kept in {data} (bench/straggler_replay.py)", flush=True)
    env = {"RANKSCOPE_LOG_LEVEL": "error"}
    with running_up(data, "--demo", "--ring-port-base", str(free_ports(2)), env=env) as (_, shown):
        gateway = Gateway(shown["web"].split()[0].rstrip("/"), shown["NATS"].split()[0])
        nats_pid = _nats_pid(data)
        gateway.until(lambda: _ready(gateway), 180)
        with chatting(gateway):
            time.sleep(100)  # load until every rank's usual pace is known (`RANKSCOPE_SLOW_LEARN`)
            for kind, count in faults:
                last = -math.inf
                for _ in range(count):
                    _until_ready(gateway)
                    time.sleep(max(0.0, last + SPACING_S.get(kind, 0.0) - time.monotonic()))
                    last = time.monotonic()
                    rank = random.choice((0, 1))
                    fault = (
                        _new_pipeline(gateway, data, rank, float(kind.removeprefix("pfirst")))
                        if kind.startswith("pfirst")
                        else _fault(kind, rank, nats_pid)
                    )
                    inject(gateway, kind, rank, fault, tallies[kind])


@contextlib.contextmanager
def _new_pipeline(gateway: Gateway, data: Path, rank: int, factor: float) -> Iterator[None]:
    """The demo's instance placed anew, its `rank` sharing its core with a busy process
    (`crowded`) from its start, from both ranks ready until the block ends."""
    _send(gateway, "DELETE", "/v1/runners/demo")
    gateway.until(lambda: not _rank_pids(), 60, "the demo's ranks gone")
    _send(gateway, "POST", "/v1/runners", {"runners": [spec(data / "models" / "tiny-qwen2")]})
    pids = gateway.until(_rank_pids, 120, "the demo's ranks started")
    with crowded(pids[rank], factor, rank, apart(pids[rank], pids[1 - rank], rank)):
        gateway.until(lambda: _serving(gateway), 180)
        yield


def _rank_pids() -> list[int] | None:
    """The demo's two ranks' pids, by rank, once both run."""
    try:
        return [_rank_pid(0), _rank_pid(1)]
    except LookupError:
        return None


def _send(gateway: Gateway, method: str, path: str, body: Any = None) -> None:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(gateway.base + path, data, method=method)
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=30) as reply:
        reply.read()


def _on_recorded(
    faults: list[tuple[str, int]], tallies: dict[str, Tally], torch: str | None
) -> None:
    """Inject `faults` into a recorded 4-rank data-parallel job, in a `rankscope up` of its
    own (`torch`: a Python with torch, for the torch jobs)."""
    work = Path(tempfile.mkdtemp())
    print(f"recorded jobs kept in {work / '.rankscope'} (bench/straggler_replay.py)", flush=True)
    env = {"RANKSCOPE_LOG_LEVEL": "error"}
    with running_up(work / ".rankscope", env=env) as (_, shown):
        gateway = Gateway(shown["web"].split()[0].rstrip("/"), shown["NATS"].split()[0])
        for kind, count in faults if torch else ():
            for n in range(count if kind.startswith("tfirst") else 0):
                rank, script = random.randrange(4), work / f"{kind}-{n}.py"
                factor = float(kind.removeprefix("tfirst"))
                job = _torch_job(gateway, f"{kind}-{n}", script, (rank, factor), torch or "")
                inject(gateway, kind, rank, job, tallies[kind])
        for n in range(dict(faults).get("first1.3", 0)):
            rank, script = random.randrange(4), work / f"first-{n}.py"
            inject(gateway, "first1.3", rank, _new_job(gateway, f"first-{n}", script, rank),
                   tallies["first1.3"])  # fmt: skip
        script = work / "train.py"
        with recorded(gateway, "dp-1", script):
            time.sleep(30)  # the job going: ranks compared step by step learn nothing first
            for kind, count in faults:
                for _ in range(count if kind.startswith("work") else 0):
                    gateway.until(lambda: not _findings(gateway), 600)
                    rank = random.randrange(4)
                    factor = float(kind.removeprefix("work"))
                    inject(gateway, kind, rank, more_work(script, rank, factor), tallies[kind])


@contextlib.contextmanager
def _new_job(gateway: Gateway, job: str, script: Path, rank: int) -> Iterator[None]:
    """A recorded job whose `rank` does 4/3 of its work from its first step, from its four
    ranks showing until the block ends."""
    with more_work(script, rank, 4 / 3), recorded(gateway, job, script):
        gateway.until(
            lambda: (
                len(gateway.get(f"/v1/cluster/timeline?instanceId={job}&limit=1")["runners"]) == 4
            ),
            60,
        )
        yield


@contextlib.contextmanager
def _cut(link: Link) -> Iterator[None]:
    link.cut()
    try:
        yield
    finally:
        link.mend()


async def _link_cuts(count: int, tally: Tally) -> None:
    """`count` cuts of node-b's link, each during a generation, in a deployment of its own;
    after each, the node rejoins and the job is placed again before the next."""
    root, port = Path(tempfile.mkdtemp()), free_port()
    with Link() as link:
        server = EmbeddedNats(store_dir=root / "nats", host="0.0.0.0", port=port).start()
        try:
            async with deployed(root, server, behind(link, port)) as deployment:
                gateway = Gateway(str(deployment.http.base_url).rstrip("/"), server.url)
                for n in range(count):
                    ranks = await _quiet(deployment)
                    await deployment.generate(f"cut-{n}", max_tokens=100_000)
                    await asyncio.to_thread(
                        inject, gateway, "linkcut", ranks["node-b"], _cut(link), tally
                    )
        finally:
            server.stop()


async def _quiet(deployment: Deployment) -> dict[str, int]:
    """Once both ranks serve and nothing is found: each node's rank."""

    async def settled() -> dict[str, int] | None:
        found = await deployment.ready()
        if found is None or await deployment.findings():
            return None
        return {r.nodeId: r.deviceRank for r in found.runners if r.processAlive}

    return await deployment.until("both ranks ready, no finding", settled, 300)


@contextlib.contextmanager
def _torch_job(
    gateway: Gateway, job: str, script: Path, slow: tuple[int, float], python: str
) -> Iterator[None]:
    """A recorded torch DDP job of 4 ranks (`STRAGGLER` at `script`) whose rank `slow[0]`
    does `slow[1]` times its work from its first step, from its four ranks showing until
    the block ends."""
    script.write_text(STRAGGLER)
    script.with_name(f"slower-{slow[0]}").write_text(str(slow[1]))
    torchrun = [str(Path(python).parent / "torchrun"), "--nnodes", "1", "--nproc-per-node", "4"]
    command = [*torchrun, "--master-port", str(free_port()), str(script)]
    record = [sys.executable, "-m", "rankscope.services.cli", "record", "--job", job, "--"]
    env = {**os.environ, "RANKSCOPE_NATS_URL": gateway.nats}
    process = subprocess.Popen(
        [*record, *command], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
    )
    try:
        gateway.until(
            lambda: (
                len(gateway.get(f"/v1/cluster/timeline?instanceId={job}&limit=1")["runners"]) == 4
            ),
            90,
        )
        yield
    finally:  # stopped as its user would (Ctrl-C): no incident of its own to count wrong
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=60)
        script.with_name(f"slower-{slow[0]}").unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--injections", type=int, default=10, help="per fault")
    parser.add_argument(
        "--faults", default=",".join(EXPECTED), help="FAULT[:INJECTIONS], comma separated"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--torch-python", help="a Python with torch, for the tfirst* faults")
    args = parser.parse_args()
    random.seed(args.seed)
    faults = [
        (kind, int(count or args.injections))
        for kind, _, count in (f.partition(":") for f in args.faults.split(","))
    ]
    tallies = {kind: Tally() for kind, _ in faults}
    if on_demo := [(k, n) for k, n in faults if k in DEMO_FAULTS]:
        _on_demo(on_demo, tallies)
    if on_recorded := [(k, n) for k, n in faults if k.startswith(("work", "first", "tfirst"))]:
        _on_recorded(on_recorded, tallies, args.torch_python)
    if cuts := dict(faults).get("linkcut"):
        asyncio.run(_link_cuts(cuts, tallies["linkcut"]))
    print("injections at random moments into a 2-rank pipeline under load (work*, first*: into")
    print("a recorded 4-rank data-parallel mlx.launch job; tfirst*: a torchrun DDP job)")
    print(f"{'fault':10} {'runs':>4} {'named p50':>9} {'p90':>6} {'max':>6} {'missed':>6} "
          f"{'right':>7} {'wrong':>5} {'clear p50':>9} {'max':>6}")  # fmt: skip
    for kind, tally in tallies.items():
        named = tally.named or [float("nan")]
        cleared = tally.cleared or [float("nan")]
        share = tally.right / tally.samples if tally.samples else float("nan")
        print(
            f"{kind:10} {len(tally.named) + tally.missed:4d} {statistics.median(named):8.1f}s "
            f"{_quantile(named, 0.9):5.1f}s {max(named):5.1f}s {tally.missed:6d} "
            f"{share:7.1%} {len(tally.wrong):5d} "
            f"{statistics.median(cleared):8.1f}s {max(cleared):5.1f}s"
        )
        for wrong in sorted(set(tally.wrong)):
            print(f"    wrong: {wrong} ({tally.wrong.count(wrong)} samples): {tally.why[wrong]}")


def _until_ready(gateway: Gateway) -> None:
    """Wait until both ranks serve and nothing is found; a finding that outlasts the wait
    is printed (the bench goes on, and its report says what stayed open)."""
    try:
        gateway.until(lambda: _ready(gateway), 180)
    except AssertionError:
        print(f"  not ready after 180 s; open: {_findings(gateway)}", flush=True)
        gateway.until(lambda: _ready(gateway), 600)


def _ready(gateway: Gateway) -> bool:
    return _serving(gateway) and not _findings(gateway)


def _serving(gateway: Gateway) -> bool:
    """Whether both of the demo's placed ranks are ready (or serving); the timeline also
    keeps an instance's ranks of an earlier placement."""
    try:
        placed = gateway.get("/v1/placement/runners")
    except OSError:
        return False
    ranks = [r for r in placed if r.get("instanceId") == "demo-0"]
    return len(ranks) == 2 and all(r["statusKind"] in _SERVING for r in ranks)


def _nats_pid(data: Path) -> int:
    for process in psutil.process_iter(["cmdline"]):
        line = process.info["cmdline"] or []
        if line and line[0].endswith("nats-server") and str(data) in " ".join(line):
            return int(process.pid)
    raise LookupError("nats-server")


if __name__ == "__main__":
    main()
