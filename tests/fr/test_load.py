"""`rankscope fr load` into a real `rankscope up`: a gloo job's dumps show as a job on the
timeline and as one incident naming its culprit, with the verdict in the incident's
bundle; loading them again, or restarting rankscope, makes no second incident."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.stack_up import running_up

pytestmark = [pytest.mark.slow, pytest.mark.nats, pytest.mark.timeout(240)]

FIXTURES = Path(__file__).parent.parent / "fixtures" / "fr"


def _get(base: str, path: str) -> Any:
    with urllib.request.urlopen(base + path, timeout=30) as reply:
        body = reply.read()
    return body if path.endswith("/bundle") else json.loads(body)


def _until(check: Callable[[], Any], seconds: float = 30) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            found = check()
        except OSError:
            found = None
        if found:
            return found
        time.sleep(0.25)
    raise AssertionError(f"not reached within {seconds:g}s")


def _load(base: str, job: str, *paths: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rankscope.services.cli", "fr", "load", *map(str, paths),
         "--job", job, "--url", base],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def _incidents(base: str, job: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = _get(base, f"/v1/cluster/diagnosis/history?instanceId={job}")[
        "findings"
    ]
    return found


def test_loaded_dumps_are_a_job_with_one_incident_through_reloads_and_restarts(
    tmp_path: Path,
) -> None:
    data = tmp_path / ".rankscope"
    with running_up(data, env={"RANKSCOPE_LOG_LEVEL": "warning"}) as (_, shown):
        base = shown["web"].split()[0].rstrip("/")
        _until(lambda: _get(base, "/readyz"), 60)
        done = _load(base, "fr-hang", FIXTURES / "gloo" / "hang")
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("loaded 4 ranks as job fr-hang")

        def lanes() -> dict[str, Any] | None:
            timeline = _get(base, "/v1/cluster/timeline?instanceId=fr-hang")
            return timeline if len(timeline["runners"]) == 4 else None

        timeline = _until(lanes)
        assert all(r["recorded"] for r in timeline["runners"])
        waits = {e["deviceRank"] for e in timeline["timeline"] if e["event"] == "collective_wait"}
        assert waits == {0, 1, 2}  # rank 3 never entered all_reduce #6
        (incident,) = _until(lambda: _incidents(base, "fr-hang"))
        assert (incident["culpritRanks"], incident["waitingRanks"]) == ([3], [0, 1, 2])
        assert incident["open"] is False
        assert incident["summary"].startswith("From Flight Recorder dumps (")
        bundle = _get(base, f"/v1/cluster/diagnosis/history/{incident['incidentId']}/bundle")
        with tarfile.open(fileobj=io.BytesIO(bundle)) as tar:
            files = {m.name.split("/", 1)[1]: tar.extractfile(m) for m in tar.getmembers()}
            verdict = json.loads(files["fr_verdict.json"].read())  # type: ignore[union-attr]
        assert verdict["culprits"] == [3]
        assert [f for f in _get(base, "/v1/cluster/diagnosis")["findings"]
                if f["instanceId"] == "fr-hang"] == []  # fmt: skip  # not judged live
        again = _load(base, "fr-hang", FIXTURES / "gloo" / "hang")
        assert again.returncode == 0, again.stderr
        nvidia = _load(base, "fr-megatron", FIXTURES / "nvidia" / "lock_gil_2nd")
        assert nvidia.returncode == 0, nvidia.stderr
        (megatron,) = _until(lambda: _incidents(base, "fr-megatron"))
        assert megatron["culpritRanks"] == [10, 15]
        assert len(_incidents(base, "fr-hang")) == 1  # the same dumps: the same incident
    with running_up(data, env={"RANKSCOPE_LOG_LEVEL": "warning"}) as (_, shown):
        base = shown["web"].split()[0].rstrip("/")
        _until(lambda: _get(base, "/readyz"), 60)
        assert len(_until(lanes)["runners"]) == 4  # read again from the stream
        time.sleep(1)  # a round of the findings after the restart
        assert len(_incidents(base, "fr-hang")) == 1


def test_a_set_holding_a_hostile_file_is_not_loaded(tmp_path: Path) -> None:
    hostile = tmp_path / "_dump_1"
    hostile.write_bytes(b"\x80\x04cos\nsystem\n(S'true'\ntR.")
    done = _load("http://127.0.0.1:9", "fr-x", FIXTURES / "gloo" / "hang" / "rank_0", hostile)
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (
        "rankscope fr: nothing loaded: a file was refused as hostile"
    )
