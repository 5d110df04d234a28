"""Every endpoint of the gateway against a real stack: shapes, status codes, errors."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import tarfile
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import msgspec
import pytest
from nats.aio.msg import Msg

from rankscope.shared.host import hostname
from rankscope.shared.timestamps import format_ts, now
from rankscope.shared.wire import (
    Finding,
    FindingKind,
    FlightEntry,
    InstanceCreated,
    InstanceState,
    Memory,
    MemorySampled,
    MlxMemorySnapshot,
    NodeDiagnostics,
    Phase,
    PhaseEntries,
    RankTableStatus,
    RunnerAssignment,
    RunnerRef,
    RunnerStatusChanged,
    RunnerStatusKind,
    TaskCreated,
    TaskEvent,
    TaskKind,
    TaskStatus,
    TaskStatusChanged,
    TokenChunk,
    decode,
    encode,
    incident_id,
)
from tests.agents_stand_in import answer_probes
from tests.aggregator.builders import placed
from tests.conftest import FIXTURES
from tests.gateway.conftest import Stack

pytestmark = pytest.mark.nats

SPEC: dict[str, Any] = {
    "id": "llm",
    "worker": {"model": {"id": "tiny"}},
    "nodepool": {"id": "default"},
    "compute_info": {"num_accelerators": 2},
    "num_replicas": 1,
    "metadata": {"nLayers": 8, "modelBytes": "4Gi"},
}


async def _until(check: Any) -> Any:
    for _ in range(200):  # 10 s
        found = await check()
        if found:
            return found
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached")


async def test_health_readiness_docs_and_metrics(stack_for: Any) -> None:
    stack: Stack = await stack_for()
    assert (await stack.http.get("/healthz")).json() == {"status": "ok"}
    assert (await stack.http.get("/readyz")).json() == {"status": "ready"}
    docs = await stack.http.get("/docs")
    assert docs.status_code == 200
    assert "cdn" not in docs.text  # works offline: every asset from the gateway itself
    for asset in re.findall(r'(?:src|href)="(/[^"]+)"', docs.text):
        assert (await stack.http.get(asset)).status_code == 200, asset
    schemas = (await stack.http.get("/openapi.json")).json()["components"]["schemas"]
    assert {"secondsInPhase", "lastMlxMemory"} <= set(schemas["RunnerSynopsis"]["properties"])
    assert "startLayer" in schemas["PlacementRunnerDiagnostics"]["properties"]
    metrics = (await stack.http.get("/metrics")).text
    assert "rankscope_nats_connected 1" in metrics
    assert "rankscope_nats_reachable 1" in metrics
    assert (
        'rankscope_http_requests_total{method="GET",route="/healthz",status="200"} 1.0' in metrics
    )
    assert "rankscope_aggregator_up 1" in metrics


async def test_runner_specs_crud_in_the_clarifai_shape(stack_for: Any) -> None:
    stack: Stack = await stack_for()
    http = stack.http
    created = await http.post("/v1/runners", json={"runners": [SPEC]})
    assert created.status_code == 200, created.text
    runner = created.json()["runners"][0]
    assert runner["id"] == "llm"
    assert runner["created_at"].endswith("Z")
    assert (await http.post("/v1/runners", json={"runners": [SPEC]})).status_code == 409
    for index in range(3):
        await http.post("/v1/runners", json={"runners": [{**SPEC, "id": f"extra-{index}"}]})
    listed = (await http.get("/v1/runners", params={"page": 2, "per_page": 3})).json()
    assert [r["id"] for r in listed["runners"]] == ["llm"]
    assert (await http.get("/v1/runners", params={"page": 9})).json()["runners"] == []

    async def placed() -> Any:
        body = (await http.get("/v1/runners/llm")).json()
        return body if body["placement"] and body["placement"]["instances"] else None

    one = await _until(placed)
    assert one["runner"]["runner_metrics"]["pods_total"] == 2
    merged = await http.patch(
        "/v1/runners/llm",
        json={"runner": {"labels": ["m2"], "metadata": {"owner": "ops"}}, "action": "merge"},
    )
    assert merged.json()["runner"]["labels"] == ["m2"]
    assert merged.json()["runner"]["metadata"] == {**SPEC["metadata"], "owner": "ops"}
    removed = await http.patch(
        "/v1/runners/llm",
        json={"runner": {"labels": ["m2"], "metadata": {"owner": None}}, "action": "remove"},
    )
    assert removed.json()["runner"]["labels"] == []
    assert "owner" not in removed.json()["runner"]["metadata"]
    overwritten = await http.patch(
        "/v1/runners/llm", json={"runner": {"num_replicas": 2}, "action": "overwrite"}
    )
    assert overwritten.json()["runner"]["num_replicas"] == 2
    assert (await http.delete("/v1/runners/llm")).status_code == 200
    missing = await http.get("/v1/runners/llm")
    assert missing.status_code == 404
    assert missing.json() == {"detail": "runner 'llm' not found"}


async def test_long_lists_merge_and_remove_item_by_item_without_holding_the_gateway(
    stack_for: Any,
) -> None:
    stack: Stack = await stack_for()
    first = [f"a{n}" for n in range(40_000)]
    created = await stack.http.post("/v1/runners", json={"runners": [{**SPEC, "labels": first}]})
    assert created.status_code == 200, created.text
    more = [f"a{n}" for n in range(20_000, 60_000)]  # half of them there already
    merged = await stack.http.patch(
        "/v1/runners/llm", json={"runner": {"labels": more}, "action": "merge"}
    )
    assert merged.json()["runner"]["labels"] == [f"a{n}" for n in range(60_000)]
    removed = await stack.http.patch(
        "/v1/runners/llm", json={"runner": {"labels": first}, "action": "remove"}
    )
    assert removed.json()["runner"]["labels"] == [f"a{n}" for n in range(40_000, 60_000)]
    assert (await stack.http.get("/readyz")).status_code == 200


async def test_a_created_spec_comes_back_with_what_placement_made_of_it(stack_for: Any) -> None:
    stack: Stack = await stack_for()
    huge = {**SPEC, "id": "huge", "metadata": {"nLayers": 8, "modelBytes": "900Gi"}}
    created = await stack.http.post("/v1/runners", json={"runners": [SPEC, huge]})
    assert created.status_code == 200, created.text
    placed, refused = created.json()["placements"]
    assert (placed["runner_id"], placed["accepted"], len(placed["instances"])) == ("llm", True, 1)
    assert (refused["runner_id"], refused["instances"]) == ("huge", [])
    assert "GiB short" in refused["reason"]


async def test_two_concurrent_creates_of_one_spec_do_not_both_succeed(stack_for: Any) -> None:
    stack: Stack = await stack_for()
    answers = await asyncio.gather(
        *(stack.http.post("/v1/runners", json={"runners": [SPEC]}) for _ in range(8))
    )
    assert sorted(a.status_code for a in answers) == [200] + [409] * 7


async def test_concurrent_merges_of_one_spec_all_hold(stack_for: Any) -> None:
    stack: Stack = await stack_for()
    assert (await stack.http.post("/v1/runners", json={"runners": [SPEC]})).status_code == 200
    answers = await asyncio.gather(
        *(
            stack.http.patch(
                "/v1/runners/llm",
                json={"runner": {"metadata": {f"owner-{n}": "ops"}}, "action": "merge"},
            )
            for n in range(6)
        )
    )
    assert [a.status_code for a in answers] == [200] * 6
    metadata = (await stack.http.get("/v1/runners/llm")).json()["runner"]["metadata"]
    assert {f"owner-{n}" for n in range(6)} <= set(metadata), "a merge was lost to another"


@pytest.mark.parametrize(
    ("body", "status", "detail"),
    [
        ({"runners": [{**SPEC, "priority": 12}]}, 422, "`$.runners[0].priority`"),
        (
            {"runners": [{**SPEC, "nodpool": {"id": "x"}}]},
            422,
            "unknown field `$.runners[0].nodpool`",
        ),
        ({"runners": [{**SPEC, "min_replicas": 3}]}, 422, "min_replicas (3) exceeds num_replicas"),
        (
            {"runners": [{**SPEC, "num_replicas": 4000}]},
            422,
            "num_replicas (4,000) is over this installation's limit of 64 (RANKSCOPE_MAX_REPLICAS)",
        ),
        ({"runners": [{**SPEC, "metadata": {}}]}, 422, "the model's size is unknown"),
        ({"runners": []}, 422, "`$.runners` is empty"),
        ({"runner": SPEC}, 422, "missing required field `runners`"),
    ],
)
async def test_bad_runner_bodies_name_the_problem(
    stack_for: Any, body: dict[str, Any], status: int, detail: str
) -> None:
    stack: Stack = await stack_for()
    reply = await stack.http.post("/v1/runners", json=body)
    assert reply.status_code == status
    assert detail in reply.json()["detail"]
    assert (await stack.http.get("/v1/runners")).json()["runners"] == []  # nothing half-applied


async def test_malformed_json_and_oversize_bodies(stack_for: Any) -> None:
    stack: Stack = await stack_for()
    broken = await stack.http.post(
        "/v1/runners", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert broken.status_code == 422
    deep = '{"a":' * 1000 + "1" + "}" * 1000  # metadata nested 1,000 deep
    spec = json.dumps({**SPEC, "metadata": {**SPEC["metadata"], "x": 0}}).replace(
        '"x": 0', f'"x": {deep}'
    )
    for path, body in (
        ("/v1/runners", '{"runners": [' + spec + "]}"),
        (
            "/v1/chat/completions",
            '{"model": "llm", "messages": [], "response_format": ' + deep + "}",
        ),
    ):
        nested = await stack.http.post(
            path, content=body, headers={"content-type": "application/json"}
        )
        assert (nested.status_code, nested.json()) == (
            422,
            {"detail": "invalid body: nested too deep"},
        )
    huge = await stack.http.post("/v1/runners", content=b" " * (2 << 20))
    assert huge.status_code == 413

    async def streamed() -> AsyncIterator[bytes]:  # no Content-Length: chunked, 200 MB
        for _ in range(200):
            yield b" " * (1 << 20)

    for path in ("/v1/runners", "/v1/chat/completions"):
        chunked = await stack.http.post(path, content=streamed())
        assert chunked.status_code == 413
        assert chunked.json()["detail"] == "request body over 1048576 bytes"
    assert (await stack.http.get("/v1/runners")).status_code == 200  # and the gateway serves


async def test_timeline_trace_and_their_query_errors(stack_for: Any) -> None:
    stack: Stack = await stack_for()
    seed = json.loads((FIXTURES / "seeds" / "001_cluster_timeline.json").read_text())
    timeline = await stack.http.get("/v1/cluster/timeline", params={"limit": 10})
    assert timeline.status_code == 200
    assert set(timeline.json()) == set(seed)
    bad = await stack.http.get("/v1/cluster/timeline", params={"limit": 0})
    assert bad.status_code == 422
    assert "limit" in bad.json()["detail"]
    since = await stack.http.get("/v1/cluster/timeline", params={"since": "yesterday"})
    assert since.status_code == 422
    assert "'since'" in since.json()["detail"]
    trace = await stack.http.get("/v1/cluster/timeline/trace")
    assert trace.json()["traceEvents"] == []
    assert (await stack.http.get("/v1/cluster/diagnosis")).json()["findings"] == []
    narrowed = await stack.http.get(
        "/v1/cluster/diagnosis", params={"instanceId": "i", "kind": "stalled_rank"}
    )
    assert narrowed.json()["findings"] == []
    no_kind = await stack.http.get("/v1/cluster/diagnosis", params={"kind": "nonsense"})
    assert no_kind.status_code == 422
    assert "kind" in json.dumps(no_kind.json()["detail"])


async def test_placement_jobs_rank_tables_and_404s(stack_for: Any) -> None:
    stack: Stack = await stack_for()
    http = stack.http
    await http.post("/v1/runners", json={"runners": [SPEC]})

    async def placed() -> Any:
        found = (await http.get("/v1/placement/runners")).json()
        return found if len(found) == 2 else None

    ranks = await _until(placed)
    seed = json.loads((FIXTURES / "seeds" / "000_placement_runner_diagnostics.json").read_text())
    assert set(ranks[0]) == set(seed) | {"instanceId", "pid"}  # the seed's, and two more
    assert (ranks[0]["instanceId"], ranks[0]["pid"]) == ("llm-0", None)
    assert [(r["startLayer"], r["endLayer"]) for r in ranks] == [(0, 6), (6, 8)]
    one = await http.get(f"/v1/placement/runners/{ranks[1]['runnerId']}")
    assert one.json()["deviceRank"] == 1
    assert (await http.get("/v1/placement/runners/nope")).status_code == 404
    jobs = (await http.get("/v1/jobs")).json()["jobs"]
    assert [(j["jobId"], j["status"]) for j in jobs] == [("llm-0", "initializing")]
    table = await http.get("/v1/jobs/llm-0/ranktable")
    assert set(table.json()) == {"jobId", "rankTable"}
    assert table.headers["etag"] == '"1"'
    assert json.loads(table.json()["rankTable"])["server_group_list"][0]["server_count"] == "2"
    assert (await http.get("/v1/jobs/nope/ranktable")).status_code == 404


async def test_rank_table_stream_sends_current_then_changes(stack_for: Any) -> None:
    stack: Stack = await stack_for()
    await stack.http.post("/v1/runners", json={"runners": [SPEC]})
    await _until(lambda: _has_table(stack))
    async with stack.http.stream("GET", "/v1/jobs/llm-0/ranktable/stream") as events:
        lines = events.aiter_lines()
        first = await asyncio.wait_for(_next_event(lines), 1.0)
        assert json.loads(json.loads(first)["rankTable"])["status"] == "initializing"
        await _report_ready(stack)
        second = await asyncio.wait_for(_next_event(lines), 1.0 + 1.0)
        assert json.loads(json.loads(second)["rankTable"])["status"] == RankTableStatus.COMPLETED


async def _has_table(stack: Stack) -> bool:
    return (await stack.http.get("/v1/jobs/llm-0/ranktable")).status_code == 200


async def _next_event(lines: Any) -> str:
    async for line in lines:
        if line.startswith("data: "):
            return str(line[len("data: ") :])
    raise AssertionError("stream ended")


def _ref(rank: RunnerAssignment) -> RunnerRef:
    return RunnerRef(
        runnerId=rank.runnerId,
        nodeId=rank.nodeId,
        instanceId="llm-0",
        modelId="tiny",
        deviceRank=rank.deviceRank,
        worldSize=rank.worldSize,
    )


async def _report_ready(stack: Stack) -> InstanceCreated:
    """Every rank of llm-0 reports READY, as its runners would; the placement."""
    js = stack.nc.jetstream()
    raw = await js.get_last_msg(
        stack.layout.placement_stream.name, stack.layout.subjects.placement("llm-0")
    )
    instance = decode(raw.data or b"", InstanceCreated)
    for a in instance.assignments:
        event = RunnerStatusChanged(
            runner=_ref(a),
            seq=0,
            at=instance.at,
            statusKind=RunnerStatusKind.READY,
            processAlive=True,
        )
        subject = stack.layout.subjects.runner(a.nodeId, "llm-0", a.deviceRank, "status")
        await js.publish(subject, encode(event))
    return instance


async def test_chat_completion_without_a_serving_instance(stack_for: Any) -> None:
    stack: Stack = await stack_for()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    none = await stack.http.post("/v1/chat/completions", json=body)
    assert none.status_code == 404
    assert none.json()["detail"] == "no instance serves model 'tiny'"
    await stack.http.post("/v1/runners", json={"runners": [SPEC]})
    await _until(lambda: _has_table(stack))
    starting = await stack.http.post("/v1/chat/completions", json=body)
    assert starting.status_code == 503
    assert "no ready instance" in starting.json()["detail"]
    bad = await stack.http.post("/v1/chat/completions", json={"model": "tiny"})
    assert bad.status_code == 422


async def test_aggregator_down_means_503_with_a_reason_not_a_hang(stack_for: Any) -> None:
    stack: Stack = await stack_for()
    await stack.stop_aggregator()
    reply = await stack.http.get("/v1/cluster/timeline")
    assert reply.status_code == 503
    assert reply.json()["detail"] == "the aggregator is not running, or still rebuilding its views"
    ready = await stack.http.get("/readyz")
    assert ready.status_code == 503


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/runners", {"runners": [SPEC]}),
        ("PATCH", "/v1/runners/llm", {"runner": {}, "action": "merge"}),
        ("DELETE", "/v1/runners/llm", None),
        ("POST", "/v1/chat/completions", {"model": "tiny", "messages": []}),
        ("POST", "/v1/diagnostics/cluster/node-a/capture", {}),
    ],
)
async def test_every_mutating_route_needs_the_token(
    stack_for: Any, method: str, path: str, body: Any
) -> None:
    stack: Stack = await stack_for(api_token="s3cret")
    http = stack.http
    missing = await http.request(method, path, json=body)
    assert missing.status_code == 401
    wrong = await http.request(method, path, json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 403
    right = await http.request(method, path, json=body, headers={"Authorization": "Bearer s3cret"})
    assert right.status_code not in (401, 403)
    assert (await http.get("/v1/runners")).status_code == 200  # reads stay open
    assert "s3cret" not in (await http.get("/metrics")).text


async def test_one_capture_of_a_node_at_a_time(stack_for: Any) -> None:
    stack: Stack = await stack_for()

    asked, answer = asyncio.Event(), asyncio.Event()

    async def slowly(msg: Msg) -> None:  # an agent answering its probe once let to
        asked.set()
        await answer.wait()
        here = NodeDiagnostics(nodeId="node-a", friendlyName="a", address="", generatedAt=now())
        await msg.respond(encode(here))

    await stack.nc.subscribe(stack.layout.subjects.node_diagnostics("node-a"), cb=slowly)
    path, quick = "/v1/diagnostics/cluster/node-a/capture", {"includeProcessSamples": False}
    first = asyncio.create_task(stack.http.post(path, json=quick))
    await asyncio.wait_for(asked.wait(), 30)  # the first capture is under way
    second = await stack.http.post(path, json=quick)
    assert second.status_code == 429
    assert second.json()["detail"].startswith("a capture of node 'node-a' is under way")
    answer.set()
    assert (await first).status_code == 200
    assert (await stack.http.post(path, json=quick)).status_code == 200  # and again after


async def test_reads_can_be_closed_too(stack_for: Any) -> None:
    stack: Stack = await stack_for(api_token="s3cret", api_token_reads=True)
    assert (await stack.http.get("/v1/runners")).status_code == 401
    allowed = await stack.http.get("/v1/runners", headers={"Authorization": "Bearer s3cret"})
    assert allowed.status_code == 200
    assert (await stack.http.get("/healthz")).status_code == 200
    assert (await stack.http.get("/metrics")).status_code == 401  # it names every runner
    scraped = await stack.http.get("/metrics", headers={"Authorization": "Bearer s3cret"})
    assert scraped.status_code == 200
    document = (await stack.http.get("/openapi.json")).json()
    for path, operations in document["paths"].items():
        if "get" in operations and path not in ("/healthz", "/readyz"):
            url = path.replace("{", "x").replace("}", "")  # any id: refused before it is read
            assert (await stack.http.get(url)).status_code == 401, path


async def _serving(stack: Stack) -> str:
    """llm-0 placed and ready, its nodes answering probes as agents do; the node of its
    last rank, which speaks for its output."""
    await stack.http.post("/v1/runners", json={"runners": [SPEC]})
    await _until(lambda: _has_table(stack))
    instance = await _report_ready(stack)
    await answer_probes(stack.nc, stack.layout, instance)

    async def ready() -> bool:
        reply = await stack.nc.request(stack.layout.subjects.query("instances"), b"")
        return any(i.ready for i in decode(reply.data, list[InstanceState]))

    await _until(ready)
    return max(instance.assignments, key=lambda a: a.deviceRank).nodeId


def _chunk(seq: int, text: str, finish: str | None = None) -> bytes:
    counts = {"promptTokens": 3, "completionTokens": seq + 1} if finish else {}
    return encode(TokenChunk(commandId="", seq=seq, text=text, finishReason=finish, **counts))


@contextlib.asynccontextmanager
async def _answered(
    stack: Stack,
    speaker: str,
    answers: list[tuple[str, bytes]],
    reports: tuple[tuple[str, TaskStatus, str | None], ...] = (),
    forged: tuple[tuple[str, str, TaskStatus], ...] = (),
    refused: bool = False,
) -> AsyncIterator[None]:
    """Answer the next task of llm-0: first `forged` reports, (subject's node, node whose
    rank it names, status), then `answers`, (node, raw chunk) pairs sent on its output
    subject as that node ("": the speaker), as the last rank's node would; then
    `reports`, (node, status, detail) of the task, as the ranks' agents do."""
    tasks = await stack.nc.subscribe(stack.layout.subjects.tasks("llm-0"))
    placed = (await stack.http.get("/v1/placement/runners")).json()
    runner_on = {p["nodeId"]: p["runnerId"] for p in placed if p["runnerId"].startswith("llm-0")}

    async def report(
        task: TaskCreated, node: str, rank_node: str, status: TaskStatus, detail: str | None
    ) -> None:
        said = TaskStatusChanged(
            at=now(),
            taskId=task.taskId,
            instanceId="llm-0",
            taskStatus=status,
            runnerId=runner_on[rank_node],
            detail=detail,
            refused=refused and status is TaskStatus.FAILED,
        )
        subject = stack.layout.subjects.task_status("llm-0", node)
        await stack.nc.jetstream().publish(subject, encode(said))

    async def answer() -> None:
        task = decode((await tasks.next_msg(timeout=10)).data, TaskEvent)
        while isinstance(task, TaskCreated) and task.taskKind is TaskKind.CANCEL_TASK:
            task = decode((await tasks.next_msg(timeout=10)).data, TaskEvent)  # of a chat before
        assert isinstance(task, TaskCreated)
        assert task.commandId
        for node, rank_node, status in forged:
            await report(task, node, rank_node, status, "forged")
        await asyncio.sleep(0.5 if forged else 0)  # past the grace a failure is given
        for node, raw in answers:
            subject = stack.layout.subjects.output(task.commandId, node or speaker)
            await stack.nc.publish(subject, raw)
        for node, status, detail in reports:
            await report(task, node or speaker, node or speaker, status, detail)

    answering = asyncio.create_task(answer())
    yield
    await answering
    await tasks.unsubscribe()


