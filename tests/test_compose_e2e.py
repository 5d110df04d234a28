"""`docker compose up` gives the README's demo, end to end: one image built, two ranks
ready on two agent containers, a chat answered, both ranks in the timeline, a second `up`
harmless, and `down -v` leaves no container, network or volume. With
`compose.cluster.yaml` the same demo runs on three NATS servers and outlives one of them.

Runs where a Docker engine with Compose v2 and the base images is available (`.ci/run`
tries to provide one); otherwise it says why it was skipped."""

from __future__ import annotations

import asyncio
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

import nats
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


def _project(tmp_path: Path, *files: str) -> Iterator[list[str]]:
    """`docker compose` over compose.yaml and `files`, its project taken down at the end."""
    why = _unusable()
    if why is not None:
        pytest.skip(f"compose end to end: {why}")
    # builds on the host network: an engine without a bridge network has no other
    override = tmp_path / "build-host-network.yaml"
    override.write_text(f"services:\n  model:\n    build: {{context: {REPO}, network: host}}\n")
    name = f"rankscope-e2e-{uuid.uuid4().hex[:6]}"
    compose = ["docker", "compose", "-p", name, "-f", "compose.yaml"]
    for file in (*files, str(override)):
        compose += ["-f", file]
    try:
        yield compose
    finally:
        _run(*compose, "down", "-v", "--remove-orphans", check=False)


@pytest.fixture
def project(tmp_path: Path) -> Iterator[list[str]]:
    yield from _project(tmp_path)


@pytest.fixture
def cluster_project(tmp_path: Path) -> Iterator[list[str]]:
    yield from _project(tmp_path, "compose.cluster.yaml")


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


SERVICES = {"nats-1": "nats", "nats-2": "nats-2", "nats-3": "nats-3"}
"""The compose service of each NATS server name in compose.cluster.yaml."""


def _leader(stream: str) -> str:
    """The server leading `stream`, asked as the read-only operator user."""

    async def ask() -> str:
        nc = await nats.connect(
            "nats://127.0.0.1:4222", user="operator", password="operator-change-me"
        )
        try:
            info = await nc.jetstream().stream_info(stream)
            assert info.cluster is not None
            assert info.cluster.leader
            assert info.config.num_replicas == 3
            return info.cluster.leader
        finally:
            await nc.close()

    return asyncio.run(ask())


def _readiness() -> tuple[int, str]:
    try:
        with urllib.request.urlopen(GATEWAY + "/readyz", timeout=10) as reply:
            return reply.status, ""
    except urllib.error.HTTPError as refused:
        with refused:
            return refused.code, json.loads(refused.read())["reason"]


def _until_ready(seconds: float, what: str) -> None:
    said = [""]

    def ready() -> bool:
        code, said[0] = _readiness()
        return code == 200

    try:
        _until(ready, seconds, what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the last reason: {said[0]}") from None


def _chat() -> str:
    reply = _get(
        "/v1/chat/completions",
        {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=120,
    )
    assert reply["choices"][0]["message"]["content"]
    return str(reply["id"])


def test_on_a_nats_cluster_the_demo_outlives_a_server_and_says_when_a_stream_cannot(
    cluster_project: list[str],
) -> None:
    _run(*cluster_project, "build", timeout=1200)
    _run(*cluster_project, "up", "-d", timeout=600)
    _until(_ready_ranks, 300, "two ranks ready")
    _chat()
    assert "missingPartitions" not in _get("/v1/cluster/timeline?limit=1")
    _run(*cluster_project, "kill", "aggregator-2")  # the partition of the demo's instance
    _until(lambda: "partition 1" in _readiness()[1], 60, "a 503 naming the lost partition")
    partial = _get("/v1/cluster/timeline?limit=1")
    assert [m["partition"] for m in partial["missingPartitions"]] == [1]
    _run(*cluster_project, "start", "aggregator-2")  # rebuilds from the streams
    _until(_ready_ranks, 120, "the partition back with both ranks")
    _chat()
    leader = SERVICES[_leader("RANKSCOPE_RUNNER")]
    _run(*cluster_project, "kill", leader)  # the telemetry stream's leader, abruptly
    command = _chat()  # served once the stream has a new leader
    _until(
        lambda: (
            {
                e["deviceRank"]
                for e in _get("/v1/cluster/timeline?limit=500")["timeline"]
                if e["commandId"] == command
            }
            == {0, 1}
        ),
        60,
        "both ranks' entries of a chat after the leader was lost",
    )
    _until_ready(60, "ready on two servers")
    second = next(s for s in SERVICES.values() if s != leader)
    _run(*cluster_project, "kill", second)  # one of three left: no stream has a quorum
    # not ready, saying which stream cannot store and why (recovery: tests/test_replicas.py)
    _until(lambda: "stream " in _readiness()[1], 60, "a 503 naming a stream without a leader")
