"""A Python with PyTorch (CPU, gloo) for the tests that record real torch.distributed jobs,
made once by the tests' own set-up from the package index; rankscope itself needs no torch.

`RANKSCOPE_TEST_TORCH` names the requirement (default `torch==2.13.0`, a CPU build), and
`RANKSCOPE_TEST_TORCH_VENV` where the environment lives (default under the user's cache).
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

__all__ = ["torch_python"]

REQUIREMENT = os.environ.get("RANKSCOPE_TEST_TORCH", "torch==2.13.0")
_INSTALL_S = 900


def _where() -> Path:
    given = os.environ.get("RANKSCOPE_TEST_TORCH_VENV")
    if given:
        return Path(given)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    tag = REQUIREMENT.replace("==", "-").replace(" ", "")
    return cache / "rankscope-tests" / f"{tag}-py{sys.version_info[0]}{sys.version_info[1]}"


def torch_python() -> Path:
    """The interpreter of a virtual environment with torch, made on first use (one maker at
    a time across test workers); skips the test, saying why, where it cannot be made."""
    venv = _where()
    python, made = venv / "bin" / "python", venv / ".made"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if made.exists() and made.read_text() == REQUIREMENT:
            return python
        steps = [
            [sys.executable, "-m", "venv", "--clear", str(venv)],
            [str(python), "-m", "pip", "install", "-q", REQUIREMENT, "numpy"],
        ]
        for step in steps:
            try:
                done = subprocess.run(step, capture_output=True, text=True, timeout=_INSTALL_S)
            except (OSError, subprocess.TimeoutExpired) as exc:
                pytest.skip(f"no PyTorch for these tests: {' '.join(step[:4])}: {exc}")
            if done.returncode != 0:
                why = (done.stderr.strip().splitlines() or ["no output"])[-1]
                pytest.skip(f"no PyTorch for these tests ({REQUIREMENT}): {why}")
        made.write_text(REQUIREMENT)
    return python
