"""The aggregator against a real nats-server: ordering, findings that appear and clear,
restarts, bad input and query errors."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
import nats
import nats.js.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError

from rankscope.services.aggregator import answers
from rankscope.services.aggregator import core as core_module
from rankscope.services.aggregator import liveness as liveness_module
from rankscope.services.aggregator.diagnosis import Thresholds
from rankscope.services.aggregator.ingest import FOLLOW_RELEASED_S
from rankscope.services.aggregator.service import AggregatorService
from rankscope.services.aggregator.silence import NO_AGENT
from rankscope.services.aggregator.store import EntryStore
from rankscope.shared.headers import ERROR_CODE_HEADER, ERROR_HEADER
from rankscope.shared.jetstream import DEAD_LETTERS_KEPT, Layout
from rankscope.shared.partitions import Partition
from rankscope.shared.provision import ensure
from rankscope.shared.subjects import token
from rankscope.shared.timestamps import format_ts, now
from rankscope.shared.views import VIEWS
from rankscope.shared.wire import (
    ClusterTimeline,
    Diagnosis,
    Finding,
    FindingKind,
    InstanceReleased,
    NodeDiagnostics,
    Phase,
    PlacementRunnerDiagnostics,
    ReleaseCause,
    RunnerHistory,
    RunnerStatusKind,
    RunnerSupervisorDiagnostics,
    RunnerSynopsis,
    TimelineQuery,
    decode,
    encode,
)
from tests.agents_stand_in import answer_probes
from tests.aggregator.builders import at, entries, instances_by_partition, placed, rank, status
from tests.aggregator.running import WAIT, aggregator, publish, query, until
from tests.ranktable.builders import node_info

pytestmark = pytest.mark.nats


async def test_ranks_published_out_of_order_come_back_in_time_order(
    nc: Client, js_ready: Layout
) -> None:
    await publish(nc, js_ready, placed())
    await publish(
        nc, js_ready, entries(rank(1), (0, 2, Phase.CREATED, None), (1, 4, Phase.IDLE, None))
    )
    await publish(
        nc, js_ready, entries(rank(0), (0, 1, Phase.CREATED, None), (1, 3, Phase.IDLE, None))
    )
    async with aggregator(nc, js_ready):
        reply = await query(nc, js_ready, "timeline", {"limit": 10})
        timeline = decode(reply.data, ClusterTimeline)
    assert [(e.at, e.deviceRank) for e in timeline.timeline] == [
        (at(1), 0),
        (at(2), 1),
        (at(3), 0),
        (at(4), 1),
    ]
    assert [r.runnerId for r in timeline.runners] == ["i-r0", "i-r1"]


async def _published(nc: Client, layout: Layout, instance: str) -> asyncio.Queue[Finding]:
    """The findings of `instance` as the aggregator publishes them, from now on."""
    findings: asyncio.Queue[Finding] = asyncio.Queue()

    async def keep(msg: Msg) -> None:
        await findings.put(decode(msg.data, Finding))

    await nc.subscribe(layout.subjects.diagnosis(instance), cb=keep)
    return findings


async def test_disagreement_appears_within_threshold_and_clears(
    nc: Client, js_ready: Layout
) -> None:
    findings = await _published(nc, js_ready, "i")
    await answer_probes(nc, js_ready, placed())  # both nodes alive: only the ranks disagree
    async with aggregator(nc, js_ready, thresholds=Thresholds(working=1.0)):
        await publish(nc, js_ready, placed())
        await publish(nc, js_ready, entries(rank(0), (0, 1, Phase.PREFILL_PIPELINE, 7)))
        await publish(nc, js_ready, entries(rank(1), (0, 1, Phase.DECODE_BARRIER, 8)))
        opened = await asyncio.wait_for(findings.get(), 1.0 + 1.0 + 0.5)
        assert opened.kind is FindingKind.RANK_DISAGREEMENT
        assert opened.culpritRunnerIds == ["i-r0"]
        assert opened.open
        served = json.loads((await query(nc, js_ready, "diagnosis")).data)
        assert served["findings"][0]["culpritRanks"] == [0]
        await publish(nc, js_ready, entries(rank(0), (1, 2, Phase.DECODE_BARRIER, 8)))
        cleared = await asyncio.wait_for(findings.get(), WAIT)
        assert cleared.kind is FindingKind.RANK_DISAGREEMENT
        assert not cleared.open


async def test_an_incident_outlasting_a_restart_is_one_incident_closed_once(
    nc: Client, js_ready: Layout
) -> None:
    findings = await _published(nc, js_ready, "i")
    await answer_probes(nc, js_ready, placed())
    await publish(nc, js_ready, placed())
    await publish(nc, js_ready, entries(rank(0), (0, 1, Phase.PREFILL_PIPELINE, 7)))
    await publish(nc, js_ready, entries(rank(1), (0, 1, Phase.DECODE_BARRIER, 8)))
    limits = Thresholds(working=1.0)
    async with aggregator(nc, js_ready, thresholds=limits):
        opened = await asyncio.wait_for(findings.get(), WAIT)
        assert opened.open
        assert opened.incidentId
    unwatched = await asyncio.wait_for(findings.get(), WAIT)  # said as it stopped
    assert (unwatched.incidentId, unwatched.open) == (opened.incidentId, True)
    assert unwatched.unwatchedSince is not None
    assert unwatched.unwatchedUntil is None
    async with aggregator(nc, js_ready, thresholds=limits) as restarted:
        await asyncio.sleep(1.5)  # judged again, and again, as the stall goes on
        (kept,) = restarted.service.findings.incidents.values()
        assert (kept.finding.incidentId, kept.finding.since) == (opened.incidentId, opened.since)
        await publish(nc, js_ready, entries(rank(0), (1, 2, Phase.DECODE_BARRIER, 8)))
        said = [await asyncio.wait_for(findings.get(), WAIT)]
        while said[-1].open:
            said.append(await asyncio.wait_for(findings.get(), WAIT))
    assert {f.incidentId for f in said} == {opened.incidentId}  # no second incident
    assert [f.open for f in said].count(False) == 1  # closed once
    cleared = said[-1]
    assert cleared.since == opened.since
    assert cleared.unwatchedSince == unwatched.unwatchedSince  # its downtime is said, and
    assert cleared.unwatchedUntil is not None  # left out of how long it was seen open
    assert opened.since <= unwatched.unwatchedSince <= cleared.unwatchedUntil
    assert cleared.unwatchedUntil <= (cleared.clearedAt or "")


async def test_changed_instances_are_judged_at_once_and_every_instance_as_time_passes(
    nc: Client, js_ready: Layout, monkeypatch: pytest.MonkeyPatch
) -> None:
    findings = await _published(nc, js_ready, "i")
    await answer_probes(nc, js_ready, placed())
    async with aggregator(nc, js_ready, thresholds=Thresholds(working=1.0)):
        await publish(nc, js_ready, placed())
        await publish(nc, js_ready, entries(rank(0), (0, 1, Phase.PREFILL_PIPELINE, 7)))
        await publish(nc, js_ready, entries(rank(1), (0, 1, Phase.DECODE_BARRIER, 8)))
        # nothing arrives after these: only judging every instance sees them go stale
        opened = await asyncio.wait_for(findings.get(), WAIT)
        assert (opened.kind, opened.open) == (FindingKind.RANK_DISAGREEMENT, True)
        monkeypatch.setattr(core_module, "SWEEP_S", 3600.0)  # no more sweeps
        await publish(nc, js_ready, entries(rank(0), (1, 2, Phase.DECODE_BARRIER, 8)))
        cleared = await asyncio.wait_for(findings.get(), WAIT)  # judged: it changed
        assert (cleared.kind, cleared.open) == (FindingKind.RANK_DISAGREEMENT, False)


def _views(service: AggregatorService) -> tuple[object, ...]:
    timeline = answers.timeline(
        service.state, TimelineQuery(limit=100_000), local_node_id="agg", now=time.time()
    )
    runners = [replace_seconds(r) for r in timeline.runners]
    return timeline.timeline, runners, answers.placement(service.state, local_node_id="agg")


def replace_seconds(synopsis: RunnerSynopsis) -> RunnerSynopsis:
    return msgspec.structs.replace(synopsis, secondsInPhase=0.0)


async def test_a_restart_mid_stream_rebuilds_the_same_views(nc: Client, js_ready: Layout) -> None:
    total = 3000

    async def stream(first: int, last: int) -> None:
        for start in range(first, last, 50):
            for r in (0, 1):
                await publish(
                    nc,
                    js_ready,
                    entries(
                        rank(r),
                        *[
                            (s, s / 100 + r / 1000, Phase.DECODE_STREAM, s)
                            for s in range(start, min(start + 50, last))
                        ],
                    ),
                )

    await publish(nc, js_ready, placed())
    async with aggregator(nc, js_ready) as reference:
        async with aggregator(nc, js_ready) as crashed:
            await stream(0, total // 2)
            await crashed.halt()  # stopped mid-stream
        await stream(total // 2, total)
        async with aggregator(nc, js_ready) as restarted:
            await until(lambda: reference.service.state.store.size == 2 * total)
            assert restarted.service.state.store.size == 2 * total
            assert _views(restarted.service) == _views(reference.service)


async def test_malformed_messages_are_counted_dead_lettered_and_skipped(
    nc: Client, js_ready: Layout
) -> None:
    js = nc.jetstream()
    subject = js_ready.subjects.runner("node-0", "i", 0, "phase")
    await publish(nc, js_ready, placed())
    bad = [
        b"\\x00\\xff",
        b"{}",
        b'{"type": "PhaseEntries"}',
        b"[1, 2]",
        b'"x" ' * 100,
        json.dumps(
            {
                "type": "PhaseEntries",
                "runner": {**json.loads(encode(rank(0))), "deviceRank": -1},
                "entries": [],
            }
        ).encode(),
        json.dumps(
            {
                "type": "PhaseEntries",
                "runner": {**json.loads(encode(rank(0))), "deviceRank": 5},
                "entries": [],
            }
        ).encode(),
    ]
    valid = 0
    for index in range(1000):
        await js.publish(subject, bad[index % len(bad)])
        await js.publish(
            subject, encode(entries(rank(0), (index, index, Phase.DECODE_STREAM, index)))
        )
        valid += 1
    await js.publish(js_ready.subjects.placement("x"), b'{"type": "InstanceCreated"}')
    await js.publish(js_ready.subjects.tasks("x"), b"not json")
    # an id no subject can carry: findings and probes are published by these ids
    await js.publish(js_ready.subjects.placement("y"), encode(placed(instance="y" * 600)))
    async with aggregator(nc, js_ready) as running:
        state = running.service.state
        assert state.store.size == valid
        assert running.service.dead_letters.total == 1003
        assert running.service.dead_letters.counts["telemetry_rank_outside_world"] == 142
        assert running.service.dead_letters.counts["id_too_long"] == 1
        assert set(state.instances) == {"i"}  # the nonsense ones are not
        await running.service.dead_letters.settled()
    info = await js.stream_info(js_ready.deadletter_stream.name)
    assert info.state.last_seq == 1003  # every one written, its writer's newest kept
    assert info.state.messages == DEAD_LETTERS_KEPT


async def test_a_node_cannot_speak_for_another_node_s_runner(nc: Client, js_ready: Layout) -> None:
    js = nc.jetstream()
    await publish(nc, js_ready, placed())
    # with node-0's credentials, a death of node-1's rank, pinned far ahead by its seq
    spoof = status(rank(1), 900_000_000, RunnerStatusKind.FAILED, alive=False, detail="spoof")
    await js.publish(js_ready.subjects.runner("node-0", "i", 1, "status"), encode(spoof))
    await js.publish(js_ready.subjects.runner("node-0", "i", 0, "status"), encode(spoof))
    await js.publish(js_ready.subjects.runner("node-1", "i", 1, "memory"), encode(spoof))
    honest = status(rank(1), 0, RunnerStatusKind.READY)
    await js.publish(js_ready.subjects.runner("node-1", "i", 1, "status"), encode(honest))
    async with aggregator(nc, js_ready) as running:
        assert running.service.dead_letters.counts == {"telemetry_identity": 3}
        (kept,) = [v.status for v in running.service.state.runners.values() if v.status]
        assert kept == honest


async def test_a_node_cannot_fail_another_node_s_runner_from_its_own_subject(
    nc: Client, js_ready: Layout
) -> None:
    js = nc.jetstream()
    await publish(nc, js_ready, placed())
    honest = status(rank(1), 0, RunnerStatusKind.READY)
    await js.publish(js_ready.subjects.runner("node-1", "i", 1, "status"), encode(honest))
    # node-0, on its own subject, names node-1's runner and says it runs on node-0
    lie = msgspec.structs.replace(rank(1), nodeId="node-0")
    spoof = status(lie, 900, RunnerStatusKind.FAILED, alive=False, detail="spoof")
    await js.publish(js_ready.subjects.runner("node-0", "i", 1, "status"), encode(spoof))
    async with aggregator(nc, js_ready) as running:
        assert running.service.dead_letters.counts == {"telemetry_identity": 1}
        assert running.service.state.runners["i-r1"].status == honest


async def test_telemetry_of_a_runner_no_placement_made_changes_nothing(
    nc: Client, js_ready: Layout
) -> None:
    js = nc.jetstream()
    moment = [1000.0]
    future = rank(0, "j")  # placed only later
    poison = status(future, 500_000_000, RunnerStatusKind.FAILED, alive=False, detail="poison")
    await js.publish(js_ready.subjects.runner("node-0", "j", 0, "status"), encode(poison))
    never = rank(0, "k")
    await publish(nc, js_ready, entries(never, (0, 1, Phase.IDLE, None)))
    async with aggregator(nc, js_ready, clock=lambda: moment[0]) as running:
        service = running.service
        await publish(nc, js_ready, placed("j"))
        honest = status(future, 0, RunnerStatusKind.READY)
        await js.publish(js_ready.subjects.runner("node-0", "j", 0, "status"), encode(honest))
        await until(lambda: service.state.runners["j-r0"].status == honest)
        assert service.dead_letters.counts == {"telemetry_before_placement": 1}
        moment[0] += 31  # what no placement claims in time is refused
        await until(lambda: service.dead_letters.counts.get("telemetry_unplaced") == 1)
        assert "k-r0" not in service.state.runners
        assert "k" not in service.findings.incidents


async def test_a_runner_s_first_seq_must_be_one_it_could_have_reached(
    nc: Client, js_ready: Layout
) -> None:
    js = nc.jetstream()
    await publish(nc, js_ready, placed())
    far = status(rank(1), 500_000_000, RunnerStatusKind.FAILED, alive=False, detail="far")
    await js.publish(js_ready.subjects.runner("node-1", "i", 1, "status"), encode(far))
    async with aggregator(nc, js_ready) as running:
        assert running.service.dead_letters.counts == {"telemetry_seq_jump": 1}
        assert running.service.state.runners["i-r1"].status is None


async def test_huge_telemetry_fields_are_refused_and_every_timeline_stays_small(
    nc: Client, js_ready: Layout
) -> None:
    js = nc.jetstream()
    await publish(nc, js_ready, placed())
    subject = js_ready.subjects.runner("node-0", "i", 0, "phase")
    with pytest.raises(nats.js.errors.APIError, match="message size exceeds maximum"):
        await js.publish(subject, b"x" * (2 << 20))  # the stream itself stores none so big
    wide = entries(rank(0), (0, 1, Phase.IDLE, None))
    huge = msgspec.structs.replace(
        wide, entries=[msgspec.structs.replace(wide.entries[0], detail="d" * (100 << 10))]
    )
    await js.publish(subject, encode(huge))
    await publish(nc, js_ready, entries(rank(0), (1, 2, Phase.IDLE, None)))
    async with aggregator(nc, js_ready) as running:
        assert running.service.dead_letters.counts == {"telemetry_oversize": 1}
        reply = await query(nc, js_ready, "timeline", {"limit": 100})
        assert len(reply.data) < 10_000
        assert [e["at"] for e in json.loads(reply.data)["timeline"]] == [at(2)]


async def test_a_node_cannot_pin_its_own_runner_with_an_implausible_seq(
    nc: Client, js_ready: Layout
) -> None:
    js = nc.jetstream()
    subject = js_ready.subjects.runner("node-1", "i", 1, "status")
    await publish(nc, js_ready, placed())
    await js.publish(subject, encode(status(rank(1), 0, RunnerStatusKind.READY)))
    jump = status(rank(1), 900_000_000, RunnerStatusKind.FAILED, alive=False, detail="jump")
    await js.publish(subject, encode(jump))
    later = status(rank(1), 1, RunnerStatusKind.RUNNING)
    await js.publish(subject, encode(later))
    async with aggregator(nc, js_ready) as running:
        assert running.service.dead_letters.counts == {"telemetry_seq_jump": 1}
        assert running.service.state.runners["i-r1"].status == later


def _stamped(ref: Any, seq: int, moment: str, phase: Phase) -> bytes:
    batch = json.loads(encode(entries(ref, (seq, 0, phase, None))))
    batch["entries"][0]["at"] = moment
    return json.dumps(batch).encode()


async def test_a_clock_far_ahead_freezes_no_view_and_bad_times_are_dead_lettered(
    nc: Client, js_ready: Layout
) -> None:
    js = nc.jetstream()
    subject = js_ready.subjects.runner("node-0", "i", 0, "phase")
    await publish(nc, js_ready, placed())
    async with aggregator(nc, js_ready) as running:
        state = running.service.state
        for bad in ("not-a-time", "2026-02-30T10:00:00.000000Z", "2026-11-21T12:00:00", ""):
            await js.publish(subject, _stamped(rank(0), 0, bad, Phase.CREATED))
        await js.publish(subject, _stamped(rank(0), 0, "9999-12-31T23:59:59.000000Z", Phase.IDLE))
        await until(lambda: state.store.size == 1)
        await js.publish(subject, _stamped(rank(0), 1, now(), Phase.DECODE_STREAM))
        await until(lambda: state.store.size == 2)
        assert running.service.dead_letters.counts == {"telemetry_undecodable": 4}
        view = state.runners["i-r0"]
        assert view.synopsis.phase is Phase.DECODE_STREAM  # the newest by seq, not by its clock
        newest = decode((await query(nc, js_ready, "timeline", {"limit": 1})).data, ClusterTimeline)
        assert [e.phase for e in newest.timeline] == [Phase.DECODE_STREAM]


async def test_a_batch_with_one_bad_time_is_refused_whole_and_offsets_are_taken_in_utc(
    nc: Client, js_ready: Layout
) -> None:
    """Times of a batch are checked at once where they can be: a bad one anywhere in it
    refuses all of it, whatever its neighbours look like; one with an offset is taken and
    shown in UTC, like a batch's entries one by one."""
    js = nc.jetstream()
    subject = js_ready.subjects.runner("node-0", "i", 0, "phase")
    await publish(nc, js_ready, placed())
    async with aggregator(nc, js_ready) as running:
        state = running.service.state
        good = json.loads(
            encode(entries(rank(0), *[(s, s / 10, Phase.IDLE, None) for s in range(3)]))
        )
        for bad in (  # in order and of one second, each but the last: checked at once
            [at(0), "2026-11-21T12:00:00.10000\u0663Z", at(0.2)],  # a digit, not an ASCII one
            [at(0), at(0.1) + "|", at(0.2)],
            [text.replace("11-21", "11-31") for text in (at(0), at(0.1), at(0.2))],
            [at(0), "2026-11-21T12:00:00", at(0.2)],
        ):
            batch = json.loads(json.dumps(good))
            for entry, text in zip(batch["entries"], bad, strict=True):
                entry["at"] = text
            await js.publish(subject, json.dumps(batch).encode())
        offset = json.loads(json.dumps(good))
        offset["entries"][2]["at"] = "2026-11-21T14:00:00.5+02:00"
        await js.publish(subject, json.dumps(offset).encode())
        await until(lambda: state.store.size == 3)
        assert running.service.dead_letters.counts == {"telemetry_undecodable": 4}
        assert state.runners["i-r0"].synopsis.last_at == "2026-11-21T12:00:00.500000Z"
        shown = decode((await query(nc, js_ready, "timeline", {"limit": 9})).data, ClusterTimeline)
        assert [e.at for e in shown.timeline] == [at(0), at(0.1), "2026-11-21T12:00:00.500000Z"]


