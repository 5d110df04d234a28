"""A runner ends with its agent on the path macOS takes (no kernel tie), even while none of
its threads can run: MLX holds the interpreter's lock while its ring connects, for as
long as a peer is missing, so a watching thread of its own would wait with it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil

CHILD = """
import os, re
from rankscope.shared.processes import kill_when_orphaned
kill_when_orphaned(os.getppid(), every=0.05)
print(os.getpid(), flush=True)
re.match(r"(a+)+$", "a" * 64 + "b")  # a C call holding the interpreter's lock for ages
"""
PARENT = """
import subprocess, sys
subprocess.Popen([sys.executable, "-c", sys.argv[1]]).wait()
"""
ENDED_WITHIN_S = 10.0


def _ended(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _until_ended(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those of `processes` still running after `ENDED_WITHIN_S`."""
    deadline = time.monotonic() + ENDED_WITHIN_S
    while (left := [p for p in processes if not _ended(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _lifelines(pid: int) -> list[psutil.Process]:
    """The watching shells of the process `pid`."""
    return [
        p
        for p in psutil.process_iter(["cmdline"])
        if (p.info["cmdline"] or [])[-3:-1]
        and str(pid) in (p.info["cmdline"] or [])[-3:-1]
        and "rankscope-lifeline" in (p.info["cmdline"] or [])
    ]


def test_a_child_holding_the_interpreter_lock_ends_with_its_parent() -> None:
    with subprocess.Popen(
        [sys.executable, "-c", PARENT, CHILD], stdout=subprocess.PIPE, text=True
    ) as parent:
        assert parent.stdout is not None
        child = psutil.Process(int(parent.stdout.readline()))
        shells = _lifelines(child.pid)
        assert shells, "no shell watches the child"
        parent.send_signal(signal.SIGKILL)
    # reaped as the block ends, as `rankscope up` reaps an agent it restarts
    try:
        assert _until_ended([child, *shells]) == [], "the child outlived its parent"
    finally:
        if not _ended(child):
            child.kill()


def test_the_watching_shell_ends_with_its_child() -> None:
    script = (
        "import os; from rankscope.shared.processes import kill_when_orphaned; "
        "kill_when_orphaned(os.getppid()); print(os.getpid(), flush=True)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert _until_ended(_lifelines(int(done.stdout))) == []
