"""The CLI clients against a real gateway: tables, --json, exit codes, one-line errors."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import os
import re
import subprocess
import sys
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rankscope.services.client.verdicts import finding_lines
from tests.gateway.conftest import Stack

pytestmark = pytest.mark.nats

REPO = Path(__file__).parent.parent.parent
SPEC = {
    "id": "llm",
    "worker": {"model": {"id": "tiny"}},
    "compute_info": {"num_accelerators": 2},
    "num_replicas": 1,
    "metadata": {"nLayers": 8, "modelBytes": "4Gi"},
}


async def cli(*args: str) -> tuple[int, str, str]:
    run = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "rankscope.services.cli",
        *args,
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await run.communicate()
    return run.returncode or 0, out.decode(), err.decode()


async def test_runners_placement_ranktable_and_diagnose(stack_for: Any, tmp_path: Path) -> None:
    stack: Stack = await stack_for()
    url = str(stack.http.base_url).rstrip("/")
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SPEC))
    code, out, _ = await cli("runners", "--url", url, "create", str(spec))
    assert (code, out.startswith("created llm, placed:\n  llm-0: ")) == (0, True), out
    code, _, err = await cli("runners", "create", str(spec), "--url", url)
    assert (code, err) == (1, "rankscope: 409: runner 'llm' already exists\n")
    code, out, _ = await cli("runners", "create", "--if-missing", str(spec), "--url", url, "--json")
    assert (code, json.loads(out)) == (0, {"llm": "exists"})  # as compose's demo runs it
    huge = tmp_path / "huge.json"
    huge.write_text(
        json.dumps({**SPEC, "id": "huge", "metadata": {"nLayers": 8, "modelBytes": "9Ti"}})
    )
    code, out, _ = await cli("runners", "create", str(huge), "--url", url)
    assert (code, out.startswith("created huge, not placed (it waits for room): ")) == (0, True)
    await cli("runners", "delete", "huge", "--url", url)
    code, out, _ = await cli("runners", "--url", url, "list")
    assert code == 0
    assert out.splitlines()[0].split() == [
        "ID",
        "MODEL",
        "RANKS",
        "REPLICAS",
        "PRIORITY",
        "PODS",
        "RUNNING",
    ]
    assert out.splitlines()[1].split()[:4] == ["llm", "tiny", "2", "1"]
    for _ in range(100):
        code, out, _ = await cli("placement", "--url", url, "--json")
        if code == 0 and len(json.loads(out)) == 2:
            break
        await asyncio.sleep(0.1)
    assert [p["startLayer"] for p in json.loads(out)] == [0, 6]
    assert {p["instanceId"] for p in json.loads(out)} == {"llm-0"}
    code, _, err = await cli("placement", "--url", url, "--pid", "llm-0:1")
    assert (code, err) == (1, "rankscope: rank 1 of llm-0 has not said its process id yet\n")
    code, _, err = await cli("placement", "--url", url, "--pid", "llm-0:9")
    assert (code, err) == (1, "rankscope: no rank 9 of llm-0 is placed\n")
    code, _, err = await cli("placement", "--url", url, "--pid", "llm-0")
    assert code == 2
    assert "expected INSTANCE:RANK such as demo-0:1" in err
    code, out, _ = await cli("ranktable", "llm-0", "--url", url)
    assert code == 0
    assert json.loads(out)["status"] == "initializing"
    # The nodes are inventory entries with no agent behind them: once the aggregator's
    # probes go unanswered, their ranks are dead and `diagnose` says so with exit code 1.
    for _ in range(100):
        code, out, _ = await cli("diagnose", "--url", url)
        if code == 1:
            break
        assert out == "no findings: every instance is healthy\n"
        await asyncio.sleep(0.1)
    assert out.startswith("dead_rank llm-0: rank 0 (node-a): node unreachable")
    assert re.search(
        r"\(since \d\d:\d\d:\d\dZ \(\d+s ago\); incident [0-9a-f]{16}\)$", out.splitlines()[0]
    )
    code, out, _ = await cli("diagnose", "--url", url, "--verbose")
    assert code == 1
    assert "\n  CULPRIT rank 0 (node-a): " in out
    for narrowed in (["--instance", "other"], ["--kind", "stalled_rank"]):
        code, out, _ = await cli("diagnose", "--url", url, *narrowed)
        assert (code, out) == (0, "no findings: every instance is healthy\n"), narrowed
    code, out, _ = await cli("diagnose", "--url", url, "--instance", "llm-0", "--kind", "dead_rank")
    assert (code, out.startswith("dead_rank llm-0: ")) == (1, True)
    code, out, _ = await cli("placement", "--url", url)
    assert code == 0
    assert out.splitlines()[0].split()[-1] == "DIAGNOSIS"
    assert re.search(r"llm-0-a0-r0 .* <- dead_rank since \d\d:\d\d:\d\dZ", out), out
    for _ in range(100):  # kept in the diagnosis stream once published
        code, out, _ = await cli("diagnose", "--url", url, "--history")
        if "\ndead_rank" in out:
            break
        await asyncio.sleep(0.1)
    assert code == 0  # history is not an alarm
    said, first = out.splitlines()[:2]
    assert said.startswith("incidents the diagnosis stream still holds (its retention): ")
    assert first.startswith("dead_rank llm-0: rank 0 (node-a): node unreachable")
    incident = first.rsplit("incident ", 1)[1].rstrip(")")
    bundle = tmp_path / "incident.tar.gz"
    code, out, _ = await cli("diagnose", "--url", url, "--bundle", incident, "-o", str(bundle))
    assert (code, out.startswith(f"wrote {bundle} (")) == (0, True)
    with tarfile.open(bundle) as tar:
        assert f"incident-{incident}/incident.json" in tar.getnames()
    code, _, err = await cli("diagnose", "--url", url, "--bundle", "nope")
    assert (code, err.startswith("rankscope: 404: no incident 'nope'")) == (1, True)
    code, out, _ = await cli("timeline", "--url", url, "--json")
    assert code == 0
    assert set(json.loads(out)) >= {"runners", "timeline", "unreachableNodes"}
    read, write = os.pipe()
    os.close(read)  # as `| head` does once it has read enough: nobody reads what follows
    piped = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rankscope.services.cli", "timeline", "--url", url,
        cwd=REPO, stdout=write, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    os.close(write)
    _, err_bytes = await piped.communicate()
    assert (piped.returncode, err_bytes.decode()) == (0, "")  # no BrokenPipeError traceback


async def test_errors_are_one_line_with_a_non_zero_exit(stack_for: Any) -> None:
    stack: Stack = await stack_for()
    url = str(stack.http.base_url).rstrip("/")
    code, out, err = await cli("runners", "--url", url, "delete", "nope")
    assert (code, out) == (1, "")
    assert err == "rankscope: 404: runner 'nope' not found\n"
    code, out, err = await cli("runners", "--url", url, "delete", "a?b c#")
    assert (code, err) == (1, "rankscope: 404: runner 'a?b c#' not found\n")
    code, out, err = await cli("runners", "--url", url, "delete", "*" * 200)
    assert (code, out) == (2, "")
    assert err == (
        "rankscope runners delete: argument id: an id of 200 characters escapes to 600 (`.`, "
        "`*`, `>`, white space and non-ASCII take 3 per byte), over the limit of 512 "
        "(see --help)\n"
    )
    code, _, err = await cli("placement", "--url", "http://127.0.0.1:1")
    assert code == 1
    assert err.startswith("rankscope: cannot reach http://127.0.0.1:1")
    assert len(err.splitlines()) == 1


class _AnswersJson(http.server.BaseHTTPRequestHandler):
    """Some other JSON API: `{}` for every path."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *_: Any) -> None:
        pass


