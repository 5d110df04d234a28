"""`docker compose up` gives the README's demo, end to end: one image built, two ranks
ready on two agent containers, a chat answered, both ranks in the timeline, a second `up`
harmless, and `down -v` leaves no container, network or volume.

Runs where a Docker engine with Compose v2 and the base images is available (`.ci/run`
tries to provide one); otherwise it says why it was skipped."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

REPO = Path(__file__).parent.parent
GATEWAY = "http://127.0.0.1:8000"
BASE_IMAGES = ("python:3.11-slim", "nats:2.11-alpine")
LOCAL_COMPOSE = Path.home() / ".cache" / "rankscope-compose" / "dockercfg"
"""Where `compose-local-images.sh` installs Compose v2, when the engine has none."""


def _environ() -> dict[str, str]:
    env = dict(os.environ)
    if "DOCKER_CONFIG" not in env and (LOCAL_COMPOSE / "cli-plugins").is_dir():
        env["DOCKER_CONFIG"] = str(LOCAL_COMPOSE)
    return env


def _run(*args: str, check: bool = True, timeout: float = 600) -> str:
    done = subprocess.run(
        args, cwd=REPO, env=_environ(), capture_output=True, text=True, timeout=timeout
    )
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done.stdout if done.returncode == 0 else ""


def _unusable() -> str | None:
    """Why compose cannot run here, or None."""
    if shutil.which("docker") is None:
        return "no docker CLI"
    if not _run("docker", "info", "--format", "{{.ServerVersion}}", check=False, timeout=20):
        return "no Docker engine answers"
    if "v2" not in _run("docker", "compose", "version", check=False, timeout=20):
        return "Docker Compose v2 is not installed"
    missing = [i for i in BASE_IMAGES if not _run("docker", "images", "-q", i, check=False)]
    if missing:
        return f"base images missing ({', '.join(missing)}: compose-local-images.sh)"
    return None


def _get(path: str, body: Any = None, timeout: float = 30) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        GATEWAY + path, data=data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.loads(reply.read())


def _until(check: Any, seconds: float, what: str) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            found = check()
        except (OSError, ValueError, KeyError):
            found = None
        if found:
            return found
        time.sleep(1)
    raise AssertionError(f"{what} not within {seconds:g}s")


@pytest.fixture
def project(tmp_path: Path) -> Iterator[list[str]]:
    why = _unusable()
    if why is not None:
        pytest.skip(f"compose end to end: {why}")
    # builds on the host network: an engine without a bridge network has no other
    override = tmp_path / "build-host-network.yaml"
    override.write_text(f"services:\n  model:\n    build: {{context: {REPO}, network: host}}\n")
    name = f"rankscope-e2e-{uuid.uuid4().hex[:6]}"
    compose = ["docker", "compose", "-p", name, "-f", "compose.yaml", "-f", str(override)]
    try:
        yield compose
    finally:
        _run(*compose, "down", "-v", "--remove-orphans", check=False)


def _ready_ranks() -> list[dict[str, Any]]:
    ranks: list[dict[str, Any]] = _get("/v1/placement/runners")
    ready = [r for r in ranks if r.get("statusKind") in ("RunnerReady", "RunnerRunning")]
    return ready if len(ranks) == 2 and len(ready) == 2 else []


def test_compose_up_gives_the_demo_and_down_leaves_nothing(project: list[str]) -> None:
    _run(*project, "build", timeout=1200)
    images = _run("docker", "images", "-q", "rankscope:latest").split()
    assert len(images) == 1, "one image for every service"
    _run(*project, "up", "-d", timeout=600)
    ranks = _until(_ready_ranks, 300, "two ranks ready")
    assert {r["nodeId"] for r in ranks} == {"node-1", "node-2"}
    chat = _get(
        "/v1/chat/completions",
        {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=120,
    )
    assert chat["choices"][0]["message"]["content"]
    timeline = _get("/v1/cluster/timeline?limit=500")
    assert {e["deviceRank"] for e in timeline["timeline"]} == {0, 1}
    _run(*project, "up", "-d", timeout=600)  # again: the demo spec exists, which is fine
    _until(lambda: "exists demo" in _run(*project, "logs", "demo", check=False), 120, "demo re-run")
    states = _run(*project, "ps", "-a", "--format", "{{.Service}} {{.State}} {{.ExitCode}}")
    assert "demo exited 0" in states
    assert _until(_ready_ranks, 60, "ranks still ready")
    name = project[project.index("-p") + 1]
    _run(*project, "down", "-v", timeout=300)
    label = f"label=com.docker.compose.project={name}"
    assert _run("docker", "ps", "-a", "-q", "--filter", label) == ""
    assert _run("docker", "network", "ls", "-q", "--filter", label) == ""
    assert _run("docker", "volume", "ls", "-q", "--filter", label) == ""
