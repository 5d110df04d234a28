"""The partition of an instance is the one NATS subject mapping's `partition()` names."""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats
import pytest
from nats.aio.msg import Msg

from rankscope.shared.nats_server import CONFIG, EmbeddedNats
from rankscope.shared.partitions import Partition, partition_of
from rankscope.shared.settings import SettingsError, load
from rankscope.shared.subjects import Subjects, token

IDS = [f"llm-{n}" for n in range(300)] + ["a.b c", "ümlaut*>", "x" * 400, "-", "=41"]


@pytest.mark.nats
@pytest.mark.parametrize("count", [2, 4, 7])
async def test_partition_matches_the_nats_server_mapping(tmp_path: Path, count: int) -> None:
    mapping = f'mappings = {{ "probe.*": "part.{{{{partition({count},1)}}}}.{{{{wildcard(1)}}}}" }}'
    with EmbeddedNats(store_dir=tmp_path, config=f"{CONFIG.read_text()}\n{mapping}\n") as server:
        nc = await nats.connect(server.url)
        routed: dict[str, int] = {}

        async def note(msg: Msg) -> None:
            _, part, routed_token = msg.subject.split(".", 2)
            routed[routed_token] = int(part)

        await nc.subscribe("part.>", cb=note)
        for raw in IDS:
            await nc.publish(f"probe.{token(raw)}", b"")
        await nc.flush()
        for _ in range(100):
            if len(routed) == len(IDS):
                break
            await asyncio.sleep(0.02)
        await nc.close()
    assert routed == {token(raw): partition_of(token(raw), count) for raw in IDS}
    assert len(set(routed.values())) == count  # every partition gets some


def test_each_instance_belongs_to_exactly_one_partition() -> None:
    parts = [Partition(i, 4) for i in range(4)]
    subjects = Subjects()
    for raw in IDS:
        owners = [p for p in parts if p.owns(raw)]
        assert len(owners) == 1
        (owner,) = owners
        for subject in (
            subjects.runner("node.1", raw, 3, "phase"),
            subjects.placement(raw),
            subjects.tasks(raw),
            subjects.task_status(raw, "node-2"),
            subjects.recorded(raw),
        ):
            assert [p for p in parts if p.owns_subject(subject, subjects)] == [owner], subject
    assert Partition().owns("anything")


def test_a_subject_of_no_instance_belongs_to_partition_zero() -> None:
    subjects = Subjects("acme.rs")
    assert subjects.instance_token("acme.rs.deadletter") is None
    assert subjects.instance_token("rankscope.placement.x") is None  # another prefix
    assert Partition(0, 3).owns_subject("acme.rs.deadletter", subjects)
    assert not Partition(1, 3).owns_subject("acme.rs.deadletter", subjects)


def test_query_subjects_name_the_partition_only_when_partitioned() -> None:
    subjects = Subjects()
    assert subjects.query("timeline") == "rankscope.query.timeline"
    assert subjects.query("timeline", 2, 4) == "rankscope.query.timeline.2-of-4"
    assert Partition(2, 4).name == "2-of-4"


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"RANKSCOPE_AGGREGATOR_PARTITIONS": "0"}, "AGGREGATOR_PARTITIONS: expected a positive"),
        ({"RANKSCOPE_AGGREGATOR_PARTITIONS": "257"}, "at most 256 partitions"),
        ({"RANKSCOPE_AGGREGATOR_PARTITION": "-1"}, "AGGREGATOR_PARTITION: expected 0 or more"),
        ({"RANKSCOPE_AGGREGATOR_PARTITION": "1"}, "expected 0 to 0 with 1 partitions, got 1"),
        (
            {"RANKSCOPE_AGGREGATOR_PARTITIONS": "4", "RANKSCOPE_AGGREGATOR_PARTITION": "four"},
            "expected a whole number",
        ),
    ],
)
def test_partition_settings_refuse_what_cannot_be(environ: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        load(environ=environ)


def test_partition_settings() -> None:
    settings = load(
        environ={"RANKSCOPE_AGGREGATOR_PARTITIONS": "4", "RANKSCOPE_AGGREGATOR_PARTITION": "3"}
    )
    assert settings.partition == Partition(3, 4)
    assert str(settings.partition) == "3/4"