async def test_query_errors_say_what_is_wrong(nc: Client, js_ready: Layout) -> None:
    async with aggregator(nc, js_ready):
        with pytest.raises(NoRespondersError):  # no such view is served
            await query(nc, js_ready, "nonsense")
        bad = await query(nc, js_ready, "timeline", {"limit": 0})
        assert bad.headers is not None
        assert bad.headers[ERROR_CODE_HEADER] == "422"
        assert "$.limit" in bad.headers[ERROR_HEADER]
        extra = await query(nc, js_ready, "timeline", {"limitt": 5})
        assert extra.headers is not None
        assert "unknown field `limitt`" in extra.headers[ERROR_HEADER]
        for field in ("since", "until"):
            garbled = await query(nc, js_ready, "timeline", {field: "garbage"})
            assert garbled.headers is not None
            assert garbled.headers[ERROR_CODE_HEADER] == "422", garbled.headers
            assert "'garbage'" in garbled.headers[ERROR_HEADER]
        offset = await query(nc, js_ready, "timeline", {"since": "2026-11-21T12:00:00+02:00"})
        assert offset.headers is None or ERROR_CODE_HEADER not in offset.headers
        missing = await query(nc, js_ready, "placement", {"runnerId": "nope"})
        assert missing.headers is not None
        assert missing.headers[ERROR_CODE_HEADER] == "404"
        assert missing.headers[ERROR_HEADER] == "no placed runner 'nope'"