@contextlib.contextmanager
def _not_rankscope(
    handler: type[http.server.BaseHTTPRequestHandler] = http.server.SimpleHTTPRequestHandler,
) -> Iterator[str]:
    """Some other web server: by default HTML, and 404 for every API path."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


async def test_what_is_not_a_spec_or_not_rankscope_is_one_line_too(tmp_path: Path) -> None:
    code, out, err = await cli("runners", "create", str(tmp_path / "missing.json"))
    assert (code, out) == (1, "")
    assert err.startswith("rankscope: cannot read the spec file ")
    assert len(err.splitlines()) == 1
    broken = tmp_path / "broken.json"
    broken.write_text('{"id": ')
    code, _, err = await cli("runners", "create", str(broken))
    assert code == 1
    assert err.startswith(f"rankscope: cannot read the spec file {broken}: Expecting value")
    with _not_rankscope() as url:
        code, _, err = await cli("placement", "--url", url)
    assert code == 1
    assert err == f"rankscope: 404: File not found (not rankscope's gateway at {url}?)\n"
    with _not_rankscope(_AnswersJson) as url:
        code, _, err = await cli("ranktable", "job-0", "--follow", "--url", url)
    assert code == 1
    assert err == (
        f"rankscope: {url}/v1/jobs/job-0/ranktable/stream is not an event stream "
        "(not rankscope's gateway?)\n"
    )


async def test_following_a_job_with_no_table_yet_says_it_waits(stack_for: Any) -> None:
    stack: Stack = await stack_for()
    url = str(stack.http.base_url).rstrip("/")
    follower = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rankscope.services.cli", "ranktable", "later-0", "--follow",
        "--url", url,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert follower.stderr is not None
        line = await asyncio.wait_for(follower.stderr.readline(), 30)
        assert line.decode() == (
            "rankscope: job 'later-0' has no rank table yet; waiting for its first (Ctrl-C stops)\n"
        )
        assert follower.returncode is None  # and it waits
    finally:
        follower.kill()
        await follower.wait()


def test_an_incident_rankscope_did_not_watch_for_a_while_says_from_when_to_when() -> None:
    finding = {
        "instanceId": "demo-0",
        "kind": "stalled_rank",
        "summary": "rank 1 (node-b) went silent",
        "since": "2026-01-02T12:00:00Z",
        "open": False,
        "clearedAt": "2026-01-02T12:20:00Z",
        "culpritRunnerIds": [],
        "unwatchedSince": "2026-01-02T12:00:10Z",
        "unwatchedUntil": "2026-01-02T12:15:57Z",
    }
    said = finding_lines(finding, verbose=False)[1]
    assert said.startswith("  rankscope did not watch it from 2026-01-02 12:00:10Z")
    assert " to 2026-01-02 12:15:57Z" in said
    assert said.endswith(": what happened meanwhile was not seen")


def test_diagnose_verbose_says_how_long_the_job_waits_for_each_rank() -> None:
    def rank(index: int, waited_on: float, last: float) -> dict[str, Any]:
        pace = {"steps": 160, "workMs": 5.8, "waitMs": 0.4, "waitedOn": waited_on,
                "lastArrival": last, "workVsPeers": 1.27}  # fmt: skip
        return {"runnerId": f"dp-1-r{index}", "nodeId": "vm", "deviceRank": index, "pace": pace}

    finding = {
        "instanceId": "dp-1",
        "kind": "slow_rank",
        "summary": "rank 2 (vm) is the straggler",
        "since": "2026-01-02T12:00:00Z",
        "culpritRunnerIds": ["dp-1-r2"],
        "evidence": [rank(0, 0.02, 0.12), rank(2, 0.23, 0.81)],
    }
    culprit, waiting = finding_lines(finding, verbose=True)[1:]
    assert culprit == (
        "  CULPRIT rank 2 (vm): work 5.8 ms a step, wait 0.4 ms; the job loses 23% of its "
        "time waiting for it, last to arrive on 81% of its steps"
    )
    assert waiting.startswith("  waiting rank 0 (vm): ")
    assert waiting.endswith(
        "loses 2% of its time waiting for it, last to arrive on 12% of its steps"
    )


def test_diagnose_verbose_says_what_a_pipeline_loses_to_each_stage() -> None:
    pace = {"steps": 150, "workMs": 1.9, "waitMs": 1.1, "waitedOn": 0.15, "lastArrival": 0.9,
            "workVsPeers": 1.4, "layers": 2}  # fmt: skip
    finding = {
        "instanceId": "demo-0",
        "kind": "slow_rank",
        "summary": "rank 1 (node-a) is the straggler",
        "since": "2026-01-02T12:00:00Z",
        "culpritRunnerIds": ["demo-0-r1"],
        "evidence": [{"runnerId": "demo-0-r1", "nodeId": "node-a", "deviceRank": 1, "pace": pace}],
    }
    (culprit,) = finding_lines(finding, verbose=True)[1:]
    assert culprit == (
        "  CULPRIT rank 1 (node-a): work 1.9 ms a step, wait 1.1 ms; 2 layers, 1.4x its peers' "
        "work per layer; the pipeline loses 15% of its work a step to it, the most per layer in "
        "90% of the span"
    )


def test_ranktable_without_a_job_starts_no_service_but_says_what_to_give() -> None:
    for args in ([], ["job-0", "--serve"]):
        done = subprocess.run(
            [sys.executable, "-m", "rankscope.services.cli", "ranktable", *args],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 2
        assert done.stderr.splitlines() == [
            "rankscope ranktable: give a JOB to print its rank table, or --serve to run the "
            "rank-table service (see --help)"
        ]
