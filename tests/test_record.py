"""End to end: `rankscope record` around real `mlx.launch` ring jobs on loopback, into a
real `rankscope up` (NATS, rank-table service, two aggregator partitions, gateway): each
job is followed by the partition it hashes to, as a placed instance is. A recorded run prints
and ends as it does unrecorded, a stopped rank is named and its waiting peers never are, a
killed rank is a dead rank with its signal, a desync is named with both collectives, and
with NATS gone the program runs on unharmed."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest

from rankscope.shared.partitions import partition_of
from rankscope.shared.subjects import token
from rankscope.shared.tiny_model import TinyModelSpec, write_tiny_model
from tests.browser import ARTIFACTS, browse, shown
from tests.recorded import Stack, end, ended, launched, rank_pids, recording_stack
from tests.stack_up import free_port

pytestmark = [pytest.mark.slow, pytest.mark.mlx, pytest.mark.nats, pytest.mark.timeout(240)]

TRAIN = """
import sys, time
import mlx.core as mx
group = mx.distributed.init()
rank = group.rank()
steps = int(sys.argv[1])
weights = mx.ones((256,))
for step in range(steps):
    gradient = mx.sin(weights * (rank + 1) + step)
    weights = weights - 0.01 * mx.distributed.all_sum(gradient) / group.size()
    mx.eval(weights)
    time.sleep(0.01)
print(f"rank {rank} checksum {float(weights.sum()):.6f}", flush=True)
"""

DESYNC = """
import mlx.core as mx
group = mx.distributed.init()
for step in range(20):
    mx.eval(mx.distributed.all_sum(mx.ones((64,))))
if group.rank() == 0:
    late = mx.distributed.all_sum(mx.ones((4096,)))
else:  # waits for far more than rank 0 ever sends it
    late = mx.distributed.recv(shape=(65536,), dtype=mx.float32, src=0)
mx.eval(late)
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with recording_stack(tmp_path_factory) as found:
        yield found


def _rank_pid(script: str, rank: int) -> int:
    """The process of `rank` running `script`, by the title recording gives it
    (`python train.py [rankscope train-7 rank 1]`)."""
    for process in psutil.process_iter(["cmdline"]):
        title = process.info["cmdline"] or []
        if script in title and " ".join(title).endswith(f" rank {rank}]"):
            return int(process.pid)
    raise AssertionError(f"no rank {rank} of {script}")


def test_a_recorded_run_prints_and_ends_as_it_does_unrecorded(stack: Stack) -> None:
    train = stack.script("train.py", TRAIN)
    plain_code, plain_out, _ = ended(launched(stack.launch(2, train, "40")))
    code, out, err = ended(stack.record("run-1", stack.launch(2, train, "40")))
    assert (code, out) == (plain_code, plain_out)
    assert [line.split()[:2] for line in out] == [["rank", "0"], ["rank", "1"]]
    assert "sitecustomize" not in err

    def both_exits() -> list[dict[str, Any]]:
        timeline = stack.get("/v1/cluster/timeline?instanceId=run-1")["timeline"]
        return [e for e in timeline if e["event"] == "program_exit"]

    def ranks() -> list[tuple[int, str]]:
        runners = stack.get("/v1/cluster/timeline?instanceId=run-1")["runners"]
        return sorted((r["deviceRank"], r["statusKind"]) for r in runners)

    stack.until(lambda: ranks() == [(0, "RunnerShutdown"), (1, "RunnerShutdown")], 15)
    exits = stack.until(lambda: len(both_exits()) == 2 and both_exits(), 15)
    timeline = stack.get("/v1/cluster/timeline?instanceId=run-1")["timeline"]
    assert sorted(e["deviceRank"] for e in timeline if e["event"] == "group_ready") == [0, 1]
    assert {e["detail"] for e in exits} == {"after 40 collectives"}
    stack.until(  # released once both ended cleanly
        lambda: not any(r["instanceId"] == "run-1" for r in stack.get("/v1/placement/runners")),
        15,
    )
    assert stack.get("/v1/cluster/diagnosis/history?instanceId=run-1")["findings"] == []


def test_a_recorded_job_reads_in_its_own_words_in_ps_the_api_and_the_page(stack: Stack) -> None:
    train = stack.script("steps.py", TRAIN)
    job = stack.record("words-1", stack.launch(2, train, "100000"))
    try:

        def stepping() -> list[dict[str, Any]]:
            timeline = stack.get("/v1/cluster/timeline?instanceId=words-1")["timeline"]
            return [e for e in timeline if e["event"] == "steps"]

        steps = stack.until(
            lambda: len({e["deviceRank"] for e in stepping()}) == 2 and stepping(), 30
        )
        assert steps[-1]["detail"].endswith(
            f" collectives, the last all_sum #{steps[-1]['attrs']['step']} (group world)"
        )
        runners = stack.get("/v1/cluster/timeline?instanceId=words-1")["runners"]
        assert [r.get("recorded") for r in runners] == [True, True]
        title = psutil.Process(_rank_pid(train, 1)).cmdline()
        assert title[-4:] == ["[rankscope", "words-1", "rank", "1]"]
        page = browse(stack.base, ARTIFACTS / "timeline-recorded.png")
        assert "job words-1 (recorded): 2 ranks on " in page, shown(page)  # no layer bars
        lanes = re.search(r'<canvas id="lanes"[^>]*>(.*?)</canvas>', page, re.S)
        assert lanes is not None
        assert re.search(r"rank 1 · \S+ · \d+ collectives, the last all_sum #\d+", lanes.group(1))
    finally:
        job.send_signal(signal.SIGINT)
        ended(job)