CHAT = {"model": "llm", "messages": [{"role": "user", "content": "hi"}]}


async def _chat(stack: Stack, speaker: str, answers: list[tuple[str, bytes]]) -> httpx.Response:
    async with _answered(stack, speaker, answers):
        return await stack.http.post("/v1/chat/completions", json=CHAT)


async def _chat_events(stack: Stack, speaker: str, answers: list[tuple[str, bytes]]) -> list[str]:
    """The data lines of a streamed chat."""
    async with (
        _answered(stack, speaker, answers),
        stack.http.stream("POST", "/v1/chat/completions", json=CHAT | {"stream": True}) as events,
    ):
        return [line[6:] async for line in events.aiter_lines() if line.startswith("data: ")]


async def test_a_chat_reply_is_its_chunks_in_order_from_the_last_rank_s_node(
    stack_for: Any,
) -> None:
    stack: Stack = await stack_for()
    speaker = await _serving(stack)
    other = "node-a" if speaker == "node-b" else "node-b"
    reply = await _chat(
        stack,
        speaker,
        [
            (other, _chunk(0, "forged", "stop")),
            ("", _chunk(0, "Hel")),
            ("", _chunk(1, "lo", "length")),
        ],
    )
    assert reply.status_code == 200
    assert reply.json()["choices"][0]["message"]["content"] == "Hello"
    assert reply.json()["choices"][0]["finish_reason"] == "length"
    assert reply.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


