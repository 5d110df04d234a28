"""End to end: a rank made slower for real under a steady load is named `slow_rank`, never
its peers, and cleared once it is back in line; healthy, the same load names nobody. In
the demo's 2-rank pipeline (`rankscope up --demo`, chats back to back; a rank's core
shared with a busy process: its work per layer compared with its peer's, so alone on the
machine) and in a recorded 4-rank data-parallel `mlx.launch` job (a rank given 4/3 of its
work, as a slower device takes longer, from its first step or mid-run: judged by who the
others wait on, so beside the other tests)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.recorded import LAUNCH, assert_straggler, launched
from tests.slowdown import apart, crowded
from tests.stack_up import free_ports, running_up

pytestmark = [pytest.mark.slow, pytest.mark.mlx, pytest.mark.nats, pytest.mark.timeout(420)]

QUIET_S = 20
"""Load before a slowdown: ranks compared with each other need no usual pace to learn (the
healthy soak, scaled down to one straggler window)."""
NAMED_WITHIN_S = 60
"""How long a test waits for the slow rank to be named: twice the 1.3x target. How soon it
is named is `bench/detection.py`'s to measure, over many injections; one run here is one
sample of it."""
CLEARED_WITHIN_S = 120
"""How long a test waits for the finding to clear once the slowdown ends: twice the 60-s
target, which a rank's pace wobbling for a minute after its slowdown on a loaded 2-core
machine misses now and then; how soon it clears is `bench/detection.py`'s to measure."""

DATA_PARALLEL = """
import os, pathlib, time
import mlx.core as mx
group = mx.distributed.init()
if hasattr(os, "sched_setaffinity"):  # ranks pinned two to a core: the same neighbours always
    os.sched_setaffinity(0, {group.rank() % os.cpu_count()})
weights = mx.random.normal((256, 256), key=mx.random.key(group.rank()))
slower = pathlib.Path(__file__).with_name(f"slower-{group.rank()}")  # its work, times over
while True:
    gradient = weights
    for _ in range(round(6 * (float(slower.read_text() or 1) if slower.exists() else 1))):
        gradient = mx.tanh(gradient @ weights) / 16
    weights = weights - 0.001 * mx.distributed.all_sum(gradient) / group.size()
    mx.eval(weights)
    time.sleep(0.002)  # a data loader's moment between steps
"""
"""A data-parallel step whose work (six 256-wide matrix products, ~10-20 ms on a shared
core) dwarfs what happens between steps; `slower-<rank>` beside the script gives a rank
that many times the work, to the nearest sixth."""


