"""`rankscope record` itself: what it runs passes through unchanged (exit status, signal,
output), a program's own `sitecustomize` still runs, and the ranks under one launch share
one job id without asking each other."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest


def _record(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rankscope.services.cli", "record", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=60,
    )


def test_exit_status_and_output_pass_through() -> None:
    done = _record("--", sys.executable, "-c", "print('out'); import sys; sys.exit(3)")
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "")


def test_a_command_killed_by_a_signal_ends_record_by_the_same_signal() -> None:
    done = _record("--", sys.executable, "-c", "import os, signal; os.kill(os.getpid(), 15)")
    assert done.returncode == -signal.SIGTERM


def test_no_command_and_a_missing_one_are_said_in_one_line() -> None:
    empty = _record()
    assert empty.returncode == 2
    assert empty.stderr == "rankscope record: no command given (rankscope record -- COMMAND ...)\n"
    missing = _record("--", "/nonexistent/program")
    assert missing.returncode == 127
    assert missing.stderr.startswith("rankscope record: cannot run '/nonexistent/program'")


def test_a_program_s_own_sitecustomize_still_runs(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text("import builtins\nbuiltins.CUSTOMIZED = 1\n")
    show = "import builtins, sitecustomize; print(builtins.CUSTOMIZED, sitecustomize.__file__)"
    done = _record("--", sys.executable, "-c", show, env={"PYTHONPATH": str(tmp_path)})
    assert done.stdout.split()[0] == "1"
    assert done.stderr == ""


@pytest.mark.parametrize(
    ("flags", "launched", "expected"),
    [
        (["--job", "train-7"], {}, "train-7"),
        ([], {}, "job-"),  # around a launcher: one id drawn for every rank under it
        ([], {"MLX_RANK": "1"}, ""),  # one rank: its group draws the id, once for all
    ],
)
def test_the_job_id_ranks_see(flags: list[str], launched: dict[str, str], expected: str) -> None:
    show = "import os; print(os.environ.get('RANKSCOPE_RECORD_JOB', ''))"
    done = _record(*flags, "--", sys.executable, "-c", show, env=launched)
    assert done.stdout.strip().startswith(expected)
    assert bool(done.stdout.strip()) == bool(expected)