@pytest.mark.parametrize(
    ("answers", "lost"),
    [
        ([_chunk(0, "Hel"), _chunk(2, "!", "stop")], "1"),
        ([b"not a chunk", _chunk(1, "lo", "stop")], "0"),
        ([_chunk(0, "a"), _chunk(4, "e", "stop")], "1-3"),
    ],
    ids=["one lost", "one undecodable", "three lost"],
)
async def test_a_lost_output_chunk_is_a_502_naming_it_not_a_reply_with_a_hole(
    stack_for: Any, answers: list[bytes], lost: str
) -> None:
    stack: Stack = await stack_for()
    speaker = await _serving(stack)
    reply = await _chat(stack, speaker, [("", raw) for raw in answers])
    assert reply.status_code == 502
    assert reply.json()["detail"].startswith(f"output chunks {lost} of chatcmpl-")
    events = await _chat_events(stack, speaker, [("", raw) for raw in answers])
    assert json.loads(events[0])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-1] != "[DONE]"
    error = json.loads(events[-1])["error"]
    assert error["code"] == 502
    assert error["message"].startswith(f"output chunks {lost} of chatcmpl-")


async def test_a_task_a_rank_reports_failed_ends_the_chat_with_a_502_at_once(
    stack_for: Any,
) -> None:
    stack: Stack = await stack_for()
    speaker = await _serving(stack)
    failed = (("node-a", TaskStatus.FAILED, "the runner died: killed by SIGKILL"),)
    async with _answered(stack, speaker, [("", _chunk(0, "Hel"))], failed):
        reply = await stack.http.post("/v1/chat/completions", json=CHAT)
    assert reply.status_code == 502
    assert reply.json()["detail"] == (
        "the task failed on llm-0-a0-r0: the runner died: killed by SIGKILL"
    )


