"""A rank made slower for real: its process stopped and continued on a duty cycle, so it
computes at `1 / factor` of its pace (SIGSTOP/SIGCONT reach any process, on Linux and
macOS alike; no cgroup needed); or its core shared with a busy process, as a noisy
neighbour or a throttled core takes its time (Linux: CPU affinity)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import psutil

from rankscope.shared.processes import die_with_parent

__all__ = ["PERIOD_S", "apart", "crowded", "slowed"]

PERIOD_S = 0.004
"""One stop and one run: short beside a step (the demo's decode step takes ~4 ms, ~1 ms of
it working), so every step is slowed alike. Stops of 10 ms every 20 ms landed on some
steps' work and on others' wait: a rank slowed 2x worked 1.1-1.3x slower for 20 s at a
time."""
_WEIGHTS = {nice: round(1024 / 1.25**nice) for nice in range(20)}
"""The kernel's scheduler weight of each nice level (each level ~1.25x lighter): a busy
process of weight w beside a runnable one of 1024 takes w / (1024 + w) of their core."""


@contextlib.contextmanager
def crowded(pid: int, factor: float, cpu: int, others: dict[int, int]) -> Iterator[None]:
    """Process `pid`, kept on core `cpu` (and each of `others` on its core, so no peer
    shares it), shares the core with a busy process niced so that `pid`, always runnable
    (a rank that polls while it waits is), runs about `1 / factor` of the time; the busy
    process gone and every affinity as it was after. Every thread is kept: a process's
    affinity is each thread's own (MLX computes on a thread of its own)."""
    nice = min(_WEIGHTS, key=lambda n: abs(1024 / (1024 + _WEIGHTS[n]) - 1 / factor))
    placed = {pid: cpu, **others}
    before: dict[int, set[int]] = {}
    for process in placed:
        with contextlib.suppress(ProcessLookupError):  # one gone since it was listed
            before[process] = os.sched_getaffinity(process)
    tie = die_with_parent(signal.SIGKILL)

    def alone() -> None:
        os.sched_setaffinity(0, {cpu})
        if tie is not None:  # gone with whoever crowds it, however that ends
            tie()

    busy = subprocess.Popen(
        [sys.executable, "-c", f"import os\nos.nice({nice})\nwhile True: pass"],
        preexec_fn=alone,
    )
    try:
        for process, core in placed.items():
            _keep(process, {core})
        yield
    finally:
        busy.kill()
        busy.wait()
        for process, cores in before.items():  # threads started meanwhile too
            _keep(process, cores)


def apart(slowed: int, peer: int, cpu: int) -> dict[int, int]:
    """Where each process of a stack on this machine is kept while rank process `slowed`
    shares core `cpu` with a busy process (`crowded`'s `others`): its peer `peer` on
    another core alone, everything else (the services, NATS, this process) beside it, as
    on a machine of its own with its node's services. On two cores, three processes always
    running (two ranks polling while they wait, and the busy one) leave the services with
    whichever rank shares least: kept beside its peer, they slowed the peer more than the
    busy process slowed the rank."""
    kept = {peer: (cpu + 1) % (os.cpu_count() or 2), os.getpid(): cpu}
    for process in psutil.process_iter(["cmdline"]):
        line = " ".join(process.info["cmdline"] or [])
        if process.pid not in (slowed, peer) and ("rankscope" in line or "nats-server" in line):
            kept[process.pid] = cpu
    return kept


def _keep(pid: int, cores: set[int]) -> None:
    """Every thread of process `pid` on `cores` (a thread starts where its starter runs)."""
    for thread in _threads(pid):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(thread, cores)


def _threads(pid: int) -> list[int]:
    """The ids of process `pid`'s threads (none once it is gone)."""
    try:
        return [int(name) for name in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return []


@contextlib.contextmanager
def slowed(pid: int, factor: float) -> Iterator[None]:
    """Process `pid` runs `1 / factor` of the time while the block lasts; continued after
    (also when the block raises)."""
    stopped_for = PERIOD_S * (1 - 1 / factor)
    done = threading.Event()

    def cycle() -> None:
        while not done.is_set():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                time.sleep(stopped_for)
                os.kill(pid, signal.SIGCONT)
            time.sleep(PERIOD_S - stopped_for)

    thread = threading.Thread(target=cycle, name=f"slowing {pid}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