class Gateway:
    """The stack's gateway (`base`), and its NATS for the jobs recorded into it."""

    def __init__(self, base: str, nats: str) -> None:
        self.base, self.nats = base, nats

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.base + path, timeout=30) as reply:
            return json.loads(reply.read())

    def findings(self, instance: str) -> list[dict[str, Any]]:
        return [
            f for f in self.get("/v1/cluster/diagnosis")["findings"] if f["instanceId"] == instance
        ]

    def until(self, check: Callable[[], Any], seconds: float, why: str = "") -> Any:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if found := check():
                return found
            time.sleep(0.5)
        raise AssertionError(f"not reached within {seconds:g}s{why}")

    def paces(self, instance: str, seconds: int) -> list[list[float]]:
        """Each rank's work per step (ms) a second over the last `seconds`."""
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - seconds))
        found = self.get(f"/v1/cluster/pace?instanceId={instance}&since={since}&points={seconds}")
        return [[round(p["workMs"], 2) for p in r["points"]] for r in found["runners"]]

    def quiet_for(self, instance: str, seconds: float) -> None:
        """No finding of `instance` in any sample for `seconds`."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            found = self.findings(instance)
            assert found == [], [f["summary"] for f in found]
            time.sleep(1)

    def named_slow(
        self, instance: str, culprit: int, within: float, then: float
    ) -> tuple[float, dict[str, Any]]:
        """Seconds until `slow_rank` names `culprit` (at most `within`), and the finding,
        after checking for `then` more that every sample names it alone (or, in its first
        seconds, nothing); never a peer, never another kind."""
        started = time.monotonic()
        try:
            (finding,) = self.until(lambda: self.findings(instance), within)
        except AssertionError as missed:  # what each rank's work read meanwhile
            raise AssertionError(f"{missed}; work ms/step: {self.paces(instance, 40)}") from None
        named = time.monotonic() - started
        print(f"named after {named:.1f}s: {finding['summary']}")  # shown when the test fails
        samples = [finding]
        while time.monotonic() - started < named + then:
            samples += self.findings(instance)
            time.sleep(0.5)
        assert {(s["kind"], tuple(s["culpritRanks"])) for s in samples} == {
            ("slow_rank", (culprit,))
        }, samples
        return named, finding


@contextlib.contextmanager
def stack(data: Path, *flags: str) -> Iterator[Gateway]:
    """`rankscope up` with `flags` in `data`, its gateway once it answers (and, with the
    demo, once both its ranks are ready)."""
    env = {"RANKSCOPE_LOG_LEVEL": "warning"}
    with running_up(data, *flags, env=env) as (_, shown):
        found = Gateway(shown["web"].split()[0].rstrip("/"), shown["NATS"].split()[0])

        def ready() -> bool:
            if "--demo" not in flags:
                return True
            ranks = found.get("/v1/cluster/timeline?instanceId=demo-0&limit=1")["runners"]
            return len(ranks) == 2 and all(r["statusKind"] == "RunnerReady" for r in ranks)

        found.until(lambda: _answers(found) and ready(), 120)
        yield found


def _answers(gateway: Gateway) -> bool:
    try:
        gateway.get("/readyz")
    except OSError:
        return False
    return True


@contextlib.contextmanager
def chatting(gateway: Gateway) -> Iterator[None]:
    """Chat completions back to back while the block lasts."""
    done = threading.Event()
    body = json.dumps(
        {
            "model": "demo",
            "messages": [{"role": "user", "content": "who is slow?"}],
            "max_tokens": 200,
        }
    ).encode()

    def chat() -> None:
        while not done.is_set():
            request = urllib.request.Request(
                gateway.base + "/v1/chat/completions", body, {"Content-Type": "application/json"}
            )
            with contextlib.suppress(OSError):
                urllib.request.urlopen(request, timeout=60).read()

    thread = threading.Thread(target=chat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=60)


def _runner_pid(rank: int) -> int:
    for process in psutil.process_iter(["name", "cmdline"]):
        title = " ".join(process.info["cmdline"] or [])
        if title.startswith(f"rankscope runner demo-0 rank {rank} "):
            return int(process.pid)
    raise AssertionError(f"no runner of rank {rank}")


def _idle_machine(within: float = 180.0) -> None:
    """Once the machine's cores are idle: what earlier tests left to end on its own (a
    recorded job's watchers give NATS up over minutes) would crowd a stage as a fault
    does. Fails naming the busiest processes if they stay busy `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if psutil.cpu_percent(interval=2.0) < 15:
            return
    processes = list(psutil.process_iter(["pid", "cmdline"]))
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.cpu_percent(None)
    time.sleep(1.0)
    busy = []
    for process in processes:
        with contextlib.suppress(psutil.Error):
            busy.append((process.cpu_percent(None), " ".join(process.info["cmdline"] or [])))
    raise AssertionError(f"cores still busy after {within:g}s: {sorted(busy)[-5:]}")


@pytest.mark.solo  # other tests on the same cores would make its rank slow too
def test_a_pipeline_stage_crowded_on_its_core_is_named_and_cleared(tmp_path: Path) -> None:
    """Rank 1's core shared with a busy process niced to leave it half (a noisy neighbour,
    a throttled core), the services beside it, its peer alone on the other core. (A stop
    duty cycle lands in a rank's waits as much as its work and is read by the CPU it took
    in them: `bench/detection.py` measures it, row `slow2`.)"""
    _idle_machine()
    ring = ("--ring-port-base", str(free_ports(2)))
    with stack(tmp_path / ".rankscope", "--demo", *ring) as gateway, chatting(gateway):
        gateway.quiet_for("demo-0", QUIET_S)
        slowed, peer = _runner_pid(1), _runner_pid(0)
        with crowded(slowed, 2.0, cpu=1, others=apart(slowed, peer, cpu=1)):
            _, finding = gateway.named_slow("demo-0", culprit=1, within=NAMED_WITHIN_S, then=10)
        culprit = next(e for e in finding["evidence"] if e["deviceRank"] == 1)
        assert culprit["pace"]["workVsPeers"] >= 1.35, finding
        assert culprit["pace"]["layers"] == 2, finding
        assert "work per layer" in finding["summary"], finding
        gateway.until(lambda: not gateway.findings("demo-0"), CLEARED_WITHIN_S)
        history = gateway.get("/v1/cluster/diagnosis/history?instanceId=demo-0")["findings"]
        assert [(f["kind"], f["culpritRanks"], f["open"]) for f in history] == [
            ("slow_rank", [1], False)
        ], [(f["since"], f["clearedAt"], f["summary"]) for f in history]


@contextlib.contextmanager
def recorded(gateway: Gateway, job: str, script: Path) -> Iterator[None]:
    """`DATA_PARALLEL` written to `script` and run on 4 ring ranks under `rankscope record`
    as `job`, into the stack of `gateway`, while the block lasts. Its ranks are killed
    after: `mlx.launch` ends on SIGTERM without its ranks, as it does unrecorded."""
    script.write_text(DATA_PARALLEL)
    hosts = ["--backend", "ring", "--hosts", "127.0.0.1", "-n", "4", "-p", str(free_ports(4))]
    process = launched(
        [sys.executable, "-m", "rankscope.services.cli", "record", "--job", job, "--",
         LAUNCH, *hosts, "--", sys.executable, str(script)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "RANKSCOPE_NATS_URL": gateway.nats},
    )  # fmt: skip
    try:
        yield
    finally:
        for found in psutil.process_iter(["cmdline"]):
            if str(script) in (found.info["cmdline"] or []):
                with contextlib.suppress(psutil.NoSuchProcess):
                    found.kill()
        process.communicate(timeout=60)


@contextlib.contextmanager
def more_work(script: Path, rank: int, factor: float) -> Iterator[None]:
    """Rank `rank` of `DATA_PARALLEL` at `script` computes `factor` times its work a step
    (to the nearest third) while the block lasts."""
    slower = script.with_name(f"slower-{rank}")
    slower.write_text(str(factor))
    try:
        yield
    finally:
        slower.unlink()


def test_a_recorded_rank_slow_from_its_first_step_is_named_with_the_share_lost_to_it(
    tmp_path: Path,
) -> None:
    script = tmp_path / "train.py"
    with (
        stack(tmp_path / ".rankscope") as gateway,
        more_work(script, rank=2, factor=4 / 3),
        recorded(gateway, "dp-0", script),
    ):
        gateway.until(lambda: len(_ranks(gateway, "dp-0")) == 4, 60)
        _, finding = gateway.named_slow("dp-0", culprit=2, within=NAMED_WITHIN_S, then=10)
    assert_straggler(finding, culprit=2)


def test_a_recorded_data_parallel_rank_slowed_is_named_and_cleared(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    with stack(tmp_path / ".rankscope") as gateway, recorded(gateway, "dp-1", script):
        gateway.until(lambda: len(_ranks(gateway, "dp-1")) == 4, 60)
        gateway.quiet_for("dp-1", QUIET_S)
        with more_work(script, rank=1, factor=4 / 3):
            gateway.named_slow("dp-1", culprit=1, within=NAMED_WITHIN_S, then=10)
        gateway.until(lambda: not gateway.findings("dp-1"), CLEARED_WITHIN_S)


def _ranks(gateway: Gateway, instance: str) -> list[dict[str, Any]]:
    return list(gateway.get(f"/v1/cluster/timeline?instanceId={instance}&limit=1")["runners"])