async def test_it_is_a_nats_micro_service_with_an_endpoint_per_view(
    nc: Client, js_ready: Layout
) -> None:
    async with aggregator(nc, js_ready):
        info = json.loads((await nc.request("$SRV.INFO.rankscope-aggregator", b"", WAIT)).data)
        assert info["name"] == "rankscope-aggregator"
        assert {e["name"]: e["subject"] for e in info["endpoints"]} == {
            view.name: js_ready.subjects.query(view.name) for view in VIEWS
        }


async def test_two_aggregators_share_the_queries_each_answered_once(
    nc: Client, js_ready: Layout
) -> None:
    async with aggregator(nc, js_ready), aggregator(nc, js_ready):
        for _ in range(20):
            assert (await query(nc, js_ready, "health")).headers is None
        inbox = nc.new_inbox()
        stats: asyncio.Queue[Msg] = asyncio.Queue()
        subscription = await nc.subscribe(inbox, cb=stats.put)
        await nc.publish("$SRV.STATS.rankscope-aggregator", b"", reply=inbox)
        answers = [json.loads((await asyncio.wait_for(stats.get(), WAIT)).data) for _ in "ab"]
        await subscription.unsubscribe()
        served = [
            e["num_requests"] for a in answers for e in a["endpoints"] if e["name"] == "health"
        ]
        assert sum(served) == 20, served  # not 40: one instance answers each
        missing = await query(nc, js_ready, "placement", {"runnerId": "nope"})
        assert missing.headers is not None
        assert missing.headers[ERROR_CODE_HEADER] == "404"
        health = json.loads((await query(nc, js_ready, "health")).data)
        assert health["ready"] is True


