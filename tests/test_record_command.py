"""`rankscope record` itself: what it runs passes through unchanged (exit status, signal,
output), a program's own `sitecustomize` still runs, and the ranks under one launch share
one job id without asking each other."""

from __future__ import annotations

import os
import pty
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
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


COUNTING = (
    "import signal, sys, time\n"
    "got = []\n"
    "for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):\n"
    "    signal.signal(s, lambda n, f: got.append(n))\n"
    "print('ready', flush=True)\n"
    "while not got: time.sleep(0.01)\n"
    "time.sleep(0.5)\n"
    "print(' '.join(signal.Signals(n).name for n in got), flush=True)\n"
    "sys.exit(7)\n"
)
"""A program that says which signals it received (after a moment for any second one)."""


def _running(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    started = subprocess.Popen(
        [sys.executable, "-m", "rankscope.services.cli", "record", *args],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert started.stdout is not None
    assert started.stdout.readline() == "ready\n"
    return started


@pytest.mark.parametrize("sent", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_sent_to_record_reaches_the_command_once(sent: signal.Signals) -> None:
    recording = _running("--", sys.executable, "-c", COUNTING)
    recording.send_signal(sent)
    out, _ = recording.communicate(timeout=30)
    assert (recording.returncode, out) == (7, f"{sent.name}\n")


def test_a_terminal_s_ctrl_c_reaches_the_command_once() -> None:
    pid, terminal = pty.fork()
    if pid == 0:  # the child: record, on the terminal's foreground process group
        os.execv(
            sys.executable,
            [sys.executable, "-m", "rankscope.services.cli", "record", "--",
             sys.executable, "-c", COUNTING],
        )  # fmt: skip
    said = b""
    while b"ready" not in said:
        said += os.read(terminal, 1024)
    os.write(terminal, b"\x03")  # Ctrl-C: the terminal signals its foreground group
    while b"SIGINT" not in said or not said.endswith(b"\n"):
        try:
            said += os.read(terminal, 1024)
        except OSError:
            break
    _, status = os.waitpid(pid, 0)
    assert said.split(b"ready")[-1].replace(b"^C", b"").split() == [b"SIGINT"]  # not twice
    assert os.waitstatus_to_exitcode(status) == 7


SLEEPING_RANK = (
    "import os, subprocess, sys, time\n"
    "aside = [sys.executable, '-c', 'import sys, time; time.sleep(2); open(sys.argv[1], \"w\")']\n"
    "subprocess.Popen([*aside, sys.argv[1] + os.environ['MLX_RANK']], start_new_session=True)\n"
    "print('rank', os.environ['MLX_RANK'], os.getpid(), flush=True)\n"
    "time.sleep(120)\n"
)
"""A rank that sleeps, with a process in a session of its own beside it (as a recorded
rank's watcher is) that leaves a file after 2 s."""


@pytest.mark.parametrize("sent", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_no_rank_of_an_mlx_launch_job_outlives_record_however_it_is_asked_to_end(
    sent: signal.Signals, tmp_path: Path
) -> None:
    launcher = Path(sys.executable).with_name("mlx.launch")
    recording = subprocess.Popen(
        [
            sys.executable, "-m", "rankscope.services.cli", "record", "--",
            str(launcher), "--backend", "ring", "--hosts", "127.0.0.1", "-n", "2", "--",
            sys.executable, "-c", SLEEPING_RANK, str(tmp_path / "aside-"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert recording.stdout is not None
    with recording:
        ranks = [int(recording.stdout.readline().split()[-1]) for _ in range(2)]
        recording.send_signal(sent)
        recording.wait(timeout=30)
    assert recording.returncode != 0
    alive = [pid for pid in ranks if psutil.pid_exists(pid) and _not_zombie(pid)]
    assert alive == []  # mlx.launch itself leaves them running on SIGTERM
    for _ in range(100):  # what left the job's session ends on its own
        if len(list(tmp_path.glob("aside-*"))) == 2:
            break
        time.sleep(0.05)
    assert sorted(p.name for p in tmp_path.glob("aside-*")) == ["aside-0", "aside-1"]


def _not_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


STUCK_LAUNCH = (
    "import signal, subprocess, sys\n"
    "rank = subprocess.Popen([sys.executable, '-c', "
    "'import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    'signal.signal(signal.SIGTERM, signal.SIG_IGN); print("ready", flush=True); '
    "time.sleep(600)', *sys.argv[1:]])\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "sys.exit(rank.wait())\n"
)
"""A launcher that waits for its one rank, which, as a rank blocked in a collective whose
peer ended, no signal reaches."""


WEDGED_LAUNCH = (
    "import signal, subprocess, sys, time\n"
    "rank = subprocess.Popen([sys.executable, '-c', "
    "'import time; print(\"ready\", flush=True); time.sleep(600)', *sys.argv[1:]])\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "time.sleep(600)\n"
)
"""A launcher that, asked to end, neither ends nor reaps its ended rank: wedged, as
mlx.launch can be when a Ctrl-C lands as it reaps its ranks."""


def _left(marker: str) -> list[psutil.Process]:
    """The live processes whose command line holds `marker` (each test's own)."""
    return [
        p
        for p in psutil.process_iter(["cmdline"])
        if marker in (p.info["cmdline"] or []) and _not_zombie(p.pid)
    ]


def test_a_launcher_wedged_after_its_ranks_ended_is_killed_and_record_ends() -> None:
    soon = {**os.environ, "RANKSCOPE_RECORD_KILL_AFTER": "1s"}
    marker = f"wedged-{uuid.uuid4()}"
    recording = _running("--", sys.executable, "-c", WEDGED_LAUNCH, marker, env=soon)
    recording.send_signal(signal.SIGINT)
    recording.communicate(timeout=60)
    assert recording.returncode != 0
    assert _left(marker) == []


def test_a_rank_no_signal_reaches_is_killed_once_the_job_was_asked_to_end() -> None:
    soon = {**os.environ, "RANKSCOPE_RECORD_KILL_AFTER": "2s"}  # 15 s unless told
    marker = f"stuck-{uuid.uuid4()}"
    recording = _running("--", sys.executable, "-c", STUCK_LAUNCH, marker, env=soon)
    started = time.monotonic()
    recording.send_signal(signal.SIGINT)
    recording.communicate(timeout=60)
    took = time.monotonic() - started
    assert recording.returncode != 0  # the launcher saw its rank killed
    assert took >= 2
    assert _left(marker) == []