def test_a_stopped_rank_is_named_within_10s_and_in_every_sample_until_continued(
    stack: Stack,
) -> None:
    train = stack.script("forever.py", TRAIN)
    job = stack.record("stop-1", stack.launch(4, train, "100000"))
    try:
        stack.until(
            lambda: len(stack.get("/v1/cluster/timeline?instanceId=stop-1")["runners"]) == 4, 30
        )
        time.sleep(2)
        stopped = _rank_pid(train, 2)
        os.kill(stopped, signal.SIGSTOP)
        frozen_at = time.monotonic()
        (finding,) = stack.until(lambda: stack.findings("stop-1"), 10)
        named_after = time.monotonic() - frozen_at
        assert finding["kind"] == "stalled_rank", finding
        samples = [finding]
        while time.monotonic() - frozen_at < named_after + 6:
            samples += stack.findings("stop-1") or [{"culpritRanks": "none"}]
            time.sleep(0.5)
        assert {(tuple(s["culpritRanks"]), s["kind"]) for s in samples} == {
            ((2,), "stalled_rank")
        }, samples
        assert 2 not in samples[-1]["waitingRanks"]

        def evidence() -> dict[int, dict[str, Any]]:
            (found,) = stack.findings("stop-1")
            return {e["deviceRank"]: e for e in found["evidence"] if e.get("capturedAt")}

        captured = stack.until(lambda: len(evidence()) == 4 and evidence(), 10)
        assert captured[2]["process"] == "stopped"  # its watcher saw it, as an agent would
        assert captured[2]["stack"] is None  # a stopped process writes nothing
        assert "forever.py" in captured[0]["stack"]  # a waiting rank's stack, from its collective
        os.kill(stopped, signal.SIGCONT)
        stack.until(lambda: not stack.findings("stop-1"), 10)
    finally:
        end(job, train)


def test_a_killed_rank_is_a_dead_rank_with_its_signal(stack: Stack) -> None:
    train = stack.script("killed.py", TRAIN)
    job = stack.record("kill-1", stack.launch(2, train, "100000"))
    try:
        stack.until(
            lambda: len(stack.get("/v1/cluster/timeline?instanceId=kill-1")["runners"]) == 2, 30
        )
        time.sleep(2)
        os.kill(_rank_pid(train, 1), signal.SIGKILL)
        killed_at = time.monotonic()
        (finding,) = stack.until(lambda: stack.findings("kill-1"), 10)
        assert time.monotonic() - killed_at < 10
        assert finding["kind"] == "dead_rank"
        assert finding["culpritRanks"] == [1], finding["summary"]
        assert "killed by SIGKILL" in finding["summary"]
        assert finding["waitingRanks"] == [0]
        assert "rank 0" in finding["summary"]
    finally:
        end(job, train)  # mlx.launch stopped the other rank already


@pytest.mark.parametrize("sent", [signal.SIGINT, signal.SIGTERM])
def test_a_job_the_user_stops_is_stopped_not_an_incident(
    stack: Stack, sent: signal.Signals
) -> None:
    train = stack.script(f"stopped-{sent.name}.py", TRAIN)
    job_id = f"stop-{sent.name.lower()}"
    job = stack.record(job_id, stack.launch(2, train, "100000"))
    stack.until(
        lambda: len(stack.get(f"/v1/cluster/timeline?instanceId={job_id}")["runners"]) == 2, 30
    )
    time.sleep(2)
    job.send_signal(sent)  # as Ctrl-C, systemd or `kill <pid>` would
    job.communicate(timeout=60)
    assert rank_pids(train) == []  # none left running

    def stopped() -> bool:
        runners = stack.get(f"/v1/cluster/timeline?instanceId={job_id}")["runners"]
        return [r["statusKind"] for r in runners] == ["RunnerShutdown"] * 2

    assert stack.until(stopped, 20)
    time.sleep(3)  # judged a few times over
    assert stack.findings(job_id) == []
    told = stack.get("/v1/cluster/diagnosis/history")["findings"]
    assert [f for f in told if f["instanceId"] == job_id] == []


def test_ranks_waiting_in_different_collectives_are_named_with_both(stack: Stack) -> None:
    desync = stack.script("desync.py", DESYNC)
    job = stack.record("desync-1", stack.launch(2, desync))
    try:
        (finding,) = stack.until(lambda: stack.findings("desync-1"), 30)
        assert finding["kind"] == "rank_disagreement", finding["summary"]
        assert "all_sum #21 (group world)" in finding["summary"]
        assert "recv #21 (group world)" in finding["summary"]
    finally:
        end(job, desync)