async def test_a_task_every_rank_refused_as_asked_is_a_422_saying_why(stack_for: Any) -> None:
    stack: Stack = await stack_for()
    speaker = await _serving(stack)
    why = "the prompt is 9,000 tokens; the model's context is 4,096 (prompt and reply together)"
    async with _answered(stack, speaker, [], ((speaker, TaskStatus.FAILED, why),), refused=True):
        reply = await stack.http.post("/v1/chat/completions", json=CHAT)
    assert (reply.status_code, reply.json()) == (422, {"detail": why})


async def test_a_failure_one_node_reports_for_another_s_rank_ends_no_chat(
    stack_for: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("rankscope.services.gateway.routes.chat.FAILURE_GRACE_S", 0.2)
    stack: Stack = await stack_for()
    speaker = await _serving(stack)
    other = "node-a" if speaker == "node-b" else "node-b"
    forged = ((other, speaker, TaskStatus.FAILED),)  # on its own subject, the speaker's rank
    answers = [("", _chunk(0, "Hel")), ("", _chunk(1, "lo", finish="stop"))]
    async with _answered(stack, speaker, answers, forged=forged):
        reply = await stack.http.post("/v1/chat/completions", json=CHAT)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == "Hello"


async def test_every_rank_that_reports_the_task_failed_is_named_not_only_the_first(
    stack_for: Any,
) -> None:
    stack: Stack = await stack_for()
    speaker = await _serving(stack)
    failed = (  # the victim, whose ring broke, happens to report first
        ("node-b", TaskStatus.FAILED, "the runner died: exit code 1"),
        ("node-a", TaskStatus.FAILED, "the runner died: killed by SIGKILL"),
    )
    async with _answered(stack, speaker, [("", _chunk(0, "Hel"))], failed):
        reply = await stack.http.post("/v1/chat/completions", json=CHAT)
    assert reply.status_code == 502
    assert reply.json()["detail"] == (
        "the task failed on llm-0-a0-r1: the runner died: exit code 1; "
        "on llm-0-a0-r0: the runner died: killed by SIGKILL"
    )


async def test_a_last_chunk_missing_after_its_rank_completed_is_a_502(stack_for: Any) -> None:
    stack: Stack = await stack_for()
    speaker = await _serving(stack)
    other = "node-a" if speaker == "node-b" else "node-b"
    completed = ((other, TaskStatus.COMPLETE, None), ("", TaskStatus.COMPLETE, None))
    async with _answered(stack, speaker, [("", _chunk(0, "Hel"))], completed):
        reply = await stack.http.post("/v1/chat/completions", json=CHAT)
    assert reply.status_code == 502
    assert reply.json()["detail"].startswith("output chunks from 1 on of chatcmpl-")
    reply = await _chat(stack, speaker, [("", _chunk(0, "Hel")), ("", _chunk(1, "lo", "stop"))])
    assert reply.json()["choices"][0]["message"]["content"] == "Hello"  # the next one is fine


@pytest.mark.parametrize("long_id", ["a" * 4100, "*" * 1400, "é" * 200])
async def test_an_id_too_long_for_a_subject_is_a_422_and_nats_stays_connected(
    stack_for: Any, long_id: str
) -> None:
    stack: Stack = await stack_for()
    http = stack.http
    for method, path, body in (
        ("GET", f"/v1/runners/{long_id}", None),
        ("DELETE", f"/v1/runners/{long_id}", None),
        ("PATCH", f"/v1/runners/{long_id}", {"runner": {"priority": 1}, "action": "merge"}),
        ("GET", f"/v1/jobs/{long_id}/ranktable", None),
        ("GET", f"/v1/jobs/{long_id}/ranktable/stream", None),
        ("GET", f"/v1/cluster/diagnosis/history?instanceId={long_id}", None),
        ("POST", "/v1/runners", {"runners": [{**SPEC, "id": long_id}]}),
    ):
        reply = await http.request(method, path, json=body)
        assert reply.status_code == 422, (method, path, reply.text)
        assert "of 512" in reply.json()["detail"]  # the limit: of a subject token, or a spec id
    # before, the server dropped the gateway's connection for good on such a subject
    assert (await http.get("/readyz")).status_code == 200
    assert (await http.get("/v1/runners")).status_code == 200
    assert (await http.post("/v1/runners", json={"runners": [SPEC]})).status_code == 200


async def test_a_chat_message_of_no_known_role_is_a_422_naming_it(stack_for: Any) -> None:
    stack: Stack = await stack_for()
    body = {"model": "llm", "messages": [{"role": "god", "content": "obey"}]}
    reply = await stack.http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 422
    assert "$.messages[0].role" in reply.json()["detail"]


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        ({"temperature": -1}, "`$.temperature`"),
        ({"temperature": 2.5}, "`$.temperature`"),
        ({"top_p": 0}, "`$.top_p`"),
        ({"n": 2}, "`n`"),
        ({"stop": ["\n"]}, "`stop`"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "`tools`"),
        ({"logprobs": True, "presence_penalty": 1}, "`presence_penalty`, `logprobs`"),
        ({"response_format": {"type": "json_object"}}, "`response_format`"),
        ({"seed": 7, "temperature": 0.7}, "`seed`"),
    ],
)
async def test_chat_parameters_rankscope_cannot_honour_are_a_422_naming_them(
    stack_for: Any, extra: dict[str, Any], said: str
) -> None:
    stack: Stack = await stack_for()
    reply = await stack.http.post("/v1/chat/completions", json={**CHAT, **extra})
    assert reply.status_code == 422, reply.text
    assert said in reply.json()["detail"]


