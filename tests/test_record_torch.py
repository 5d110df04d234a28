"""End to end: `rankscope record -- torchrun ...` around real torch.distributed jobs (gloo on
this CPU, torch from the tests' own environment: rankscope has none) into a real `rankscope
up`. A recorded DDP job prints and ends as it does unrecorded, with its C++-issued
allreduces counted; a stopped rank is named, a killed one is a dead rank with its signal, a
rank in a broadcast while its peers all_reduce is named with both ops as Flight Recorder
numbers them, and with NATS gone the job runs on unharmed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.recorded import Stack, assert_straggler, end, ended, recording_stack
from tests.stack_up import free_port
from tests.torch_env import torch_python

pytestmark = [pytest.mark.slow, pytest.mark.nats, pytest.mark.timeout(300)]

DDP = """
import sys, time
import atexit, os
import torch, torch.distributed as dist
atexit.register(os._exit, 0)  # the last to run: torch 2.13's teardown aborts 1 exit in 4
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 32))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
steps = int(sys.argv[1])
for step in range(steps):
    torch.manual_seed(1000 * rank + step)
    loss = model(torch.randn(16, 32)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    time.sleep(0.01)
weights = sum(float(p.detach().sum()) for p in model.parameters())
sys.stdout.write(f"rank {rank} checksum {weights:.6f}\\n")  # one write: ranks share stdout
sys.stdout.flush()
dist.destroy_process_group()
"""

DESYNC = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
values = torch.ones(64)
for _ in range(20):
    dist.all_reduce(values)
if dist.get_rank() == 1:
    dist.broadcast(values, src=0)  # its peers all_reduce: gloo waits for ever
else:
    dist.all_reduce(values)
"""


STRAGGLER = """
import atexit, os, pathlib, time
import torch, torch.distributed as dist
atexit.register(os._exit, 0)
dist.init_process_group("gloo")
rank = dist.get_rank()
if hasattr(os, "sched_setaffinity"):  # ranks pinned two to a core: the same neighbours always
    os.sched_setaffinity(0, {rank % os.cpu_count()})
torch.manual_seed(rank)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(256, 256))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
side = torch.randn(256, 256) / 16
slower = pathlib.Path(__file__).with_name(f"slower-{rank}")  # its work, times over
while True:
    own = side
    for _ in range(round(12 * (float(slower.read_text()) if slower.exists() else 1))):
        own = torch.tanh(own @ side)
    loss = model(own).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()  # DDP's allreduce: the step's wait
    optimizer.step()
    time.sleep(0.002)  # a data loader's moment between steps
"""
"""A DDP step whose own work (twelve 256-wide matrix products) dwarfs the rest (the model's
forward and backward, its allreduce); `slower-<rank>` beside the script gives a rank that
many times the work, to the nearest twelfth."""


class Torch:
    """The tests' Python with torch, and torchrun of a script on this machine."""

    def __init__(self, python: Path) -> None:
        self.python = python

    def run(self, ranks: int, *program: str) -> list[str]:
        """`torchrun` of `program` on `ranks` local ranks, its rendezvous on a free port."""
        torchrun = str(self.python.parent / "torchrun")
        where = ["--nnodes", "1", "--master-port", str(free_port())]
        return [torchrun, *where, "--nproc-per-node", str(ranks), *program]


@pytest.fixture(scope="module")
def torch() -> Torch:
    return Torch(torch_python())


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with recording_stack(tmp_path_factory) as found:
        yield found


def _rank_pid(script: str, rank: int) -> int:
    """The process of `rank` running `script` (torchrun gives each its `RANK`)."""
    for process in psutil.process_iter(["cmdline"]):
        if script in (process.info["cmdline"] or []):
            try:
                if process.environ().get("RANK") == str(rank):
                    return int(process.pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
    raise AssertionError(f"no rank {rank} of {script}")


def _timeline(stack: Stack, job: str) -> dict[str, Any]:
    found: dict[str, Any] = stack.get(f"/v1/cluster/timeline?instanceId={job}")
    return found


def _running(stack: Stack, job: str, ranks: int) -> None:
    """Until every rank of `job` is recorded and past its first 20 collectives."""
    stack.until(lambda: len(_timeline(stack, job)["runners"]) == ranks, 60)

    def stepped() -> set[int]:
        timeline = _timeline(stack, job)["timeline"]
        return {
            e["deviceRank"] for e in timeline if e["event"] == "steps" and e["attrs"]["step"] > 20
        }

    stack.until(lambda: len(stepped()) == ranks, 30)


def test_a_recorded_ddp_job_prints_and_ends_as_unrecorded_with_its_allreduces(
    stack: Stack, torch: Torch
) -> None:
    train = stack.script("ddp.py", DDP)
    plain = subprocess.run(torch.run(2, train, "150"), capture_output=True, text=True)
    assert plain.returncode == 0, plain.stderr
    code, out, err = ended(stack.record("ddp-1", torch.run(2, train, "150")))
    assert (code, out) == (0, sorted(plain.stdout.splitlines()))
    assert [line.split()[:2] for line in out] == [["rank", "0"], ["rank", "1"]]
    assert "rankscope record" not in err  # no rank went unrecorded

    def exits() -> list[dict[str, Any]]:
        return [e for e in _timeline(stack, "ddp-1")["timeline"] if e["event"] == "program_exit"]

    done = stack.until(lambda: len(exits()) == 2 and exits(), 20)
    made = [e["attrs"]["step"] for e in done]
    assert min(made) >= 150, made  # DDP's allreduces, issued from C++, counted
    timeline = _timeline(stack, "ddp-1")
    ready = [e for e in timeline["timeline"] if e["event"] == "group_ready"]
    assert sorted((e["deviceRank"], e["attrs"]["backend"]) for e in ready) == [
        (0, "gloo"),
        (1, "gloo"),
    ]
    steps = [e for e in timeline["timeline"] if e["event"] == "steps"]
    assert steps
    assert all(re.search(r"the last \w+ #\d+ \(group default_pg\)$", e["detail"]) for e in steps)
    assert any("the last all_reduce #" in e["detail"] for e in steps), steps  # DDP's, named
    assert {r["statusKind"] for r in timeline["runners"]} == {"RunnerShutdown"}
    assert stack.get("/v1/cluster/diagnosis/history?instanceId=ddp-1")["findings"] == []


def test_a_stopped_torch_rank_is_named_within_10s_in_every_sample(
    stack: Stack, torch: Torch
) -> None:
    train = stack.script("ddp-forever.py", DDP)
    job = stack.record("tstop-1", torch.run(4, train, "1000000"))
    try:
        _running(stack, "tstop-1", 4)
        stopped = _rank_pid(train, 2)
        os.kill(stopped, signal.SIGSTOP)
        frozen_at = time.monotonic()
        try:
            (finding,) = stack.until(lambda: stack.findings("tstop-1"), 10)
            named_after = time.monotonic() - frozen_at
            samples = [finding]
            while time.monotonic() - frozen_at < named_after + 6:
                samples += stack.findings("tstop-1") or [{"culpritRanks": "none"}]
                time.sleep(0.5)
        finally:
            os.kill(stopped, signal.SIGCONT)
        assert {(tuple(s["culpritRanks"]), s.get("kind")) for s in samples} == {
            ((2,), "stalled_rank")
        }, samples
        assert sorted(samples[-1]["waitingRanks"]) == [0, 1, 3]
        assert "all_reduce #" in samples[-1]["summary"]  # where its peers wait, FR's numbers
        stack.until(lambda: not stack.findings("tstop-1"), 15)
    finally:
        end(job, train)


def test_a_killed_torch_rank_is_a_dead_rank_with_its_signal(stack: Stack, torch: Torch) -> None:
    train = stack.script("ddp-killed.py", DDP)
    job = stack.record("tkill-1", torch.run(4, train, "1000000"))
    try:
        _running(stack, "tkill-1", 4)
        os.kill(_rank_pid(train, 1), signal.SIGKILL)
        killed_at = time.monotonic()
        (finding,) = stack.until(lambda: stack.findings("tkill-1"), 10)
        assert time.monotonic() - killed_at < 10
        assert (finding["kind"], finding["culpritRanks"]) == ("dead_rank", [1]), finding["summary"]
        assert "killed by SIGKILL" in finding["summary"]
    finally:
        end(job, train)


def test_a_rank_in_a_broadcast_while_its_peers_all_reduce_is_named_with_both(
    stack: Stack, torch: Torch
) -> None:
    desync = stack.script("tdesync.py", DESYNC)
    job = stack.record("tdesync-1", torch.run(4, desync))
    try:
        stack.until(lambda: len(_timeline(stack, "tdesync-1")["runners"]) == 4, 60)
        (finding,) = stack.until(lambda: stack.findings("tdesync-1"), 15)
        assert finding["kind"] == "rank_disagreement", finding["summary"]
        assert finding["culpritRanks"] == [1], finding["summary"]
        assert "broadcast #21 (group default_pg)" in finding["summary"]
        assert "all_reduce #21 (group default_pg)" in finding["summary"]
    finally:
        end(job, desync)


def test_ranks_recorded_one_by_one_under_torchrun_agree_on_one_job(
    stack: Stack, torch: Torch
) -> None:
    train = stack.script("ddp-each.py", DDP)
    record = [sys.executable, "-m", "rankscope.services.cli", "record", "--"]
    each = torch.run(2, "--no-python", *record, str(torch.python), train, "150")
    env = {**os.environ, "RANKSCOPE_NATS_URL": stack.nats}
    done = subprocess.run(each, capture_output=True, text=True, env=env, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(line.split()[:2] for line in done.stdout.splitlines()) == [
        ["rank", "0"],
        ["rank", "1"],
    ]

    def drawn() -> list[dict[str, Any]]:
        runners = stack.get("/v1/cluster/timeline")["runners"]
        return [r for r in runners if r["instanceId"].startswith("job-")]

    ranks = stack.until(lambda: len(drawn()) == 2 and drawn(), 20)
    assert {r["instanceId"] for r in ranks} == {ranks[0]["instanceId"]}  # through its store
    assert sorted(r["deviceRank"] for r in ranks) == [0, 1]


def test_with_nats_gone_a_torch_job_runs_on_and_ends_the_same(stack: Stack, torch: Torch) -> None:
    train = stack.script("ddp-offline.py", DDP)
    nowhere = f"nats://127.0.0.1:{free_port()}"
    plain = subprocess.run(torch.run(2, train, "60"), capture_output=True, text=True)
    job = stack.record(None, torch.run(2, train, "60"), nats=nowhere, give_up="2s")
    code, out, err = ended(job)
    assert (code, out) == (0, sorted(plain.stdout.splitlines())), err[-3000:]


def test_a_torch_rank_slow_from_its_first_step_is_named_with_the_share_lost_to_it(
    stack: Stack, torch: Torch
) -> None:
    script = Path(stack.script("straggler.py", STRAGGLER))
    script.with_name("slower-2").write_text("2")
    job = stack.record("tslow-1", torch.run(4, str(script)))
    try:
        stack.until(lambda: len(_timeline(stack, "tslow-1")["runners"]) == 4, 60)
        (finding,) = stack.until(lambda: stack.findings("tslow-1"), 30)
        print(f"named: {finding['summary']}")  # shown when the test fails
        samples = [finding]
        for _ in range(10):
            time.sleep(0.5)
            samples += stack.findings("tslow-1")
    finally:
        end(job, str(script))
    assert {(s["kind"], tuple(s["culpritRanks"])) for s in samples} == {("slow_rank", (2,))}
    assert_straggler(finding, culprit=2)
