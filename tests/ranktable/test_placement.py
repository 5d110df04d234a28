"""Placement is pure: specs and nodes in, releases and placements out."""

from __future__ import annotations

import pytest

from rankscope.services.ranktable.placement import NewInstance, Plan, largest_remainder, plan
from rankscope.shared.model_shape import ModelShape
from rankscope.shared.specs import PlacementSpec
from rankscope.shared.timestamps import now
from rankscope.shared.wire import InstanceCreated, ReleaseCause
from tests.ranktable.builders import GiB, node, nodes, spec

PORT_BASE = 52000


def _created(new: NewInstance) -> InstanceCreated:
    return InstanceCreated(
        at=now(),
        instanceId=new.instance_id,
        runnerSpecId=new.spec.runner_id,
        modelId=new.spec.model_id,
        attempt=new.attempt,
        specDigest=new.spec.digest,
        assignments=list(new.assignments),
    )


def _run(specs: list[PlacementSpec], live: dict, placed: dict | None = None) -> Plan:  # type: ignore[type-arg]
    placed = placed or {}
    attempts = {i: p.attempt + 1 for i, p in placed.items()}
    return plan(specs, live, placed, attempts, port_base=PORT_BASE)


def _apply(result: Plan, placed: dict[str, InstanceCreated]) -> dict[str, InstanceCreated]:
    after = {k: v for k, v in placed.items() if k not in {r.instance_id for r in result.releases}}
    after.update({new.instance_id: _created(new) for new in result.placements})
    return after


@pytest.mark.parametrize(
    ("total", "weights", "expected"),
    [
        (32, [3.0, 1.0], [24, 8]),
        (10, [1.0, 1.0, 1.0], [4, 3, 3]),
        (5, [100.0, 0.0], [4, 1]),
        (7, [0.0, 0.0], [4, 3]),
        (3, [1.0, 1.0, 1.0], [1, 1, 1]),
    ],
)
def test_largest_remainder(total: int, weights: list[float], expected: list[int]) -> None:
    assert largest_remainder(total, weights) == expected


@pytest.mark.parametrize("weights", [[1.0], [5.0, 1.0, 1.0], [0.3, 0.3, 0.4], [1e9, 1.0, 7.0, 3.0]])
@pytest.mark.parametrize("total", [4, 7, 32, 81])
def test_largest_remainder_is_exact_and_proportional(total: int, weights: list[float]) -> None:
    shares = largest_remainder(total, weights)
    assert sum(shares) == total
    assert min(shares) >= 1
    for share, weight in zip(shares, weights, strict=True):
        quota = total * weight / sum(weights)
        assert share <= max(quota + 1, 1)


def test_two_nodes_split_layers_in_proportion_to_memory() -> None:
    result = _run([spec()], nodes(node("node-a", 24), node("node-b", 8)))
    (instance,) = result.placements
    ranks = [(a.nodeId, a.deviceRank, a.startLayer, a.endLayer) for a in instance.assignments]
    assert ranks == [("node-a", 0, 0, 24), ("node-b", 1, 24, 32)]
    assert {a.worldSize for a in instance.assignments} == {2}
    assert {a.nLayers for a in instance.assignments} == {32}
    assert result.refusals == {}


def test_shards_cover_every_layer_exactly_once() -> None:
    live = nodes(*(node(f"n{i}", 3 + i) for i in range(5)))
    (instance,) = _run([spec(ranks=5, model=spec().model)], live).placements
    covered = [layer for a in instance.assignments for layer in range(a.startLayer, a.endLayer)]
    assert covered == list(range(32))


def test_rank_addresses_and_ports() -> None:
    live = nodes(node("node-a", 24), node("node-b", 24))
    result = _run([spec("one"), spec("two")], live)
    ports = [(a.nodeId, a.port) for i in result.placements for a in i.assignments]
    assert len(set(ports)) == len(ports)
    assert min(port for _, port in ports) == PORT_BASE
    assert result.placements[0].assignments[0].host == live["node-a"].address


def test_unchanged_world_gives_the_same_placement() -> None:
    live = nodes(node("node-a", 24), node("node-b", 8), node("node-c", 12))
    first = _run([spec(), spec("other")], live)
    assert _run([spec("other"), spec()], live) == first


def test_placed_instances_stay_put_when_memory_moves() -> None:
    placed = _apply(_run([spec()], nodes(node("node-a", 24), node("node-b", 8))), {})
    later = _run([spec()], nodes(node("node-a", 4), node("node-b", 30)), placed)
    assert later == Plan()


def test_refusal_names_the_node_and_bytes_short() -> None:
    result = _run([spec(rank_bytes=6 * GiB)], nodes(node("node-a", 24), node("node-b", 5)))
    assert result.placements == ()
    assert result.refusals == {
        "llm": "replica 0: node node-b needs 6.0 GiB for layers [26, 32) of llama but has "
        "5.0 GiB available (1.0 GiB short)"
    }


def test_too_few_nodes_is_refused_with_counts() -> None:
    result = _run([spec(ranks=3)], nodes(node("node-a", 24), node("node-b", 24)))
    assert (
        "3 ranks at 1 per node need 3 nodes, but nodepool 'default' has 2 live"
        in (result.refusals["llm"])
    )