async def test_placement_query_serves_one_runner(nc: Client, js_ready: Layout) -> None:
    await publish(nc, js_ready, placed())
    async with aggregator(nc, js_ready):
        reply = await query(nc, js_ready, "placement", {"runnerId": "i-r1"})
        one = decode(reply.data, PlacementRunnerDiagnostics)
        assert (one.deviceRank, one.startLayer, one.endLayer) == (1, 4, 8)
        every = json.loads((await query(nc, js_ready, "placement")).data)
        assert [p["runnerId"] for p in every] == ["i-r0", "i-r1"]


async def test_silent_and_expired_nodes_are_unreachable_with_reasons(
    nc: Client, js_ready: Layout
) -> None:
    kv = await nc.jetstream().key_value(js_ready.nodes_bucket.bucket)
    await kv.put(token("node-0"), encode(node_info("node-0", 8, address="10.1.1.1")))
    await publish(nc, js_ready, placed())
    async with aggregator(nc, js_ready, probe_interval=0.1, probe_timeout=0.2) as running:
        await running.service.liveness.probe()
        unreachable = running.service.state.unreachable
        assert set(unreachable) == {"node-0", "node-1"}
        assert unreachable["node-0"].url == "10.1.1.1"
        assert unreachable["node-0"].error == NO_AGENT
        assert unreachable["node-1"].error.startswith("no heartbeat")
        timeline = decode((await query(nc, js_ready, "timeline")).data, ClusterTimeline)
        assert {u.nodeId for u in timeline.unreachableNodes} == {"node-0", "node-1"}


