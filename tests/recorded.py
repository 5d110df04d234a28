"""`rankscope up` for tests that record jobs with `rankscope record`, and the ranks' processes
found, ended and waited for."""

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

from tests.stack_up import free_ports, running_up

__all__ = [
    "LAUNCH",
    "Stack",
    "assert_straggler",
    "end",
    "ended",
    "launched",
    "rank_pids",
    "recording_stack",
]

LAUNCH = str(Path(sys.executable).parent / "mlx.launch")
FED_BYTES = 256 * 1024
"""Past what a launcher's pipes to its ranks hold (64 KiB each on Linux)."""


def launched(command: list[str], **popen: Any) -> subprocess.Popen[str]:
    """`command`, which runs `mlx.launch`, started with its output captured and its stdin a
    pipe filled past what the launcher relays to its ranks, held open until it ends.

    mlx.launch (0.32) selects on its own stdin for reading and on each rank's stdin for
    writing, without waiting whenever either is ready: its stdin at EOF (/dev/null, as
    under CI) or a rank's stdin pipe with room. Each keeps a core busy for the job's life,
    1.4 cores for two idle ranks, on a 2-core machine whose tests share it. Filled and
    open, neither is ready, and it waits as it should (the ranks read none of it). The
    spin is measured in bench/record_overhead.py, which runs the launcher as users do."""
    read, write = os.pipe()
    options: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    process = subprocess.Popen(command, stdin=read, text=True, **(options | popen))
    os.close(read)

    def feed() -> None:
        left = memoryview(b"\n" * FED_BYTES)
        with contextlib.suppress(OSError):  # the job ended before it read it all
            while left:
                left = left[os.write(write, left) :]
        process.wait()
        os.close(write)

    threading.Thread(target=feed, daemon=True).start()
    return process


class Stack:
    """`rankscope up` without a demo, and what is asked of its gateway."""

    def __init__(self, base: str, nats: str, scripts: Path) -> None:
        self.base, self.nats, self.scripts = base, nats, scripts

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.base + path, timeout=30) as reply:
            return json.loads(reply.read())

    def findings(self, job: str) -> list[dict[str, Any]]:
        found = self.get("/v1/cluster/diagnosis")["findings"]
        return [f for f in found if f["instanceId"] == job]

    def until(self, check: Callable[[], Any], seconds: float) -> Any:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            found = check()
            if found:
                return found
            time.sleep(0.25)
        raise AssertionError(f"not reached within {seconds:g}s")

    def script(self, name: str, text: str) -> str:
        path = self.scripts / name
        path.write_text(text)
        return str(path)

    def launch(self, ranks: int, *program: str) -> list[str]:
        """`mlx.launch` of `program` on `ranks` ring ranks on loopback."""
        port = str(free_ports(ranks))
        hosts = ["--backend", "ring", "--hosts", "127.0.0.1", "-n", str(ranks), "-p", port]
        return [LAUNCH, *hosts, "--", sys.executable, *program]

    def record(
        self, job: str | None, command: list[str], nats: str | None = None, give_up: str = "60s"
    ) -> subprocess.Popen[str]:
        """`rankscope record` of `command`, its output captured."""
        env = {
            **os.environ,
            "RANKSCOPE_NATS_URL": nats or self.nats,
            "RANKSCOPE_RECORD_GIVE_UP": give_up,
        }
        flags = ["--job", job] if job else []
        return launched(
            [sys.executable, "-m", "rankscope.services.cli", "record", *flags, "--", *command],
            env=env,
        )


@contextlib.contextmanager
def recording_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """`rankscope up` for recorded jobs: a short stall threshold, two aggregator
    partitions (a job is seen by its partition alone)."""
    data = tmp_path_factory.mktemp("record") / ".rankscope"
    env = {
        "RANKSCOPE_STALL_THRESHOLD": "3s",
        "RANKSCOPE_LOG_LEVEL": "warning",
        "RANKSCOPE_AGGREGATOR_PARTITIONS": "2",  # a job is seen by its partition alone
    }
    with running_up(data, env=env) as (_, shown):
        found = Stack(shown["web"].split()[0].rstrip("/"), shown["NATS"].split()[0], data.parent)

        def ready() -> bool:
            try:
                found.get("/readyz")
            except OSError:
                return False
            return True

        found.until(ready, 60)
        yield found


def rank_pids(script: str) -> list[int]:
    """The processes running `script` that have not ended."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        if script in (process.info["cmdline"] or []) and process.info["status"] != "zombie":
            found.append(process.pid)
    return found


def end(job: subprocess.Popen[str], script: str) -> None:
    """Kill the ranks running `script` (a launcher killed leaves them running), then wait
    for the job to end."""
    for process in psutil.process_iter(["cmdline"]):
        if script in (process.info["cmdline"] or []):
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
    job.communicate(timeout=60)


def ended(process: subprocess.Popen[str]) -> tuple[int, list[str], str]:
    """How a job ended: its exit status, its output's lines sorted, its errors."""
    out, err = process.communicate(timeout=120)
    return process.returncode, sorted(out.splitlines()), err


def assert_straggler(finding: dict[str, Any], culprit: int) -> None:
    """`finding` names `culprit` of a 4-rank job as the rank the job waits on, and its
    evidence says so: the share lost to it and how often it was last, and it tells its work.
    How close the share and the work are to the truth is checked where the truth is known
    (the unit tests' simulated job); here, on a machine other tests share, that it stands
    out by what the job waits on. Its work per step is wall time on a core it shares with a
    peer spinning in the collective and with other tests' processes: given 4/3 of the work,
    it read 0.9-1.08x its peers' while the job lost 11-27% of its time to it."""
    paces = {e["deviceRank"]: e["pace"] for e in finding["evidence"]}
    named, peers = paces[culprit], [paces[r] for r in range(4) if r != culprit]
    assert named["waitedOn"] >= 0.10
    assert named["waitedOn"] > max(p["waitedOn"] for p in peers)
    assert named["lastArrival"] > 0.4  # chance: 0.25
    assert named["workVsPeers"] > 0
    assert f"rank {culprit} (" in finding["summary"]
    assert "is the straggler: the job loses" in finding["summary"]
    assert "its work per step is" in finding["summary"]