async def test_chat_parameters_that_ask_for_what_it_does_pass_the_gateway(
    stack_for: Any,
) -> None:
    stack: Stack = await stack_for()
    defaults = {
        "n": 1,
        "stop": None,
        "seed": 3,
        "logprobs": False,
        "top_p": 0.9,
        "store": False,
        "response_format": {"type": "text"},
        "stream_options": None,
        "tool_choice": "none",
    }
    reply = await stack.http.post("/v1/chat/completions", json={**CHAT, **defaults})
    assert reply.status_code == 404  # past validation: no instance serves "llm" here
    assert reply.json()["detail"] == "no instance serves model 'llm'"


@pytest.mark.parametrize(
    ("limit", "field", "said"),
    [
        (100_000, "max_tokens", "`$.max_tokens` 100,000 is over this gateway's limit of 4,096"),
        (10**23, "max_tokens", "is over this gateway's limit"),
        (0, "max_completion_tokens", "`$.max_completion_tokens` must be at least 1, not 0"),
        (-5, "max_tokens", "must be at least 1"),
    ],
)
async def test_a_chat_asking_for_too_many_tokens_is_a_422_before_anything_runs(
    stack_for: Any, limit: int, field: str, said: str
) -> None:
    stack: Stack = await stack_for()
    tasks = await stack.nc.subscribe(stack.layout.subjects.tasks_all())
    reply = await stack.http.post("/v1/chat/completions", json=CHAT | {field: limit})
    assert reply.status_code == 422
    assert said in reply.json()["detail"]
    with pytest.raises(TimeoutError):
        await tasks.next_msg(timeout=0.5)  # no task was submitted