async def test_a_node_is_unreachable_at_once_without_an_agent_else_after_two_silent_rounds(
    nc: Client, js_ready: Layout, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(liveness_module, "PROBE_SLICE", 64)  # 200 nodes asked in 4 slices
    kv = await nc.jetstream().key_value(js_ready.nodes_bucket.bucket)
    nodes = [f"node-{i}" for i in range(200)]
    for node_id in nodes:
        await kv.put(token(node_id), encode(node_info(node_id, 8)))
    misbehave = asyncio.Event()

    async def answer(msg: Msg) -> None:
        node_id = msg.subject.rpartition(".")[0].rpartition(".")[2]
        number = int(node_id.removeprefix("node-"))
        reply = NodeDiagnostics(nodeId=node_id, friendlyName="", address="", generatedAt=now())
        if number % 4 == 0 or not misbehave.is_set():
            await msg.respond(encode(reply))
        elif number % 4 == 1:
            await msg.respond(b"{not json")
        elif number % 4 == 2:
            await asyncio.sleep(1.0)  # after the round's deadline
            await msg.respond(encode(reply))
        # and the rest say nothing

    for node_id in nodes[:150]:  # the last 50 have no agent at all
        await nc.subscribe(js_ready.subjects.node_diagnostics(node_id), cb=answer)
    async with aggregator(nc, js_ready, probe_interval=60, probe_timeout=0.5) as running:
        await running.service.liveness.probe()
        at_first = dict(running.service.state.unreachable)
        misbehave.set()
        await running.service.liveness.probe()
        once = dict(running.service.state.unreachable)
        await running.service.liveness.probe()
        twice = running.service.state.unreachable
    assert set(at_first) == set(once) == set(nodes[150:])  # one silent round: a busy node
    assert {u.error for u in at_first.values()} == {NO_AGENT}
    answered = {n for i, n in enumerate(nodes) if i < 150 and i % 4 == 0}
    assert set(twice) == set(nodes) - answered  # late, garbled or mute two rounds in a row
    assert twice["node-1"].error.startswith(
        "no answer to live diagnostics within 0.5s, 2 rounds in a row"
    )


async def _two_nodes_then_silent(
    nc: Client, layout: Layout
) -> tuple[asyncio.Event, Callable[[str], Awaitable[None]]]:
    """node-0 and node-1 beating once and answering probes until the event is set; and
    a way to make one beat again."""
    kv = await nc.jetstream().key_value(layout.nodes_bucket.bucket)

    async def beat(node_id: str) -> None:
        await kv.put(token(node_id), encode(node_info(node_id, 8)))

    mute = asyncio.Event()
    answers = {n: answer_to(n) for n in ("node-0", "node-1")}

    async def answer(msg: Msg) -> None:
        if not mute.is_set():
            await answers[msg.subject.rpartition(".")[0].rpartition(".")[2]](msg)

    for node_id in answers:
        await beat(node_id)
        await nc.subscribe(layout.subjects.node_diagnostics(node_id), cb=answer)
    return mute, beat


async def test_heartbeats_read_late_by_a_busy_aggregator_make_no_node_overdue(
    nc: Client, js_ready: Layout
) -> None:
    mute, beat = await _two_nodes_then_silent(nc, js_ready)
    moment = [1000.0]
    async with aggregator(
        nc, js_ready, probe_interval=60, probe_timeout=0.3, clock=lambda: moment[0]
    ) as running:
        await until(lambda: len(running.service.liveness.heartbeats) == 2)
        await running.service.liveness.probe()
        assert running.service.state.unreachable == {}
        mute.set()
        # by its own clock, this aggregator read nothing for 6 s (it was busy): node-0's
        # beat looks old, but NATS stored it as recently as the newest beat read since
        moment[0] += js_ready.node_ttl_s * 0.6
        await beat("node-1")
        await until(lambda: running.service.liveness.heartbeats["node-1"] == moment[0])
        await running.service.liveness.probe()
        once = dict(running.service.state.unreachable)
        await running.service.liveness.probe()
        twice = running.service.state.unreachable
    assert once == {}  # one silent round each: busy nodes
    assert set(twice) == {"node-0", "node-1"}
    assert twice["node-0"].error.startswith(
        "no answer to live diagnostics within 0.3s, 2 rounds in a row"
    )


async def test_a_silent_node_is_asked_again_once_its_heartbeat_is_overdue_not_a_round_later(
    nc: Client, layout: Layout
) -> None:
    short = dataclasses.replace(layout, node_ttl_s=2.0)  # overdue after 1 s
    await ensure(nc.jetstream(), short)
    kv = await nc.jetstream().key_value(short.nodes_bucket.bucket)
    await kv.put(token("node-0"), encode(node_info("node-0", 8)))
    await kv.put(token("node-1"), encode(node_info("node-1", 8)))
    asked: list[str] = []

    async def count(msg: Msg) -> None:  # node-0 reads, never answers
        asked.append(msg.subject)

    await nc.subscribe(short.subjects.node_diagnostics("node-0"), cb=count)
    await nc.subscribe(short.subjects.node_diagnostics("node-1"), cb=answer_to("node-1"))
    async with aggregator(nc, short, probe_interval=60, probe_timeout=0.3) as running:
        await until(lambda: len(asked) == 1)
        assert running.service.state.unreachable == {}  # one silent round: a busy node
        await until(lambda: "node-0" in running.service.state.unreachable)  # in 1 s, not 60
        error = running.service.state.unreachable["node-0"].error
    assert len(asked) == 2  # the round, and the recheck of the silent node alone
    assert error.startswith("no answer to live diagnostics within 0.3s and no heartbeat for 1.")


def answer_to(node_id: str) -> Callable[[Msg], Awaitable[None]]:
    """A node's agent answering probes at once, listing no runner."""
    reply = encode(NodeDiagnostics(nodeId=node_id, friendlyName="", address="", generatedAt=now()))

    async def answer(msg: Msg) -> None:
        await msg.respond(reply)

    return answer


def _answer_elsewhere(
    url: str, layout: Layout, nodes: list[str], up: threading.Event, done: threading.Event
) -> None:
    """Agents of `nodes` answering probes in 0.15 s, on a loop of their own until `done`."""

    async def serve() -> None:
        agents = await nats.connect(url)
        for node_id in nodes:
            said = encode(  # big: reading them all takes the aggregator several turns
                NodeDiagnostics(
                    nodeId=node_id, friendlyName="x" * 50_000, address="", generatedAt=now()
                )
            )

            async def answer(msg: Msg, said: bytes = said) -> None:
                await asyncio.sleep(0.15)  # well within the deadline
                await msg.respond(said)

            await agents.subscribe(layout.subjects.node_diagnostics(node_id), cb=answer)
        await agents.flush()
        up.set()
        await asyncio.to_thread(done.wait)
        await agents.close()

    asyncio.run(serve())


async def test_answers_in_time_count_though_the_aggregator_was_too_busy_to_read_them(
    nc: Client, js_ready: Layout, nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    kv = await nc.jetstream().key_value(js_ready.nodes_bucket.bucket)
    nodes = [f"node-{i}" for i in range(20)]
    for node_id in [*nodes, "node-without-agent"]:
        await kv.put(token(node_id), encode(node_info(node_id, 8)))
    up, done = threading.Event(), threading.Event()
    agents = threading.Thread(target=_answer_elsewhere, args=(nats_url, js_ready, nodes, up, done))
    agents.start()
    try:
        assert await asyncio.to_thread(up.wait, WAIT)
        async with aggregator(nc, js_ready, probe_interval=60, probe_timeout=0.3) as running:
            publish, flush, probes_out = nc.publish, nc.flush, []

            async def publish_noting(subject: str, *args: Any, **kwargs: Any) -> None:
                probes_out.append(subject.endswith(".diagnostics"))
                await publish(subject, *args, **kwargs)

            async def flush_then_stall(timeout: int = 10) -> None:  # noqa: ASYNC109
                await flush(timeout)
                if any(probes_out):  # the probes are out: the loop stalls while the
                    # answers come and past the deadline
                    asyncio.get_running_loop().call_later(0.05, time.sleep, 0.6)
                probes_out.clear()

            monkeypatch.setattr(nc, "publish", publish_noting)
            monkeypatch.setattr(nc, "flush", flush_then_stall)
            await running.service.liveness.probe()
            assert set(running.service.state.unreachable) == {"node-without-agent"}
    finally:
        done.set()
        await asyncio.to_thread(agents.join)


async def test_a_node_whose_clock_is_off_is_flagged_and_a_bad_heartbeat_dead_lettered(
    nc: Client, js_ready: Layout, caplog: pytest.LogCaptureFixture
) -> None:
    kv = await nc.jetstream().key_value(js_ready.nodes_bucket.bucket)
    ahead = format_ts(datetime.now(UTC) + timedelta(seconds=30))
    await kv.put(token("node-0"), encode(node_info("node-0", 8, lastHeartbeat=ahead)))
    await kv.put(token("node-1"), encode(node_info("node-1", 8)))
    bad = json.loads(encode(node_info("node-2", 8)))
    await kv.put(token("node-2"), json.dumps({**bad, "lastHeartbeat": "yesterday"}).encode())
    async with aggregator(nc, js_ready) as running:
        offsets = running.service.liveness.clock_offsets
        await until(lambda: len(offsets) == 2)
        assert 29 < offsets["node-0"] < 31
        assert abs(offsets["node-1"]) < 2
        assert running.service.dead_letters.counts == {"node_undecodable": 1}
        health = json.loads((await query(nc, js_ready, "health")).data)
        assert set(health["clockOffsets"]) == {"node-0", "node-1"}
    assert "the clock of node node-0 is 30.0s ahead of the NATS server's" in caplog.text


async def test_identical_timeline_queries_share_an_answer_until_something_changes(
    nc: Client, js_ready: Layout
) -> None:
    await publish(nc, js_ready, placed())
    async with aggregator(nc, js_ready):
        first = (await query(nc, js_ready, "timeline", {"limit": 5})).data
        again = (await query(nc, js_ready, "timeline", {"limit": 5})).data
        assert again == first  # same generatedAt: built once
        await publish(nc, js_ready, entries(rank(0), (0, 1, Phase.CREATED, None)))
        changed = await _until_async(
            lambda: query(nc, js_ready, "timeline", {"limit": 5}), lambda m: m.data != first
        )
        assert len(decode(changed.data, ClusterTimeline).timeline) == 1


async def _until_async(make: Any, check: Any) -> Any:
    for _ in range(int(WAIT / 0.02)):
        found = await make()
        if check(found):
            return found
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


async def test_an_answer_too_big_for_nats_is_a_clear_error(nc: Client, js_ready: Layout) -> None:
    await publish(nc, js_ready, placed())
    await publish(
        nc, js_ready, entries(rank(0), *[(s, s, Phase.DECODE_STREAM, s) for s in range(50)])
    )
    async with aggregator(nc, js_ready):
        nc._max_payload = 4000  # as if the server allowed only 4 kB
        reply = await query(nc, js_ready, "timeline", {"limit": 50})
        assert reply.headers is not None
        assert reply.headers[ERROR_CODE_HEADER] == "413"
        assert "narrow the query" in reply.headers[ERROR_HEADER]
        small = await query(nc, js_ready, "timeline", {"limit": 2})
        assert len(decode(small.data, ClusterTimeline).timeline) == 2


async def _publish_many(nc: Client, layout: Layout, count: int) -> None:
    js, ref = nc.jetstream(), rank(0)
    subject = layout.subjects.runner(ref.nodeId, ref.instanceId, ref.deviceRank, "phase")
    for first in range(0, count, 500):
        batch = entries(
            ref, *[(s, s / 1000, Phase.DECODE_STREAM, s) for s in range(first, first + 500)]
        )
        await js.publish(subject, encode(batch))


async def test_a_big_timeline_is_the_same_answer_and_small_queries_overtake_it(
    nc: Client, js_ready: Layout
) -> None:
    await publish(nc, js_ready, placed())
    await _publish_many(nc, js_ready, 60_000)
    async with aggregator(nc, js_ready) as running:
        await until(lambda: running.service.state.store.size == 60_000)
        arrived: list[str] = []

        async def ask(view: str, body: object) -> Msg:
            reply = await query(nc, js_ready, view, body)
            arrived.append(view)
            return reply

        big, small = await asyncio.gather(ask("timeline", {"limit": 60_000}), ask("diagnosis", {}))
        assert arrived == ["diagnosis", "timeline"]  # not queued behind the big build
        decode(small.data, Diagnosis)
        built = decode(big.data, ClusterTimeline)
        whole = answers.timeline(
            running.service.state, TimelineQuery(limit=60_000), local_node_id="agg", now=time.time()
        )
        assert [e.attrs["step"] for e in built.timeline] == list(range(60_000))
        assert built.timeline == whole.timeline
        assert [r.runnerId for r in built.runners] == [r.runnerId for r in whole.runners]


async def test_history_says_where_each_runner_s_history_starts_and_what_is_lacking(
    nc: Client, js_ready: Layout
) -> None:
    await publish(nc, js_ready, placed())
    # seqs 0-99 were evicted before anyone read them; 150 never arrived
    await publish(
        nc,
        js_ready,
        entries(rank(0), *[(s, s, Phase.DECODE_STREAM, s) for s in range(100, 200) if s != 150]),
    )
    async with aggregator(nc, js_ready, EntryStore(per_runner=50)) as running:
        await until(lambda: running.service.state.store.evicted == 49)
        history = decode((await query(nc, js_ready, "history")).data, list[RunnerHistory])
    first, second = history
    assert (first.runnerId, first.firstSeq, first.lastSeq, first.missingSeqs) == (
        "i-r0",
        100,
        199,
        1,
    )
    # the aggregator's own retention kept the newest 50 of 99
    assert (first.heldEntries, first.evictedEntries, first.oldestAt) == (50, 49, at(149))
    assert (second.runnerId, second.firstSeq, second.heldEntries) == ("i-r1", None, 0)


async def test_a_chatty_runner_evicts_only_its_own_history(nc: Client, layout: Layout) -> None:
    capped = dataclasses.replace(layout, telemetry_max_msgs_per_subject=100)
    await ensure(nc.jetstream(), capped)
    await publish(nc, capped, placed())
    chatty, quiet = rank(0), rank(1)
    for seq in range(500):
        await publish(nc, capped, entries(chatty, (seq, seq, Phase.DECODE_STREAM, seq)))
    for seq in range(50):
        await publish(nc, capped, entries(quiet, (seq, seq, Phase.DECODE_STREAM, seq)))
    async with aggregator(nc, capped) as running:
        await until(lambda: running.service.state.store.size == 150)
        history = decode((await query(nc, capped, "history")).data, list[RunnerHistory])
    assert [(h.runnerId, h.firstSeq, h.heldEntries) for h in history] == [
        ("i-r0", 400, 100),
        ("i-r1", 0, 50),
    ]


async def test_seqs_acknowledged_but_never_received_show_as_unseen(
    nc: Client, js_ready: Layout
) -> None:
    await publish(nc, js_ready, placed())
    await publish(
        nc, js_ready, entries(rank(0), *[(s, s, Phase.DECODE_STREAM, s) for s in range(120)])
    )

    async def node_0_answers(msg: Msg) -> None:  # node-0's agent: JetStream acked up to 149
        ranks = [
            RunnerSupervisorDiagnostics(
                runnerId=f"i-r{r}",
                nodeId=f"node-{r}",
                instanceId="i",
                modelId="tiny",
                deviceRank=r,
                worldSize=2,
                startLayer=0,
                endLayer=4,
                nLayers=8,
                processAlive=True,
                statusKind="RunnerRunning",
                acknowledgedSeq=149,
            )
            for r in (0, 1)  # it also speaks for node-1's runner, which must be ignored
        ]
        answer = NodeDiagnostics(
            nodeId="node-0", friendlyName="a", address="127.0.0.1", generatedAt=at(0), runners=ranks
        )
        await msg.respond(encode(answer))

    responder = await nc.subscribe(js_ready.subjects.node_diagnostics("node-0"), cb=node_0_answers)
    async with aggregator(nc, js_ready) as running:
        await until(lambda: running.service.state.store.size == 120)
        await running.service.liveness.probe()
        first, second = decode((await query(nc, js_ready, "history")).data, list[RunnerHistory])
    await responder.unsubscribe()
    assert (first.lastSeq, first.acknowledgedSeq, first.unseenSeqs) == (119, 149, 30)
    assert (second.acknowledgedSeq, second.unseenSeqs) == (None, 0)


async def test_a_partition_is_delivered_its_own_instances_alone(
    nc: Client, js_ready: Layout
) -> None:
    mine, theirs = instances_by_partition(2, 2)[0], instances_by_partition(2, 2)[1]
    early, late = mine
    for name in [early, *theirs]:
        await publish(nc, js_ready, placed(name))
    for name in [late, early, *theirs]:  # `late` is named before its placement is stored
        await publish(nc, js_ready, entries(rank(0, name), (0, 1, Phase.CREATED, None)))
    async with aggregator(nc, js_ready, partition=Partition(0, 2)) as running:
        service = running.service
        await until(lambda: early in service.state.instances)
        await publish(nc, js_ready, placed(late))
        await publish(nc, js_ready, entries(rank(0, late), (1, 2, Phase.IDLE, None)))
        await until(lambda: service.state.store.size == 2)
        folded = service.ingest.folding
        telemetry = folded[js_ready.runner_stream.name]
        assert telemetry.handled == 3  # its own, late's first gone over again: no other
        assert {v.ref.instanceId for v in service.state.runners.values()} == set(mine)
        held = answers.timeline(
            service.state, TimelineQuery(instanceId=late), local_node_id="x", now=time.time()
        )
        assert [e.at for e in held.timeline] == [at(2)]  # none stored before it was placed
        assert service.dead_letters.counts == {"telemetry_before_placement": 1}


async def test_a_partition_stops_following_an_instance_a_while_after_its_release(
    nc: Client, js_ready: Layout
) -> None:
    (name, _), _ = instances_by_partition(2, 2).values()
    moment = [1000.0]
    await publish(nc, js_ready, placed(name))
    await publish(nc, js_ready, entries(rank(0, name), (0, 1, Phase.CREATED, None)))
    async with aggregator(
        nc, js_ready, partition=Partition(0, 2), clock=lambda: moment[0]
    ) as running:
        telemetry = running.service.ingest.folding[js_ready.runner_stream.name]
        released = InstanceReleased(
            at=at(2), instanceId=name, cause=ReleaseCause.SPEC_DELETED, reason="spec deleted"
        )
        await nc.jetstream().publish(js_ready.subjects.placement(name), encode(released))
        await publish(nc, js_ready, entries(rank(0, name), (1, 3, Phase.IDLE, None)))
        await until(lambda: telemetry.handled == 2)  # its last words, after the release
        moment[0] += FOLLOW_RELEASED_S + 1
        await until(lambda: not running.service.ingest.followed)
        await publish(nc, js_ready, entries(rank(0, name), (2, 4, Phase.IDLE, None)))
        await asyncio.sleep(0.5)
        assert telemetry.handled == 2  # no longer delivered