def test_a_typo_in_replicas_places_no_more_runners_on_a_node_than_it_may_run() -> None:
    tiny = spec(model=ModelShape(n_layers=32, model_bytes=1 << 20), replicas=500)
    live = nodes(node("node-a", 24), node("node-b", 24))
    result = plan([tiny], live, {}, {}, port_base=PORT_BASE, max_runners_per_node=4)
    assert len(result.placements) == 4  # 4 runners on each node, two ranks an instance
    per_node: dict[str, int] = {}
    for new in result.placements:
        for rank in new.assignments:
            per_node[rank.nodeId] = per_node.get(rank.nodeId, 0) + 1
    assert per_node == {"node-a": 4, "node-b": 4}
    assert result.refusals["llm"].startswith("replica 4: 2 ranks at 1 per node need 2 nodes")
    assert "node-a, node-b already run 4 runners, the most one node may" in result.refusals["llm"]


def test_each_runner_is_charged_a_process_not_only_its_share_of_the_weights() -> None:
    tiny = spec(model=ModelShape(n_layers=32, model_bytes=1 << 20), replicas=10)
    result = _run([tiny], nodes(node("node-a", 1), node("node-b", 1)))
    assert len(result.placements) == 3  # 1 GiB holds three runners of 256 MiB and their weights
    assert "GiB available" in result.refusals["llm"] or "MiB available" in result.refusals["llm"]


def test_unknown_nodepool_waits() -> None:
    result = _run([spec(nodepool="gpu-rack")], nodes(node("node-a", 24)))
    assert (
        result.refusals["llm"] == "replica 0: no live node in nodepool 'gpu-rack'; waiting for one"
    )


def test_labels_select_nodes() -> None:
    live = nodes(
        node("plain", 64),
        node("ultra-1", 24, labels=frozenset({"ultra"})),
        node("ultra-2", 24, labels=frozenset({"ultra", "m2"})),
    )
    (instance,) = _run([spec(labels=frozenset({"ultra"}))], live).placements
    assert {a.nodeId for a in instance.assignments} == {"ultra-1", "ultra-2"}


def test_several_ranks_per_node_when_the_spec_allows() -> None:
    (instance,) = _run(
        [spec(ranks=4, max_ranks_per_node=2)], nodes(node("a", 16), node("b", 16))
    ).placements
    assert [a.nodeId for a in instance.assignments] == ["a", "a", "b", "b"]
    assert len({(a.nodeId, a.port) for a in instance.assignments}) == 4


def test_higher_priority_places_first_when_capacity_is_short() -> None:
    live = nodes(node("node-a", 5), node("node-b", 5))
    result = _run([spec("low", priority=1), spec("high", priority=8)], live)
    assert [p.spec.runner_id for p in result.placements] == ["high"]
    assert "low" in result.refusals


def test_preempts_lower_priority_above_min_replicas() -> None:
    live = nodes(node("node-a", 8.5), node("node-b", 8.5))  # two ranks' weights and processes
    low = spec("low", priority=1, replicas=2, min_replicas=1, model=spec().model)
    placed = _apply(_run([low], live), {})
    assert set(placed) == {"low-0", "low-1"}
    result = _run([low, spec("high", priority=9)], live, placed)
    assert [(r.instance_id, r.cause) for r in result.releases] == [
        ("low-1", ReleaseCause.PREEMPTED)
    ]
    assert "preempted by Runner spec high (priority 9)" in result.releases[0].reason
    assert [p.instance_id for p in result.placements] == ["high-0"]


def test_min_replicas_are_never_preempted() -> None:
    live = nodes(node("node-a", 4), node("node-b", 4))
    low = spec("low", priority=1, replicas=1, min_replicas=1)
    placed = _apply(_run([low], live), {})
    result = _run([low, spec("high", priority=9)], live, placed)
    assert result.releases == ()
    assert "high" in result.refusals


def test_no_preemption_when_it_would_not_make_room() -> None:
    live = nodes(node("node-a", 4), node("node-b", 4))
    low = spec("low", priority=1, replicas=1)
    placed = _apply(_run([low], live), {})
    result = _run([low, spec("huge", priority=9, rank_bytes=40 * GiB)], live, placed)
    assert result.releases == ()
    assert "node-a needs 40.0 GiB" in result.refusals["huge"]


def test_lost_node_releases_and_re_places_with_a_new_attempt() -> None:
    placed = _apply(_run([spec()], nodes(node("a", 24), node("b", 8), node("c", 8))), {})
    assert {a.nodeId for a in placed["llm-0"].assignments} == {"a", "b"}
    result = _run([spec()], nodes(node("a", 24), node("c", 8)), placed)
    assert [(r.instance_id, r.cause) for r in result.releases] == [
        ("llm-0", ReleaseCause.NODE_LOST)
    ]
    assert "node b lost" in result.releases[0].reason
    (again,) = result.placements
    assert again.instance_id == "llm-0"
    assert again.attempt == 1
    assert {a.nodeId for a in again.assignments} == {"a", "c"}
    assert again.assignments[0].runnerId != placed["llm-0"].assignments[0].runnerId


def test_spec_deleted_scaled_down_or_reshaped_releases() -> None:
    live = nodes(node("a", 24), node("b", 24))
    placed = _apply(_run([spec(replicas=2)], live), {})
    assert _run([], live, placed).releases[0].cause is ReleaseCause.SPEC_DELETED
    scaled = _run([spec(replicas=1)], live, placed)
    assert [(r.instance_id, r.cause) for r in scaled.releases] == [
        ("llm-1", ReleaseCause.SCALED_DOWN)
    ]
    reshaped = _run([spec(replicas=2, model_id="other")], live, placed)
    assert {r.cause for r in reshaped.releases} == {ReleaseCause.SPEC_CHANGED}
    assert len(reshaped.placements) == 2
