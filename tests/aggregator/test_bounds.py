"""Whatever a node says, a rank's evidence is cut to a readable size and the diagnosis
answer stays within its bound, narrowable by instance and kind."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from rankscope.services.aggregator.bounds import STACK_CHARS, cut_stack, diagnosis_answer
from rankscope.services.aggregator.diagnosis import Incident, Thresholds
from rankscope.services.aggregator.floods import FLOOD_HOLD_S, Floods
from rankscope.services.aggregator.store import EntryStore
from rankscope.services.aggregator.views import ClusterState
from rankscope.shared.headers import ERROR_CODE_HEADER, ERROR_HEADER
from rankscope.shared.jetstream import Layout
from rankscope.shared.timestamps import now
from rankscope.shared.wire import (
    AggregatorHealth,
    ClusterTimeline,
    Diagnosis,
    DiagnosisQuery,
    Finding,
    FindingKind,
    NodeEvidence,
    Phase,
    ProcessState,
    RankEvidence,
    RunnerEvidence,
    decode,
    encode,
)
from tests.agents_stand_in import answer_probes
from tests.aggregator.builders import at, entries, placed, rank
from tests.aggregator.running import WAIT, aggregator, publish, query, until


def _finding(instance: str, kind: FindingKind, stack: str | None = None) -> Finding:
    return Finding(
        instanceId=instance,
        kind=kind,
        culpritRanks=[0],
        culpritRunnerIds=[f"{instance}-r0"],
        summary="rank 0 is stuck",
        since=at(0),
        evidence=[RankEvidence(runnerId=f"{instance}-r0", nodeId="n", deviceRank=0, stack=stack)],
    )


def test_a_stack_is_cut_with_a_note_and_a_short_one_kept_whole() -> None:
    assert cut_stack("short") == "short"
    cut = cut_stack("x" * (STACK_CHARS * 10))
    assert cut is not None
    assert cut.endswith(f"(cut: {STACK_CHARS:,} of {STACK_CHARS * 10:,} characters kept)")
    assert len(cut) < STACK_CHARS + 100


def test_the_answer_is_narrowed_by_instance_and_kind() -> None:
    found = [
        _finding("a", FindingKind.STALLED_RANK),
        _finding("b", FindingKind.STALLED_RANK),
        _finding("b", FindingKind.MISSING_DATA),
    ]

    def asked(**filters: str) -> list[tuple[str, str]]:
        query = decode(encode(filters), DiagnosisQuery)
        answer = decode(diagnosis_answer(found, query, at(1)), Diagnosis)
        return [(f.instanceId, f.kind.value) for f in answer.findings]

    assert asked(instanceId="b") == [("b", "stalled_rank"), ("b", "missing_data")]
    assert asked(kind="stalled_rank") == [("a", "stalled_rank"), ("b", "stalled_rank")]
    assert asked(instanceId="b", kind="missing_data") == [("b", "missing_data")]


def test_stacks_go_first_then_whole_findings_past_the_bound() -> None:
    stacked = [_finding(f"i{n}", FindingKind.STALLED_RANK, "s" * 50_000) for n in range(40)]
    limit = 200_000
    answer = decode(diagnosis_answer(stacked, DiagnosisQuery(), at(1), limit), Diagnosis)
    assert len(answer.findings) == 40
    assert answer.omitted == 0
    assert all("left out" in (f.evidence[0].stack or "") for f in answer.findings)
    many = stacked * 100
    raw = diagnosis_answer(many, DiagnosisQuery(), at(1), limit)
    answer = decode(raw, Diagnosis)
    assert len(raw) <= limit
    assert answer.omitted == len(many) - len(answer.findings) > 0


@pytest.mark.nats
async def test_a_node_answering_with_a_huge_stack_blinds_nobody(
    nc: Client, js_ready: Layout
) -> None:
    async def huge(msg: Msg) -> None:
        runners = [
            RunnerEvidence(
                runnerId="i-r0",
                process=ProcessState.SLEEPING,
                stack="Thread 0x1 (most recent call first):\n" + "x" * (40 << 20),
                capturedAt=now(),
            )
        ]
        await msg.respond(encode(NodeEvidence(nodeId="node-0", runners=runners)))

    await nc.subscribe(js_ready.subjects.node_evidence("node-0"), cb=huge)
    await answer_probes(nc, js_ready, placed())
    async with aggregator(nc, js_ready, thresholds=Thresholds(working=1.0)):
        await publish(nc, js_ready, placed())
        await publish(nc, js_ready, entries(rank(0), (0, 1, Phase.PREFILL_PIPELINE, 7)))
        await publish(nc, js_ready, entries(rank(1), (0, 1, Phase.DECODE_BARRIER, 8)))
        stacks: list[str] = []

        async def captured() -> bool:
            body = json.loads((await query(nc, js_ready, "diagnosis")).data)
            stacks[:] = [e.get("stack") or "" for f in body["findings"] for e in f["evidence"]]
            return any(stacks)

        for _ in range(int(WAIT / 0.1)):
            if await captured():
                break
            await asyncio.sleep(0.1)
        reply = await query(nc, js_ready, "diagnosis", {"instanceId": "i"})
        assert len(reply.data) < 2 << 20
        (stack,) = [s for s in stacks if s]
        assert stack.startswith("Thread 0x1")
        assert stack.endswith("characters kept)")
        other = decode(
            (await query(nc, js_ready, "diagnosis", {"instanceId": "other"})).data, Diagnosis
        )
        assert other.findings == []
        bad = await query(nc, js_ready, "diagnosis", {"kind": "no_such_kind"})
        assert bad.headers is not None
        assert bad.headers[ERROR_CODE_HEADER] == "422"
        assert "$.kind" in bad.headers[ERROR_HEADER]


@pytest.mark.nats
async def test_a_node_that_floods_the_aggregator_loses_its_own_history_and_is_named(
    nc: Client, js_ready: Layout
) -> None:
    store = EntryStore(max_bytes=60_000)
    async with aggregator(nc, js_ready, store=store) as running:
        await publish(nc, js_ready, placed())
        await publish(nc, js_ready, entries(rank(1), *[(s, s, Phase.IDLE, None) for s in range(5)]))
        for start in range(0, 2_000, 50):
            burst = [(s, 10 + s / 1000, Phase.DECODE_STREAM, s) for s in range(start, start + 50)]
            await publish(nc, js_ready, entries(rank(0), *burst))
        await until(lambda: running.service.state.runners["i-r0"].seqs.seen == 2_000)
        findings = running.service.findings
        await until(lambda: any(not i.finding.instanceId for i in findings.incidents.values()))
        said = decode(
            (await query(nc, js_ready, "diagnosis", {"kind": "telemetry_flood"})).data, Diagnosis
        )
        health = decode((await query(nc, js_ready, "health")).data, AggregatorHealth)
        kept = decode(
            (await query(nc, js_ready, "timeline", {"instanceId": "i", "limit": 5000})).data,
            ClusterTimeline,
        )
    assert health.heldBytes <= 60_000
    assert list(health.trimmedBytes) == ["node-0"]
    assert health.trimmedBytes["node-0"] > 0
    published: asyncio.Queue[Finding] = asyncio.Queue()

    async def keep(msg: Msg) -> None:
        await published.put(decode(msg.data, Finding))

    await nc.subscribe(js_ready.subjects.diagnosis(""), cb=keep)
    async with aggregator(nc, js_ready, store=EntryStore(max_bytes=60_000)) as again:
        await until(lambda: again.service.state.runners["i-r0"].seqs.seen == 2_000)
        await asyncio.sleep(1.0)  # judged a few times over the replayed flood
        kept_up = [i.finding for i in again.service.findings.incidents.values()]
    (flood,) = said.findings
    assert [f.incidentId for f in kept_up if not f.instanceId] == [flood.incidentId]
    while not published.empty():  # the restarted aggregator took it up: no second one
        assert (await published.get()).incidentId == flood.incidentId
    assert flood.summary.startswith("node node-0 sends more than the aggregator keeps")
    assert (flood.instanceId, flood.culpritRunnerIds) == ("", ["i-r0"])
    by_rank = Counter(e.deviceRank for e in kept.timeline)
    assert by_rank[1] == 5  # every entry of the other node
    assert 0 < by_rank[0] < 2_000


def test_a_flood_is_named_while_the_node_gives_up_history_and_a_while_after() -> None:
    state = ClusterState(store=EntryStore())
    floods = Floods(partition="0/1")
    incidents: dict[str, Incident] = {}

    def judged(trimmed: dict[str, int], moment: float) -> list[str]:
        found = floods.judge(trimmed, state, incidents, now=moment, wall=at(moment))
        incidents.clear()
        incidents.update(found)
        return [i.finding.since for i in incidents.values()]

    assert judged({}, 0) == []
    assert judged({"node-a": 100}, 1) == [at(1)]
    assert judged({"node-a": 200}, 50) == [at(1)]  # one incident while it goes on
    assert judged({"node-a": 200}, 50 + FLOOD_HOLD_S) == [at(1)]
    assert judged({"node-a": 200}, 51 + FLOOD_HOLD_S) == []  # cleared a while after
    (incident,) = floods.judge({"node-a": 300}, state, {}, now=200, wall=at(200)).values()
    finding = incident.finding
    assert floods.owns(finding) == floods.key("node-a")
    assert Floods(partition="1/2").owns(finding) is None  # another partition's
