"""Aggregators split into partitions behind one gateway: the merged answers equal one
aggregator's, a missing partition makes a partial answer that names it, and a restarted
one catches up."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import httpx
import pytest

from rankscope.shared.headers import MISSING_PARTITIONS_HEADER as MISSING_HEADER
from rankscope.shared.subjects import AGGREGATOR_SERVICE
from rankscope.shared.views import HEALTH, NoQuery
from rankscope.shared.wire import AggregatorHealth, Phase, decode
from tests.aggregator.builders import entries, instances_by_partition, placed, rank
from tests.aggregator.running import publish
from tests.gateway.conftest import Stack
from tests.gateway.test_cli import cli

pytestmark = pytest.mark.nats

PARTITIONS = 2
ENTRIES = 5
"""Entries per rank; rank r of the k-th instance writes them at seconds k*10 + r + i/10."""


async def _placed(stack: Stack, names: list[str]) -> None:
    for k, name in enumerate(names):
        await publish(stack.nc, stack.layout, placed(name))
        for r in range(2):
            items = [(i + 1, k * 10 + r + i / 10, Phase.DECODE_STREAM, i) for i in range(ENTRIES)]
            await publish(stack.nc, stack.layout, entries(rank(r, name), *items))


async def _timeline(stack: Stack, **params: Any) -> httpx.Response:
    return await stack.http.get("/v1/cluster/timeline", params=params)


async def _until_entries(stack: Stack, count: int) -> httpx.Response:
    for _ in range(200):
        answer = await _timeline(stack, limit=1000)
        if len(answer.json().get("timeline", [])) == count:
            return answer
        await asyncio.sleep(0.05)
    raise AssertionError(f"the timeline never held {count} entries")


async def test_partitions_answer_as_one_and_name_the_missing_one(stack_for: Any) -> None:
    stack: Stack = await stack_for(aggregator_partitions=PARTITIONS)
    owned = instances_by_partition(PARTITIONS, 2)
    names = sorted(n for ns in owned.values() for n in ns)
    await _placed(stack, names)
    whole = await _until_entries(stack, len(names) * 2 * ENTRIES)
    assert MISSING_HEADER not in whole.headers
    assert "missingPartitions" not in whole.json()
    times = [e["at"] for e in whole.json()["timeline"]]
    assert times == sorted(times)  # merged in time order across partitions
    assert {r["instanceId"] for r in whole.json()["runners"]} == set(names)

    newest = (await _timeline(stack, limit=3)).json()["timeline"]
    assert [e["at"] for e in newest] == times[-3:]  # the limit applies after the merge

    placement = (await stack.http.get("/v1/placement/runners")).json()
    assert len(placement) == len(names) * 2
    for owner, ids in owned.items():
        one = await stack.http.get(f"/v1/placement/runners/{ids[0]}-r1")
        assert one.status_code == 200, (owner, one.text)
        assert one.json()["deviceRank"] == 1
    unknown = await stack.http.get("/v1/placement/runners/nobody")
    assert unknown.status_code == 404
    assert "nobody" in unknown.json()["detail"]
    history = (await stack.http.get("/v1/cluster/history")).json()
    assert sum(h["heldEntries"] for h in history) == len(names) * 2 * ENTRIES
    bad = await stack.http.get("/v1/cluster/timeline", params={"since": "yesterday"})
    assert bad.status_code == 422  # refused once, not once per partition

    await stack.stop_aggregator(1)
    partial = await _timeline(stack, limit=1000)
    assert partial.status_code == 200
    assert partial.headers[MISSING_HEADER] == "1"
    (missing,) = partial.json()["missingPartitions"]
    assert missing["partition"] == 1
    assert "partition 1/2 is not running" in missing["reason"]
    assert {r["instanceId"] for r in partial.json()["runners"]} == set(owned[0])
    diagnosis = await stack.http.get("/v1/cluster/diagnosis")
    assert diagnosis.headers[MISSING_HEADER] == "1"
    assert diagnosis.json()["missingPartitions"][0]["partition"] == 1
    listed = await stack.http.get("/v1/placement/runners")
    assert listed.headers[MISSING_HEADER] == "1"  # a list has no field: the header says it
    assert len(listed.json()) == len(owned[0]) * 2
    alone = await _timeline(stack, instanceId=owned[0][0])  # asks its partition alone
    assert alone.status_code == 200
    assert MISSING_HEADER not in alone.headers
    assert {r["instanceId"] for r in alone.json()["runners"]} == {owned[0][0]}
    away = await _timeline(stack, instanceId=owned[1][0])
    assert away.status_code == 503
    assert "partition 1/2" in away.json()["detail"]
    lost = await stack.http.get(f"/v1/placement/runners/{owned[1][0]}-r0")
    assert lost.status_code == 503
    assert "partition 1" in lost.json()["detail"]
    chat = {"model": "elsewhere", "messages": [{"role": "user", "content": "hi"}]}
    unsure = await stack.http.post("/v1/chat/completions", json=chat)
    assert unsure.status_code == 503  # not a 404: the model may be on the missing partition
    assert "partition 1 did not" in unsure.json()["detail"]
    ready = await stack.http.get("/readyz")
    assert ready.status_code == 503
    assert "partition 1" in ready.json()["reason"]
    url = str(stack.http.base_url)
    code, out, err = await cli("timeline", "--url", url)
    assert code == 0
    assert "partial answer: aggregator partition 1 did not answer" in err
    assert out.count("Z  rank ") == len(owned[0]) * 2 * ENTRIES  # the partition left
    metrics = (await stack.http.get("/metrics")).text
    assert "rankscope_aggregator_partitions_missing 1" in metrics

    stack.start_aggregator(1)  # replays its instances from the streams
    await _until_entries(stack, len(names) * 2 * ENTRIES)
    gone = await stack.http.post("/v1/chat/completions", json=chat)
    assert gone.status_code == 404
    caught_up = await _until_entries(stack, len(names) * 2 * ENTRIES)
    assert MISSING_HEADER not in caught_up.headers
    assert caught_up.json()["timeline"] == whole.json()["timeline"]


async def test_every_partition_out_is_a_503_that_names_each(stack_for: Any) -> None:
    stack: Stack = await stack_for(aggregator_partitions=PARTITIONS)
    for partition in range(PARTITIONS):
        await stack.stop_aggregator(partition)
    answer = await _timeline(stack)
    assert answer.status_code == 503
    detail = answer.json()["detail"]
    assert "partition 0/2 is not running" in detail
    assert "partition 1/2 is not running" in detail


async def test_two_aggregators_of_one_partition_share_its_queries(stack_for: Any) -> None:
    stack: Stack = await stack_for(aggregator_partitions=PARTITIONS)
    names = [n for ns in instances_by_partition(PARTITIONS, 2).values() for n in ns]
    await _placed(stack, names)
    await _until_entries(stack, len(names) * 2 * ENTRIES)
    spare = replace_partition(stack, 0)
    for _ in range(200):
        if await _serving(stack, "0/2") == 2:
            break
        await asyncio.sleep(0.05)
    await stack.stop_aggregator(0)  # its twin keeps answering: no gap
    for _ in range(10):
        answer = await _timeline(stack, limit=1000)
        assert MISSING_HEADER not in answer.headers
        assert len(answer.json()["timeline"]) == len(names) * 2 * ENTRIES
    stack.aggregators[0] = spare


async def _serving(stack: Stack, partition: str) -> int:
    """How many aggregators of `partition` answer queries (NATS micro discovery)."""
    inbox = stack.nc.new_inbox()
    replies = await stack.nc.subscribe(inbox)
    await stack.nc.publish(f"$SRV.PING.{AGGREGATOR_SERVICE}", b"", reply=inbox)
    found = 0
    with contextlib.suppress(TimeoutError):
        while True:
            reply = await replies.next_msg(timeout=0.3)
            found += json.loads(reply.data)["metadata"]["partition"] == partition
    await replies.unsubscribe()
    return found


def replace_partition(stack: Stack, partition: int) -> tuple[asyncio.Event, asyncio.Task[None]]:
    """Start a second aggregator of `partition`; the first stays where it was."""
    first = stack.aggregators[partition]
    stack.start_aggregator(partition)
    second = stack.aggregators[partition]
    stack.aggregators[partition] = first
    return second


def test_health_of_partitions_sums_counters_and_joins_maps() -> None:
    from rankscope.services.gateway.scatter import merge

    first = {"ready": True, "entries": 3, "badMessages": {"a": 1}, "partition": "0/2"}
    second = {
        "ready": False,
        "entries": 4,
        "badMessages": {"b": 2},
        "partition": "1/2",
        "storageProblem": "JetStream not storing since 12:00:00Z",
    }
    merged = decode(
        merge(HEALTH, NoQuery(), [json.dumps(first).encode(), json.dumps(second).encode()]),
        AggregatorHealth,
    )
    assert (merged.ready, merged.entries, merged.partition) == (False, 7, "0/2,1/2")
    assert merged.badMessages == {"a": 1, "b": 2}
    assert merged.storageProblem == "JetStream not storing since 12:00:00Z"
