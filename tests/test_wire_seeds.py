"""The seeds' JSON examples decode into the wire structs and re-encode with the same keys,
nesting and JSON types; bad payloads are refused with the JSON path of the problem."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from rankscope.shared.wire import (
    ClientInfo,
    ClusterTimeline,
    PlacementRunnerDiagnostics,
    RankTable,
    RankTableStatus,
    RankTableStream,
    Runner,
    Status,
    WireError,
    decode,
    encode,
)
from tests.conftest import FIXTURES

SEEDS = FIXTURES / "seeds"


def _shape(value: Any) -> Any:
    """Keys and JSON types of a document, with int and float both counted as number."""
    if isinstance(value, dict):
        return {key: _shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_shape(item) for item in value]
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return type(value).__name__


@pytest.mark.parametrize(
    ("seed", "shape"),
    [
        ("000_placement_runner_diagnostics.json", PlacementRunnerDiagnostics),
        ("001_cluster_timeline.json", ClusterTimeline),
        ("002_runner.json", Runner),
        ("003_ranktable_v1_0.json", RankTable),
        ("003_ranktable_v1_2.json", RankTable),
    ],
)
def test_seed_example_round_trips_with_same_keys_and_types(seed: str, shape: type) -> None:
    raw = (SEEDS / seed).read_bytes()
    again = json.loads(encode(decode(raw, shape)))
    assert _shape(again) == _shape(json.loads(raw))


@pytest.mark.parametrize("seed", ["003_ranktable_v1_0.json", "003_ranktable_v1_2.json"])
def test_rank_table_re_encodes_exactly_so_1_0_tables_gain_no_1_2_keys(seed: str) -> None:
    raw = (SEEDS / seed).read_bytes()
    assert json.loads(encode(decode(raw, RankTable))) == json.loads(raw)


def test_timeline_entry_keeps_every_attr_value_kind() -> None:
    doc = json.loads((SEEDS / "001_cluster_timeline.json").read_bytes())
    doc["timeline"][0]["attrs"] = {
        "rank": 1,
        "ratio": 0.5,
        "ok": True,
        "site": "recv",
        "peers": ["a", "b"],
    }
    timeline = decode(json.dumps(doc), ClusterTimeline)
    assert timeline.timeline[0].attrs == doc["timeline"][0]["attrs"]
    assert json.loads(encode(timeline))["timeline"][0]["attrs"] == doc["timeline"][0]["attrs"]


def test_placement_nullable_fields_may_be_absent_and_are_encoded_as_null() -> None:
    minimal = {
        "runnerId": "r",
        "nodeId": "n",
        "deviceRank": 0,
        "worldSize": 2,
        "startLayer": 0,
        "endLayer": 4,
        "nLayers": 8,
        "isLocal": True,
        "isMaster": False,
    }
    again = json.loads(encode(decode(json.dumps(minimal), PlacementRunnerDiagnostics)))
    assert again["friendlyName"] is None
    assert again["statusKind"] is None
    assert again["tasks"] == []


def test_rank_table_stream_carries_the_table_as_json_text() -> None:
    table = decode((SEEDS / "003_ranktable_v1_0.json").read_bytes(), RankTable)
    stream = RankTableStream(jobId="job-1", rankTable=encode(table).decode())
    wire = json.loads(encode(stream))
    assert set(wire) == {"jobId", "rankTable"}
    assert decode(wire["rankTable"], RankTable) == table
    assert table.status is RankTableStatus.COMPLETED


def test_client_info_and_status_use_clusterd_field_names() -> None:
    assert json.loads(encode(ClientInfo(jobId="j", role="controller"))) == {
        "jobId": "j",
        "role": "controller",
    }
    assert json.loads(encode(Status(code=0, info="ok"))) == {"code": 0, "info": "ok"}


def _seed(seed: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((SEEDS / seed).read_bytes())
    return doc


def test_priority_above_nine_is_refused_naming_the_field() -> None:
    doc = _seed("002_runner.json") | {"priority": 12}
    with pytest.raises(WireError, match=r"<= 9 - at `\$\.priority`"):
        decode(json.dumps(doc), Runner)


def test_negative_priority_is_refused() -> None:
    with pytest.raises(WireError, match=r"`\$\.priority`"):
        decode(json.dumps(_seed("002_runner.json") | {"priority": -1}), Runner)


def test_wrong_type_is_refused_naming_the_nested_path() -> None:
    doc = _seed("001_cluster_timeline.json")
    doc["runners"][0]["deviceRank"] = "zero"
    with pytest.raises(
        WireError, match=r"Expected `int`, got `str` - at `\$\.runners\[0\]\.deviceRank`"
    ):
        decode(json.dumps(doc), ClusterTimeline)


def test_missing_required_key_is_refused_naming_it() -> None:
    doc = _seed("000_placement_runner_diagnostics.json")
    del doc["tasks"][0]["taskId"]
    with pytest.raises(WireError, match=r"missing required field `taskId` - at `\$\.tasks\[0\]`"):
        decode(json.dumps(doc), PlacementRunnerDiagnostics)


def test_unknown_phase_is_refused_naming_the_path() -> None:
    doc = _seed("001_cluster_timeline.json")
    doc["timeline"][0]["phase"] = "napping"
    with pytest.raises(
        WireError, match=r"Invalid enum value 'napping' - at `\$\.timeline\[0\]\.phase`"
    ):
        decode(json.dumps(doc), ClusterTimeline)


def test_rank_table_values_are_strings_as_clusterd_sends_them() -> None:
    doc = _seed("003_ranktable_v1_0.json")
    doc["server_group_list"][0]["server_count"] = 1
    with pytest.raises(WireError, match=r"`\$\.server_group_list\[0\]\.server_count`"):
        decode(json.dumps(doc), RankTable)


def test_unknown_rank_table_status_is_refused() -> None:
    with pytest.raises(WireError, match=r"`\$\.status`"):
        decode(json.dumps(_seed("003_ranktable_v1_0.json") | {"status": "done"}), RankTable)


def test_malformed_json_is_a_wire_error() -> None:
    with pytest.raises(WireError, match=r"malformed|truncated|JSON"):
        decode(b'{"runnerId": ', PlacementRunnerDiagnostics)


def test_unknown_fields_on_the_bus_are_tolerated_for_forward_compatibility() -> None:
    doc = _seed("000_placement_runner_diagnostics.json") | {"addedLater": 1}
    assert decode(json.dumps(doc), PlacementRunnerDiagnostics).runnerId == "string"


def test_schema_documents_the_seed_field_names() -> None:
    (_schema,), components = msgspec.json.schema_components([ClusterTimeline])
    synopsis = components["RunnerSynopsis"]["properties"]
    assert {"secondsInPhase", "lastMlxMemory", "processAlive"} <= set(synopsis)
    assert len(components["Phase"]["enum"]) == 22
