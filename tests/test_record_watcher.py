"""A recorded rank's watcher exits once its rank's end is told, even when a library leaves
a task behind that swallows its cancellation (it would otherwise outlive the job); a rank
that ended after the user asked its job to stop is told as stopped, not failed; how a rank
ended is waited for while its launcher has yet to reap it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from rankscope.services.record import watcher
from rankscope.services.record.watcher import Hello, _Rank, let_go
from rankscope.shared.recording import STOP_FILE, reaper_marker
from rankscope.shared.subjects import Subjects
from rankscope.shared.timestamps import now
from rankscope.shared.wire import RunnerRef, RunnerStatusKind


async def test_letting_go_names_the_tasks_that_ignore_cancellation_and_waits_no_longer() -> None:
    released = asyncio.Event()

    async def stubborn() -> None:  # as nats.py's reconnect loop (nats-io/nats.py#981)
        while not released.is_set():
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                continue

    obedient = asyncio.create_task(asyncio.sleep(60))
    holding = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    assert await let_go(0.3) == [holding]  # returned while it still runs: not waited for
    assert obedient.cancelled()
    released.set()
    await holding


async def test_with_nothing_left_running_letting_go_returns_at_once() -> None:
    assert await let_go(60) == []


def _rank_of(exits: Path, pid: int = 4242) -> _Rank:
    hello = Hello(
        jobId="j",
        nodeId="n",
        deviceRank=1,
        worldSize=2,
        pid=pid,
        host="h",
        port=0,
        command="python train.py",
        startedAt=now(),
        exitFile=str(exits),
    )
    runner = RunnerRef(
        runnerId="j-0-1", nodeId="n", instanceId="j", modelId="j", deviceRank=1, worldSize=2
    )
    return _Rank(hello, runner, Subjects())


def test_a_rank_ended_after_the_user_asked_the_job_to_stop_is_stopped_not_failed(
    tmp_path: Path,
) -> None:
    (tmp_path / "4242").write_text(json.dumps({"returncode": -6}))  # mlx-lm's server: SIGABRT
    (tmp_path / STOP_FILE).write_text(json.dumps({"signal": "SIGINT"}))
    ended = _rank_of(tmp_path).ended(now())
    assert (ended.statusKind, ended.stoppedByUser, ended.signal) == (
        RunnerStatusKind.SHUTDOWN,
        True,
        "SIGABRT",
    )
    assert ended.detail == "stopped by the user (SIGINT); killed by SIGABRT"


def test_a_rank_that_failed_with_no_stop_asked_failed(tmp_path: Path) -> None:
    (tmp_path / "4242").write_text(json.dumps({"returncode": -9}))
    ended = _rank_of(tmp_path).ended(now())
    assert (ended.statusKind, ended.stoppedByUser) == (RunnerStatusKind.FAILED, False)


def test_a_rank_its_launcher_reaps_late_is_told_killed_by_its_signal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(watcher, "EXIT_FILE_WAIT_S", 0.2)  # a launcher slower than that
    rank = subprocess.Popen([sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"])
    while psutil.Process(rank.pid).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.01)
    (tmp_path / reaper_marker(os.getpid())).touch()  # this process reaps it, as a launcher

    def reap_late() -> None:  # as the launcher's wrapper: reap, then write how it ended
        time.sleep(1.0)
        rank.wait()
        (tmp_path / str(rank.pid)).write_text(json.dumps({"returncode": rank.returncode}))

    reaping = threading.Thread(target=reap_late)
    reaping.start()
    ended = _rank_of(tmp_path, pid=rank.pid).ended(now())
    reaping.join()
    assert (ended.statusKind, ended.signal, ended.detail) == (
        RunnerStatusKind.FAILED,
        "SIGKILL",
        "killed by SIGKILL",
    )