def test_mlx_lm_s_own_distributed_server_recorded_serves_and_a_frozen_rank_is_named(
    stack: Stack,
) -> None:
    model = write_tiny_model(stack.scripts / "tiny", TinyModelSpec(layers=4))
    port = free_port()
    server = ["-m", "mlx_lm", "server", "--model", str(model), "--port", str(port)]
    job = stack.record("server-1", stack.launch(2, *server))
    chat = f"http://127.0.0.1:{port}/v1/chat/completions"

    def ask(tokens: int) -> Any:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens}
        request = urllib.request.Request(chat, data=json.dumps(body).encode())
        request.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(request, timeout=60) as reply:
            return json.loads(reply.read())

    def answered() -> Any:
        try:
            return ask(4)
        except OSError:
            return None

    try:
        assert stack.until(answered, 90)["usage"]["completion_tokens"] == 4
        threading.Thread(target=answered_long, args=(ask,), daemon=True).start()
        time.sleep(2)  # decoding
        frozen = _rank_pid("mlx_lm", 1)
        os.kill(frozen, signal.SIGSTOP)
        try:
            (finding,) = stack.until(lambda: stack.findings("server-1"), 10)
        finally:
            os.kill(frozen, signal.SIGCONT)
        assert (finding["kind"], finding["culpritRanks"]) == ("stalled_rank", [1])
        assert "rank 0 (" in finding["summary"].split("; ")[1]  # waiting, not named
    finally:
        end(job, "mlx_lm")


def answered_long(ask: Callable[[int], Any]) -> None:
    """A long generation, whatever becomes of it."""
    with contextlib.suppress(OSError):
        ask(100_000)


def test_with_nats_gone_the_program_runs_on_and_ends_the_same(stack: Stack) -> None:
    train = stack.script("offline.py", TRAIN)
    nowhere = f"nats://127.0.0.1:{free_port()}"
    plain = ended(launched(stack.launch(2, train, "40")))
    job = stack.record(None, stack.launch(2, train, "40"), nats=nowhere, give_up="2s")
    assert ended(job) == (0, *plain[1:])

    def watchers() -> list[int]:
        found = []
        for process in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                watcher = "rankscope.services.record.watcher" in (process.info["cmdline"] or [])
                if watcher and process.environ().get("RANKSCOPE_NATS_URL") == nowhere:
                    found.append(process.pid)
        return found

    stack.until(lambda: not watchers(), 15)  # they gave up on NATS, and went


INSIDE = """
from rankscope.services.record import start, step
start(job="inside-1", node="node-in")
import mlx.core as mx
group = mx.distributed.init()
for _ in range(3):
    with step("forward"):
        mx.eval(mx.distributed.all_sum(mx.ones((8,))))
print("done", group.rank(), flush=True)
"""


def test_a_program_switches_recording_on_itself_and_names_its_steps(stack: Stack) -> None:
    inside = stack.script("inside.py", INSIDE)
    env = {**os.environ, "RANKSCOPE_NATS_URL": stack.nats}
    code, out, err = ended(launched(stack.launch(2, inside), env=env))
    assert (code, out) == (0, ["done 0", "done 1"]), err

    def steps() -> list[dict[str, Any]]:
        timeline = stack.get("/v1/cluster/timeline?instanceId=inside-1")["timeline"]
        return [e for e in timeline if e["event"] == "step_started"]

    named = stack.until(lambda: len(steps()) == 6 and steps(), 15)
    assert {(e["nodeId"], e["detail"]) for e in named} == {("node-in", "forward")}


def test_ranks_recorded_one_by_one_agree_on_one_job(stack: Stack) -> None:
    train = stack.script("each.py", TRAIN)
    record = [sys.executable, "-m", "rankscope.services.cli", "record", "--", sys.executable]
    command = stack.launch(2, train, "300")
    command[command.index("--") + 1 :] = [*record, train, "300"]
    job = launched(command, env={**os.environ, "RANKSCOPE_NATS_URL": stack.nats})

    def drawn() -> list[dict[str, Any]]:
        runners = stack.get("/v1/cluster/timeline")["runners"]
        return [r for r in runners if r["instanceId"].startswith("job-")]

    ranks = stack.until(lambda: len(drawn()) == 2 and drawn(), 30)
    assert {r["instanceId"] for r in ranks} == {ranks[0]["instanceId"]}
    assert sorted(r["deviceRank"] for r in ranks) == [0, 1]
    code, out, _ = ended(job)
    assert (code, len(out)) == (0, 2)


def test_the_jobs_here_land_in_both_partitions() -> None:
    jobs = ["run-1", "stop-1", "kill-1", "desync-1", "server-1"]
    assert {partition_of(token(job), 2) for job in jobs} == {0, 1}