async def _cancel_of(tasks: Any) -> TaskCreated:
    """The next cancel on the tasks subject (skipping the task itself)."""
    while True:
        event = decode((await tasks.next_msg(timeout=10)).data, TaskEvent)
        if isinstance(event, TaskCreated) and event.taskKind is TaskKind.CANCEL_TASK:
            return event


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_a_client_that_leaves_mid_generation_cancels_the_task_on_every_rank(
    stack_for: Any, stream: bool
) -> None:
    stack: Stack = await stack_for()
    speaker = await _serving(stack)
    tasks = await stack.nc.subscribe(stack.layout.subjects.tasks("llm-0"))
    body = CHAT | {"stream": stream, "max_tokens": 4000}

    async def leave_after_first_chunk() -> None:
        async with stack.http.stream("POST", "/v1/chat/completions", json=body) as events:
            async for line in events.aiter_lines():
                if "Hel" in line:
                    return  # the first text arrived: go away

    client = asyncio.create_task(leave_after_first_chunk())
    task = decode((await tasks.next_msg(timeout=10)).data, TaskEvent)
    assert isinstance(task, TaskCreated)
    assert task.commandId
    subject = stack.layout.subjects.output(task.commandId, speaker)
    await stack.nc.publish(subject, _chunk(0, "Hel"))  # and never another
    if not stream:
        await asyncio.sleep(0.5)
        client.cancel()  # a whole answer sends nothing before the end: hang up
    with contextlib.suppress(asyncio.CancelledError):
        await client
    cancel = await _cancel_of(tasks)
    assert cancel.targetTaskId == task.taskId

    async def queued() -> bool:  # no rank reported it over: it still counts as queued
        metrics = (await stack.http.get("/metrics")).text
        return 'rankscope_instance_queued_tasks{instance="llm-0"} 1' in metrics

    await _until(queued)


@pytest.mark.parametrize(
    ("after", "shown"),
    [(None, "RunnerFailed"), (RunnerStatusKind.CONNECTING, "RunnerConnecting")],
    ids=["lost", "already-restarting"],
)
async def test_a_rank_lost_mid_generation_ends_the_chat_with_a_502_naming_it(
    stack_for: Any, after: RunnerStatusKind | None, shown: str
) -> None:
    stack: Stack = await stack_for()
    await _serving(stack)
    tasks = await stack.nc.subscribe(stack.layout.subjects.tasks("llm-0"))
    chat = asyncio.create_task(stack.http.post("/v1/chat/completions", json=CHAT))
    await tasks.next_msg(timeout=10)
    raw = await stack.nc.jetstream().get_last_msg(
        stack.layout.placement_stream.name, stack.layout.subjects.placement("llm-0")
    )
    first = decode(raw.data or b"", InstanceCreated).assignments[0]
    dead = RunnerStatusChanged(
        runner=_ref(first), seq=1, at=now(), statusKind=RunnerStatusKind.FAILED, processAlive=False
    )
    subject = stack.layout.subjects.runner(first.nodeId, "llm-0", first.deviceRank, "status")
    # a rank lost without a word about the task (its agent died with it, or its process
    # was killed and its agent has started it again: it runs no task either way)
    await stack.nc.jetstream().publish(subject, encode(dead))
    if after is not None:
        back = msgspec.structs.replace(dead, seq=2, statusKind=after, processAlive=True)
        await stack.nc.jetstream().publish(subject, encode(back))
    reply = await chat
    assert reply.status_code == 502
    assert reply.json()["detail"] == (
        f"lost while generating: rank {first.deviceRank} on {first.nodeId} ({shown})"
    )


def _finding(
    instance: str, since: str, *, cleared: str | None = None, incident: str | None = None
) -> bytes:
    return encode(
        Finding(
            incidentId=incident,
            instanceId=instance,
            kind=FindingKind.STALLED_RANK,
            culpritRanks=[1],
            culpritRunnerIds=[f"{instance}-r1"],
            waitingRanks=[0],
            summary=f"{instance} stalled" + (" (cleared)" if cleared else ""),
            since=since,
            open=cleared is None,
            clearedAt=cleared,
        )
    )


