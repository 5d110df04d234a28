"""End to end: `rankscope up --demo` as a user runs it, checked over HTTP, then a runner
frozen with SIGSTOP is named by the diagnosis, and Ctrl-C in the middle of a long
generation leaves nothing behind. All of
it twice: on an open NATS, and with `--nats-auth`, where every service and each agent has
only its own user's permissions and the server must refuse none of their work."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from rankscope.shared.processes import PORTABLE_ENV
from tests import skulk_shapes
from tests.browser import ARTIFACTS, browse, shown
from tests.demo_up import Demo, launch_demo, stop_up
from tests.stack_up import free_port

pytestmark = [pytest.mark.slow, pytest.mark.nats, pytest.mark.timeout(300)]

REPO = Path(__file__).parent.parent


def _descendants(pid: int) -> set[int]:
    found: set[int] = set()
    stack = [pid]
    while stack:
        parent = stack.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            children = (
                (task / "children").read_text().split() if (task / "children").exists() else []
            )
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    stack.append(child)
    return found


@pytest.fixture(
    scope="module",
    params=[((), {}), (("--nats-auth",), {PORTABLE_ENV: "1"})],
    ids=["open", "nats-auth-portable"],
)
def demo(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Demo]:
    """The demo on an open NATS; and with `--nats-auth` on the processes' portable path
    (no Linux-only process ties: what runs on macOS)."""
    port, data = free_port(), tmp_path_factory.mktemp("demo") / ".rankscope"
    flags, env = request.param
    process = launch_demo(data, port, *flags, extra=env)
    yield Demo(process, f"http://127.0.0.1:{port}", data)
    stop_up(process)


def test_the_demo_runs_behind_an_api_token_that_closes_reads_too(tmp_path: Path) -> None:
    port = free_port()
    secret = {"RANKSCOPE_API_TOKEN": "s3cret", "RANKSCOPE_API_TOKEN_READS": "true"}
    process = launch_demo(tmp_path / ".rankscope", port, extra=secret)  # it creates its spec, chats
    try:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/runners", timeout=10)
        assert refused.value.code == 401
        refused.value.close()
        base = f"http://127.0.0.1:{port}"
        page = browse(base, ARTIFACTS / "timeline-token.png", "/#token=s3cret")
        assert "2 ranks ·" in page, shown(page)  # the page reads with the token it was given
    finally:
        stop_up(process)


def _acknowledged(demo: Demo, since: str) -> set[str]:
    """The commands whose tasks a rank acknowledged from `since` on."""
    timeline = demo.get("/v1/cluster/timeline?limit=100000")["timeline"]
    return {
        e["commandId"]
        for e in timeline
        if e["event"] == "task_acknowledged" and e.get("commandId") and e["at"] >= since
    }


def test_restarting_up_keeps_its_placement_runs_no_past_chat_and_opens_no_incident(
    tmp_path: Path,
) -> None:
    port, data = free_port(), tmp_path / ".rankscope"
    placed, served = [], set[str]()
    for _ in range(3):
        started = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        process = launch_demo(data, port)
        try:
            demo = Demo(process, f"http://127.0.0.1:{port}", data)
            placed.append(sorted(r["runnerId"] for r in demo.get("/v1/placement/runners")))
            chat = demo.post(
                "/v1/chat/completions",
                {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            )
            now_served = _acknowledged(demo, started)
            assert chat["id"] in now_served
            assert not now_served & served, "a chat of an earlier run ran again"
            served |= now_served
            incidents = demo.get("/v1/cluster/diagnosis/history")["findings"]
            assert incidents == [], json.dumps(incidents, indent=1)[:3000]
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=20) == 0
        finally:
            stop_up(process)
    assert placed[0] == placed[1] == placed[2], "placed again on restart"
    assert all("-a0-" in runner for runner in placed[2])  # the first and only incarnation


def test_timeline_shows_both_ranks_generating(demo: Demo) -> None:
    def generated() -> Any:
        timeline = demo.get("/v1/cluster/timeline?limit=5000")
        phases = {(e["deviceRank"], e["phase"]) for e in timeline["timeline"]}
        wanted = {(r, p) for r in (0, 1) for p in ("decode_stream", "completion")}
        return timeline if wanted <= phases else None

    timeline = demo.until(generated, 60)
    assert [r["deviceRank"] for r in timeline["runners"]] == [0, 1]


def test_skulk_s_dashboard_reads_every_node_of_the_demo(demo: Demo) -> None:
    cluster = skulk_shapes.ClusterDiagnostics.model_validate(demo.get("/v1/diagnostics/cluster"))
    assert [(n.node_id, n.ok) for n in cluster.nodes] == [("node-a", True), ("node-b", True)]
    runners = [r for n in cluster.nodes if n.diagnostics for r in n.diagnostics.supervisor_runners]
    assert sorted(r.device_rank for r in runners) == [0, 1]
    assert all(r.flight_recorder and r.status_kind for r in runners)


def test_skulk_s_capture_has_each_runner_s_stacks_twice(demo: Demo) -> None:
    runner = demo.get("/v1/placement/runners")[0]
    body = {"runnerId": runner["runnerId"], "sampleDurationSeconds": 1}
    captured = skulk_shapes.DiagnosticCaptureResponse.model_validate(
        demo.post(f"/v1/diagnostics/cluster/{runner['nodeId']}/capture", body)
    )
    assert captured.runner is not None
    assert captured.runner.runner_id == runner["runnerId"]
    assert captured.flight_recorder
    assert [s.name for s in captured.process_samples] == [
        f"stacks of {runner['runnerId']} at the start",
        f"stacks of {runner['runnerId']} after 1s",
    ]
    assert all(s.ok and s.stdout and "File " in s.stdout for s in captured.process_samples)


def test_skulk_s_cancel_stops_a_long_generation(demo: Demo) -> None:
    body = {"model": "demo", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 4000}
    answers: list[int] = []

    def ask() -> None:
        try:
            demo.post("/v1/chat/completions", body)
            answers.append(200)
        except urllib.error.HTTPError as error:
            answers.append(error.code)

    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 2))
    threading.Thread(target=ask, daemon=True).start()

    def ours(task_id: str) -> bool:
        """Whether `task_id` is this chat's, not one of the demo's own short chats."""
        query = f"instanceId=demo-0&since={since}&limit=100000"
        timeline = demo.get(f"/v1/cluster/timeline?{query}")["timeline"]
        return any(
            e["taskId"] == task_id
            and e["event"] == "first_token"
            and e["attrs"]["max_tokens"] == 4000
            for e in timeline
        )

    def active() -> Any:
        for node in demo.get("/v1/diagnostics/cluster")["nodes"]:
            held = node["diagnostics"] or {}  # none from a node that did not answer in time
            for runner in held.get("supervisorRunners", []):
                task = runner["activeTaskId"]
                if task and runner["phase"] == "decode_stream" and ours(task):
                    return node["nodeId"], runner["runnerId"], task
        return None

    node_id, runner_id, task_id = demo.until(active, 60)
    path = f"/v1/diagnostics/cluster/{node_id}/runners/{runner_id}/cancel"
    first = skulk_shapes.RunnerTaskCancelResponse.model_validate(
        demo.post(path, {"taskId": task_id})
    )
    assert first.status == "cancel_requested"
    demo.until(lambda: answers, 60)  # the chat ends long before its 4000 tokens
    again = skulk_shapes.RunnerTaskCancelResponse.model_validate(
        demo.until(lambda: _settled_cancel(demo, path, task_id), 30)
    )
    assert again.status == "already_cancelled"


def _settled_cancel(demo: Demo, path: str, task_id: str) -> Any:
    answer = demo.post(path, {"taskId": task_id})
    return answer if answer["status"] != "cancel_requested" else None


def test_placement_covers_every_layer_in_two_shards(demo: Demo) -> None:
    ranks = demo.get("/v1/placement/runners")
    assert [r["deviceRank"] for r in ranks] == [0, 1]
    layers = [layer for r in ranks for layer in range(r["startLayer"], r["endLayer"])]
    assert layers == list(range(ranks[0]["nLayers"]))
    assert {r["nodeId"] for r in ranks} == {"node-a", "node-b"}


def test_rank_table_is_completed_with_two_devices(demo: Demo) -> None:
    table = json.loads(demo.get("/v1/jobs/demo-0/ranktable")["rankTable"])
    assert table["status"] == "completed"
    devices = [d for s in table["server_group_list"][0]["server_list"] for d in s["device"]]
    assert sorted(d["rank_id"] for d in devices) == ["0", "1"]


def test_a_chat_completion_shows_in_the_timeline(demo: Demo) -> None:
    reply = demo.post(
        "/v1/chat/completions",
        {"model": "demo", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8},
    )
    assert reply["choices"][0]["message"]["content"]
    assert reply["usage"]["completion_tokens"] >= 1
    command = reply["id"]
    demo.until(
        lambda: any(
            e["commandId"] == command
            for e in demo.get("/v1/cluster/timeline?limit=5000")["timeline"]
        ),
        10,
    )


def test_the_server_refused_nothing_rankscope_did(demo: Demo) -> None:
    demo.post(
        "/v1/chat/completions",
        {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    log = (demo.data / "nats" / "nats-server.log").read_text()
    assert "Violation" not in log, [line for line in log.splitlines() if "Violation" in line]


def test_a_frozen_runner_is_named_and_clears(demo: Demo) -> None:
    runners = demo.get("/v1/cluster/timeline?limit=1")["runners"]
    frozen = next(r for r in runners if r["deviceRank"] == 1)
    os.kill(frozen["pid"], signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        # named at once (held behind its waiting peer, or silent), a stall once silent
        finding = demo.until(
            lambda: next(
                (
                    f
                    for f in demo.get("/v1/cluster/diagnosis")["findings"]
                    if frozen["runnerId"] in f["culpritRunnerIds"] and f["kind"] == "stalled_rank"
                ),
                None,
            ),
            30,
        )
        assert finding["culpritRanks"] == [1]
        assert finding["waitingRanks"] == [0]

        def with_stacks() -> Any:
            found = demo.get("/v1/cluster/diagnosis")["findings"]
            return next((f for f in found if any(e.get("stack") for e in f["evidence"])), None)

        finding = demo.until(with_stacks, 15)  # captured by the agents as it opened
        page = browse(demo.base, ARTIFACTS / "timeline.png")
        stopped = f"{time.monotonic() - frozen_at:.0f}s after SIGSTOP"
        assert "stalled rank" in page.lower(), f"{stopped}: {shown(page)}"  # on the page
        assert "process stopped" in page  # the frozen rank, as the kernel says
        assert "its process is stopped (SIGSTOP or a debugger)" in page  # why no stack
        assert "culprit rank 1 · since " in page  # the culprit leads the banner
        assert re.search(r"rank [01] · node-[ab]: active \d", page)  # each rank's MLX memory
        assert re.search(r"rank [01] · node-[ab]: [\d.]+ ms work, [\d.]+ ms wait", page)  # pace
        assert "incidents (" in page  # and the incidents to open
        # the line its peer is on, from its stack: meeting the frozen rank in the task
        # agreement, or (frozen between chats, before its next tick) waiting for work
        assert re.search(r"in _(agree|wait)\b", page)
        assert "no progress since" in page  # on the frozen rank's lane
        assert re.search(r"node-[ab] \[0, \d+\)", page)  # the placement bar
        assert "2 ranks" in page  # both lanes
    finally:
        os.kill(frozen["pid"], signal.SIGCONT)
    demo.until(lambda: not demo.get("/v1/cluster/diagnosis")["findings"], 30)


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:  # reaped
        return True


def test_a_runner_dies_with_its_agent_even_inside_a_collective(demo: Demo) -> None:
    runners = {r["deviceRank"]: r for r in demo.get("/v1/cluster/timeline?limit=1")["runners"]}
    stuck, frozen = runners[0]["pid"], runners[1]["pid"]
    titles = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in (stuck, _parent(stuck))]
    assert titles[0].startswith(b"rankscope runner demo-0 rank 0 node-"), titles  # as ps shows
    assert titles[1].startswith(b"rankscope agent node-"), titles
    os.kill(frozen, signal.SIGSTOP)  # rank 0 now waits on it in the task agreement
    try:
        time.sleep(3)
        os.kill(_parent(stuck), signal.SIGKILL)  # its agent dies without a word
        deadline = time.monotonic() + 5
        while not _gone(stuck) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(stuck), "a runner outlived its agent"
    finally:
        os.kill(frozen, signal.SIGCONT)
    short = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    demo.until(  # `up` restarts the agent; the instance serves again (a chat says so: both
        # ranks may look ready a moment before the peer of the killed rank restarts too)
        lambda: demo.post("/v1/chat/completions", short)["choices"],
        200,  # CI, loaded by the other worker's tests, once took longer than 120 s
    )


def test_ctrl_c_during_a_long_generation_leaves_no_process(demo: Demo) -> None:
    body = {"model": "demo", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 4000}
    answered: list[str] = []

    def ask() -> None:
        try:
            demo.post("/v1/chat/completions", body)
        except urllib.error.HTTPError as exc:  # said when the ranks never start decoding
            answered.append(f"{exc.code} {exc.read()[:500]!r}")
        except OSError:  # cut off by the shutdown
            pass

    threading.Thread(target=ask, daemon=True).start()
    seen: list[object] = []

    def generating() -> bool:
        runners = demo.get("/v1/cluster/timeline?limit=1")["runners"]
        seen[:] = [(r["deviceRank"], r["statusKind"], r["phase"]) for r in runners]
        return all(r["phase"] == "decode_stream" for r in runners)

    try:
        demo.until(generating, 60)
    except AssertionError as exc:
        findings = demo.get("/v1/cluster/diagnosis")["findings"]
        raise AssertionError(f"{exc}: ranks {seen}, chat {answered}, findings {findings}") from None
    runners = demo.get("/v1/cluster/timeline?limit=1")["runners"]
    # rank 1 frozen: rank 0 blocks inside a collective, where no signal handler runs
    os.kill(next(r["pid"] for r in runners if r["deviceRank"] == 1), signal.SIGSTOP)
    time.sleep(1)
    everything = _descendants(demo.process.pid)
    assert len(everything) >= 6  # nats, 3 services, 2 agents, their runners
    demo.process.send_signal(signal.SIGINT)  # what Ctrl-C sends to `up`
    assert demo.process.wait(timeout=20) == 0
    deadline = time.monotonic() + 2  # a killed runner's watching shell: its next check
    while (left := [pid for pid in everything if not _gone(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes left behind: {left}"