async def test_an_incident_is_one_file_to_hand_over(stack_for: Any) -> None:
    stack: Stack = await stack_for()
    js, subjects = stack.nc.jetstream(), stack.layout.subjects
    instance = placed("i")
    await js.publish(subjects.placement("i"), encode(instance))
    for r in (0, 1):
        ref = RunnerRef(runnerId=f"i-r{r}", nodeId=f"node-{r}", instanceId="i", modelId="tiny",
                        deviceRank=r, worldSize=2)  # fmt: skip
        batch = PhaseEntries(
            runner=ref, entries=[FlightEntry(seq=0, at=now(), phase=Phase.IDLE, event="ready")]
        )
        await js.publish(subjects.runner(f"node-{r}", "i", r, "phase"), encode(batch))
    opened = now()
    await js.publish(subjects.diagnosis("i"), _finding("i", opened, incident="abc123"))
    await js.publish(
        subjects.diagnosis("i"), _finding("i", opened, cleared=now(), incident="abc123")
    )
    await js.publish(subjects.diagnosis("j"), _finding("j", opened, incident="other"))

    async def bundled() -> httpx.Response | None:
        reply = await stack.http.get("/v1/cluster/diagnosis/history/abc123/bundle")
        timeline = await stack.http.get("/v1/cluster/timeline", params={"instanceId": "i"})
        return reply if reply.status_code == 200 and timeline.json()["timeline"] else None

    reply = await _until(bundled)
    assert reply.headers["content-type"] == "application/gzip"
    with tarfile.open(fileobj=io.BytesIO(reply.content)) as tar:
        files = {m.name.split("/", 1)[1]: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
    assert {"README.txt", "incident.json", "timeline.json", "trace.json", "placement.json",
            "versions.json"} <= set(files)  # fmt: skip
    words = json.loads(files["incident.json"])
    assert [w["open"] for w in words] == [True, False]  # every word of it, and no other's
    assert len(json.loads(files["timeline.json"])["timeline"]) == 2
    assert json.loads(files["trace.json"])["traceEvents"]
    assert "not held:" in files["README.txt"].decode()
    missing = await stack.http.get("/v1/cluster/diagnosis/history/nope/bundle")
    assert missing.status_code == 404


async def test_an_outage_and_an_incident_without_an_id_have_bundles_too(stack_for: Any) -> None:
    """Every incident has one key, the history's, the alert's and the bundle's: an outage
    of NATS (of no instance) as much as a finding an older release published with no id."""
    stack: Stack = await stack_for()
    js, subjects = stack.nc.jetstream(), stack.layout.subjects
    since = "2026-11-23T10:00:00Z"
    outage = Finding(
        instanceId="",
        kind=FindingKind.NATS_UNREACHABLE,
        culpritRanks=[],
        culpritRunnerIds=[],
        summary="NATS unreachable",
        since=since,
        incidentId=incident_id(FindingKind.NATS_UNREACHABLE.value, since),
    )
    await js.publish(subjects.diagnosis(""), encode(outage))
    await js.publish(subjects.diagnosis("old"), _finding("old", since))  # no incidentId
    history = (await stack.http.get("/v1/cluster/diagnosis/history")).json()["findings"]
    keys = {f["instanceId"]: f.get("incidentId") for f in history}
    assert keys[""] == outage.incidentId
    old = decode(_finding("old", since), Finding).key
    for incident in (outage.incidentId, old):
        reply = await stack.http.get(f"/v1/cluster/diagnosis/history/{incident}/bundle")
        assert reply.status_code == 200, reply.text
    with tarfile.open(fileobj=io.BytesIO(reply.content)) as tar:
        names = {m.name.split("/", 1)[1] for m in tar.getmembers()}
    assert "incident.json" in names


async def test_diagnosis_history_serves_every_incident_open_or_cleared(stack_for: Any) -> None:
    stack: Stack = await stack_for()
    js, subjects = stack.nc.jetstream(), stack.layout.subjects
    await js.publish(subjects.diagnosis("a"), _finding("a", "2026-11-23T10:00:00Z"))
    await js.publish(subjects.diagnosis("b"), _finding("b", "2026-11-23T10:05:00Z"))
    cleared = _finding("a", "2026-11-23T10:00:00Z", cleared="2026-11-23T10:09:00Z")
    await js.publish(subjects.diagnosis("a"), cleared)
    await js.publish(subjects.diagnosis("a"), b"not a finding")  # skipped, nothing else lost
    reply = await stack.http.get("/v1/cluster/diagnosis/history")
    assert reply.status_code == 200
    found = reply.json()["findings"]
    assert [(f["instanceId"], f["open"], f["clearedAt"]) for f in found] == [
        ("a", False, "2026-11-23T10:09:00Z"),  # one incident, in its last word
        ("b", True, None),
    ]
    assert found[0]["signature"] == found[1]["signature"]  # the same fault, twice
    assert (found[0]["seenBefore"], found[1]["seenBefore"]["count"]) == (None, 1)
    (fault,) = (await stack.http.get("/v1/cluster/diagnosis/signatures")).json()
    assert (fault["signature"], fault["count"], fault["kind"]) == (
        found[0]["signature"], 2, "stalled_rank",
    )  # fmt: skip
    only = await stack.http.get("/v1/cluster/diagnosis/history", params={"instanceId": "b"})
    assert [f["instanceId"] for f in only.json()["findings"]] == ["b"]
    newest = await stack.http.get("/v1/cluster/diagnosis/history", params={"limit": 1})
    assert [f["instanceId"] for f in newest.json()["findings"]] == ["b"]
    later = await stack.http.get(
        "/v1/cluster/diagnosis/history", params={"since": "2999-01-01T00:00:00Z"}
    )
    assert later.json()["findings"] == []
    bad = await stack.http.get("/v1/cluster/diagnosis/history", params={"since": "yesterday"})
    assert bad.status_code == 422
    assert "'since' is not an RFC 3339 timestamp" in bad.json()["detail"]


@pytest.mark.parametrize(("node_id", "local"), [("node-a", "node-a"), (None, hostname())])
async def test_local_means_the_gateway_s_node_and_there_is_no_master(
    stack_for: Any, node_id: str | None, local: str
) -> None:
    stack: Stack = await stack_for(node_id=node_id)  # None: the aggregator says "aggregator"
    assert (await stack.http.post("/v1/runners", json={"runners": [SPEC]})).is_success

    async def placed() -> list[dict[str, Any]] | None:
        found: list[dict[str, Any]] = (await stack.http.get("/v1/placement/runners")).json()
        return found if len(found) == 2 else None

    ranks = await _until(placed)
    assert {(r["nodeId"], r["isLocal"], r["isMaster"]) for r in ranks} == {
        ("node-a", local == "node-a", False),
        ("node-b", False, False),
    }
    one = (await stack.http.get(f"/v1/placement/runners/{ranks[0]['runnerId']}")).json()
    assert one["isLocal"] is (one["nodeId"] == local)
    ours = (await stack.http.get("/v1/cluster/timeline?limit=1")).json()
    skulk = (await stack.http.get("/v1/diagnostics/cluster/timeline?limit=1")).json()
    for answer in (ours, skulk):
        assert (answer["localNodeId"], answer["masterNodeId"]) == (local, None)
    assert skulk["runners"] == ours["runners"]


async def test_tracing_is_always_on_and_cannot_be_turned_off(stack_for: Any) -> None:
    http = (await stack_for()).http
    assert (await http.get("/v1/tracing")).json() == {"enabled": True}
    assert (await http.put("/v1/tracing", json={"enabled": True})).json() == {"enabled": True}
    off = await http.put("/v1/tracing", json={"enabled": False})
    assert off.status_code == 409
    assert "the diagnosis reads the flight recorder" in off.json()["detail"]
    assert (await http.put("/v1/tracing", json={"enabled": "no"})).status_code == 422


def _sampled(runner: RunnerRef, seq: int, at: datetime, active: int) -> bytes:
    snapshot = MlxMemorySnapshot(
        generatedAt=format_ts(at),
        active=Memory(inBytes=active),
        peak=Memory(inBytes=active + 10),
        cache=Memory(inBytes=5),
        source="mlx.core",
    )
    return encode(MemorySampled(runner=runner, seq=seq, snapshot=snapshot))


async def test_memory_over_time_keeps_each_slice_s_highest_sample(
    stack_for: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack: Stack = await stack_for()
    js, subjects = stack.nc.jetstream(), stack.layout.subjects
    start = datetime.now(UTC) - timedelta(seconds=60)
    ranks = [
        RunnerRef(runnerId=f"m-r{r}", nodeId=f"node-{r}", instanceId="m", modelId="tiny",
                  deviceRank=r, worldSize=2)
        for r in (1, 0)
    ]  # fmt: skip
    for runner in ranks:
        for second in range(60):  # a spike at second 31 on rank 1 only
            active = 1000 + second + (5000 if runner.deviceRank == 1 and second == 31 else 0)
            at = start + timedelta(seconds=second)
            subject = subjects.runner(runner.nodeId, "m", runner.deviceRank, "memory")
            await js.publish(subject, _sampled(runner, second, at, active))
    other = RunnerRef(runnerId="o-r0", nodeId="node-0", instanceId="o", modelId="tiny",
                      deviceRank=0, worldSize=1)  # fmt: skip
    await js.publish(subjects.runner("node-0", "o", 0, "memory"), _sampled(other, 0, start, 1))
    asked: dict[str, str | int] = {
        "instanceId": "m",
        "since": format_ts(start),
        "until": format_ts(start + timedelta(seconds=60)),
        "points": 6,
    }
    reply = await stack.http.get("/v1/cluster/memory", params=asked)
    assert reply.status_code == 200, reply.text
    found = reply.json()["runners"]
    assert [(s["runnerId"], s["deviceRank"]) for s in found] == [("m-r0", 0), ("m-r1", 1)]
    assert [len(s["samples"]) for s in found] == [6, 6]
    assert [p["active"] for p in found[0]["samples"]] == [1009, 1019, 1029, 1039, 1049, 1059]
    assert found[1]["samples"][3] == {
        "at": format_ts(start + timedelta(seconds=31)), "active": 6031, "peak": 6041, "cache": 5,
    }  # fmt: skip
    everyone = await stack.http.get(
        "/v1/cluster/memory", params={k: v for k, v in asked.items() if k != "instanceId"}
    )
    assert {s["instanceId"] for s in everyone.json()["runners"]} == {"m", "o"}
    backwards = await stack.http.get(
        "/v1/cluster/memory", params={**asked, "since": asked["until"], "until": asked["since"]}
    )
    assert (backwards.status_code, backwards.json()) == (
        422, {"detail": "`since` must come before `until`"},
    )  # fmt: skip
    bad = await stack.http.get("/v1/cluster/memory", params={"since": "yesterday"})
    assert bad.status_code == 422
    year_one = "0001-01-01T00:00:00Z"
    for route in ("/v1/cluster/memory", "/v1/cluster/pace"):
        from_the_first = await stack.http.get(route, params={**asked, "since": year_one})
        assert from_the_first.status_code == 200, from_the_first.text
        assert from_the_first.json()["since"] == "1970-01-01T00:00:00.000000Z"
        before_anything = await stack.http.get(route, params={"until": year_one})
        assert before_anything.status_code == 422, before_anything.text
    monkeypatch.setattr("rankscope.services.gateway.routes.cluster.MEMORY_SAMPLES", 50)
    too_many = await stack.http.get("/v1/cluster/memory", params=asked)
    assert too_many.status_code == 413
    assert "more than 50 memory samples" in too_many.json()["detail"]


async def test_a_dump_load_out_of_bounds_is_refused_with_its_path(stack_for: Any) -> None:
    stack: Stack = await stack_for()
    verdict = {"culprits": [], "summary": "", "ranks": []}
    load = {"jobId": "fr-x", "verdict": verdict, "ranks": [{"rank": 0, "entries": []}],
            "loadedAt": "2026-11-27T12:00:00Z"}  # fmt: skip
    huge = {**verdict, "ranks": [{"rank": 10**12, "role": "done"}]}
    reply = await stack.http.post("/v1/fr/loads", json={**load, "verdict": huge})
    assert reply.status_code == 422, reply.text
    assert "$.verdict.ranks[0].rank" in reply.json()["detail"]
    reply = await stack.http.post("/v1/fr/loads", json={**load, "jobId": "../x"})
    assert reply.status_code == 422, reply.text
    assert "$.jobId" in reply.json()["detail"]
    reply = await stack.http.post("/v1/fr/loads", json=load)
    assert reply.status_code == 202, reply.text  # the same load within its bounds
