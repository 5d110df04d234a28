"""Pure placement: Runner specs and live nodes in, instance placements out.

Higher priority places first. Instances already placed on live nodes stay where they are,
so an unchanged world gives the same placement. Layers split in proportion to each rank's
memory by the largest-remainder method; refusals name the node and the bytes short.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from rankscope.shared.specs import PlacementSpec
from rankscope.shared.wire import InstanceCreated, NodeInfo, ReleaseCause, RunnerAssignment

__all__ = [
    "NewInstance",
    "NodeView",
    "Plan",
    "Release",
    "format_bytes",
    "largest_remainder",
    "plan",
    "runner_id",
]


@dataclass(frozen=True, slots=True)
class NodeView:
    """A live node as placement sees it."""

    node_id: str
    address: str
    available_bytes: int
    nodepool: str
    labels: frozenset[str] = frozenset()

    @classmethod
    def of(cls, info: NodeInfo) -> NodeView:
        """The placement view of an inventory entry."""
        return cls(
            info.nodeId,
            info.address,
            info.memoryAvailableBytes,
            info.nodepool,
            frozenset(info.labels),
        )


@dataclass(frozen=True, slots=True)
class Release:
    """An instance to take down."""

    instance_id: str
    cause: ReleaseCause
    reason: str


@dataclass(frozen=True, slots=True)
class NewInstance:
    """An instance to place: its spec, attempt and ranks in rank order."""

    spec: PlacementSpec
    instance_id: str
    attempt: int
    assignments: tuple[RunnerAssignment, ...]


@dataclass(frozen=True, slots=True)
class Plan:
    """What to change: releases first, then new placements; refusals by spec id."""

    releases: tuple[Release, ...] = ()
    placements: tuple[NewInstance, ...] = ()
    refusals: Mapping[str, str] = field(default_factory=dict)


def format_bytes(count: int) -> str:
    """Bytes for people: `1.5 GiB`, `300.0 MiB`, `12 B`."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{count} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def runner_id(instance_id: str, attempt: int, rank: int) -> str:
    """The id of one rank's runner; new for every placement of the instance."""
    return f"{instance_id}-a{attempt}-r{rank}"


def largest_remainder(total: int, weights: Sequence[float]) -> list[int]:
    """Split `total` in proportion to `weights`, at least one each, exactly `total` in all.

    Quotas are floored and the units left over go to the largest remainders (ties to the
    earlier index); a share that came out 0 takes one from the largest share.
    """
    count = len(weights)
    if count == 0 or total < count:
        raise ValueError(f"cannot give {count} shares at least one of {total}")
    weight_sum = sum(max(w, 0.0) for w in weights)
    if weight_sum <= 0:
        weights, weight_sum = [1.0] * count, float(count)
    quotas = [total * max(w, 0.0) / weight_sum for w in weights]
    shares = [int(q) for q in quotas]
    by_remainder = sorted(range(count), key=lambda i: (-(quotas[i] - shares[i]), i))
    for i in by_remainder[: total - sum(shares)]:
        shares[i] += 1
    for i in range(count):
        if shares[i] == 0:
            donor = max(range(count), key=lambda j: (shares[j], -j))
            shares[donor] -= 1
            shares[i] = 1
    return shares


MAX_RUNNERS_PER_NODE = 16
"""Runners one node may run by default (`RANKSCOPE_MAX_RUNNERS_PER_NODE`): each is a
process holding a model runtime, whatever share of the layers it holds."""


class _Capacity:
    """Free bytes and used ring ports per node, as placements are made and undone."""

    def __init__(self, nodes: Mapping[str, NodeView], port_base: int, max_runners: int) -> None:
        self.nodes = nodes
        self.port_base = port_base
        self.max_runners = max_runners
        self.free = {node_id: node.available_bytes for node_id, node in nodes.items()}
        self.ports: dict[str, set[int]] = {node_id: set() for node_id in nodes}

    def runners(self, node_id: str) -> int:
        """Runners placed on the node so far (one ring port each)."""
        return len(self.ports[node_id])

    def take(self, instance: InstanceCreated | NewInstance, demand: Mapping[str, int]) -> None:
        for node_id, need in demand.items():
            self.free[node_id] -= need
        for rank in instance.assignments:
            self.ports[rank.nodeId].add(rank.port)

    def give(self, instance: InstanceCreated | NewInstance, demand: Mapping[str, int]) -> None:
        for node_id, need in demand.items():
            self.free[node_id] += need
        for rank in instance.assignments:
            self.ports[rank.nodeId].discard(rank.port)

    def port(self, node_id: str, taken: set[int]) -> int:
        port = self.port_base
        while port in self.ports[node_id] or port in taken:
            port += 1
        return port


def _demand(spec: PlacementSpec, assignments: Iterable[RunnerAssignment]) -> dict[str, int]:
    demand: dict[str, int] = {}
    for rank in assignments:
        need = spec.rank_demand(rank.endLayer - rank.startLayer)
        demand[rank.nodeId] = demand.get(rank.nodeId, 0) + need
    return demand


def _eligible(spec: PlacementSpec, nodes: Mapping[str, NodeView]) -> list[NodeView]:
    return [n for n in nodes.values() if n.nodepool == spec.nodepool and spec.labels <= n.labels]


def _place(
    spec: PlacementSpec, instance_id: str, attempt: int, capacity: _Capacity
) -> NewInstance | str:
    """Place one instance, or say why it does not fit."""
    eligible = _eligible(spec, capacity.nodes)
    wanted = f"nodepool {spec.nodepool!r}" + (
        f" with labels {', '.join(sorted(spec.labels))}" if spec.labels else ""
    )
    if not eligible:
        return f"no live node in {wanted}; waiting for one"
    nodes_needed = -(-spec.ranks // spec.max_ranks_per_node)
    full = [n for n in eligible if capacity.runners(n.node_id) >= capacity.max_runners]
    eligible = [n for n in eligible if n not in full]
    if len(eligible) < nodes_needed:
        return (
            f"{spec.ranks} ranks at {spec.max_ranks_per_node} per node need {nodes_needed} "
            f"nodes, but {wanted} has {len(eligible)} live"
            + (
                f" with room: {', '.join(n.node_id for n in full)} already run "
                f"{capacity.max_runners} runners, the most one node may "
                "(RANKSCOPE_MAX_RUNNERS_PER_NODE)"
                if full
                else ""
            )
        )
    order = sorted(eligible, key=lambda n: (-capacity.free[n.node_id], n.node_id))
    per_node = [0] * len(order)
    for slot in range(spec.ranks):
        per_node[slot % nodes_needed] += 1
    chosen = [(node, count) for node, count in zip(order, per_node, strict=False) if count]
    weights = [
        max(capacity.free[n.node_id], 0) / count for n, count in chosen for _ in range(count)
    ]
    layers = largest_remainder(spec.shape.n_layers, weights)
    assignments: list[RunnerAssignment] = []
    start = 0
    for node, count in chosen:
        first, taken = start, set[int]()
        for _ in range(count):
            rank = len(assignments)
            port = capacity.port(node.node_id, taken)
            taken.add(port)
            assignments.append(
                RunnerAssignment(
                    runnerId=runner_id(instance_id, attempt, rank),
                    nodeId=node.node_id,
                    deviceRank=rank,
                    worldSize=spec.ranks,
                    startLayer=start,
                    endLayer=start + layers[rank],
                    nLayers=spec.shape.n_layers,
                    host=node.address,
                    port=port,
                )
            )
            start += layers[rank]
        need = sum(spec.rank_demand(a.endLayer - a.startLayer) for a in assignments[-count:])
        free = capacity.free[node.node_id]
        if need > free:
            return (
                f"node {node.node_id} needs {format_bytes(need)} for layers [{first}, {start}) "
                f"of {spec.model_id} but has {format_bytes(max(free, 0))} available "
                f"({format_bytes(need - max(free, 0))} short)"
            )
    return NewInstance(spec, instance_id, attempt, tuple(assignments))


def _stale(
    instance: InstanceCreated,
    spec: PlacementSpec | None,
    nodes: Mapping[str, NodeView],
) -> Release | None:
    """Why a placed instance must go, if it must."""
    if spec is None:
        return Release(
            instance.instanceId,
            ReleaseCause.SPEC_DELETED,
            f"Runner spec {instance.runnerSpecId} was deleted",
        )
    if instance.specDigest != spec.digest:
        return Release(
            instance.instanceId,
            ReleaseCause.SPEC_CHANGED,
            f"Runner spec {spec.runner_id} changed how instances are shaped",
        )
    if instance.instanceId not in {spec.instance_id(r) for r in range(spec.replicas)}:
        return Release(
            instance.instanceId,
            ReleaseCause.SCALED_DOWN,
            f"Runner spec {spec.runner_id} wants {spec.replicas} replicas",
        )
    lost = sorted({a.nodeId for a in instance.assignments} - set(nodes))
    if lost:
        return Release(
            instance.instanceId,
            ReleaseCause.NODE_LOST,
            f"node {', '.join(lost)} lost (heartbeat stopped)",
        )
    return None


def plan(
    specs: Iterable[PlacementSpec],
    nodes: Mapping[str, NodeView],
    placed: Mapping[str, InstanceCreated],
    attempts: Mapping[str, int],
    *,
    port_base: int,
    max_runners_per_node: int = MAX_RUNNERS_PER_NODE,
) -> Plan:
    """Decide releases and new placements for the whole cluster.

    Args:
        specs: valid specs, in any order.
        nodes: live nodes by id.
        placed: live instances by id, as last placed.
        attempts: placements made so far per instance id (the next attempt is this count).
        port_base: first ring port to hand out on each node.
        max_runners_per_node: the most runners one node may run, every spec together.
    """
    by_id = {spec.runner_id: spec for spec in specs}
    capacity = _Capacity(nodes, port_base, max_runners_per_node)
    releases: list[Release] = []
    kept: dict[str, InstanceCreated] = {}
    for instance in placed.values():
        release = _stale(instance, by_id.get(instance.runnerSpecId), nodes)
        if release is not None:
            releases.append(release)
        else:
            kept[instance.instanceId] = instance
            spec = by_id[instance.runnerSpecId]
            capacity.take(instance, _demand(spec, instance.assignments))
    placements: list[NewInstance] = []
    refusals: dict[str, str] = {}
    ordered = sorted(by_id.values(), key=lambda s: (-s.priority, s.created_at, s.runner_id))
    for spec in ordered:
        for replica in range(spec.replicas):
            instance_id = spec.instance_id(replica)
            if instance_id in kept:
                continue
            outcome = _place_or_preempt(
                spec, instance_id, attempts.get(instance_id, 0), capacity, kept, by_id
            )
            if isinstance(outcome, str):
                refusals[spec.runner_id] = f"replica {replica}: {outcome}"
                break
            new, preempted = outcome
            for victim in preempted:
                del kept[victim.instanceId]
                releases.append(
                    Release(
                        victim.instanceId,
                        ReleaseCause.PREEMPTED,
                        f"preempted by Runner spec {spec.runner_id} (priority {spec.priority})",
                    )
                )
            capacity.take(new, _demand(spec, new.assignments))
            placements.append(new)
    return Plan(tuple(releases), tuple(placements), refusals)


def _place_or_preempt(
    spec: PlacementSpec,
    instance_id: str,
    attempt: int,
    capacity: _Capacity,
    kept: Mapping[str, InstanceCreated],
    specs: Mapping[str, PlacementSpec],
) -> tuple[NewInstance, list[InstanceCreated]] | str:
    """Place the instance, preempting lower-priority instances above their spec's
    `min_replicas` (lowest priority, newest replica first) only if that makes it fit."""
    first = _place(spec, instance_id, attempt, capacity)
    if not isinstance(first, str):
        return first, []
    counts: dict[str, int] = {}
    for instance in kept.values():
        counts[instance.runnerSpecId] = counts.get(instance.runnerSpecId, 0) + 1
    reachable = {node.node_id for node in _eligible(spec, capacity.nodes)}
    candidates = sorted(
        (
            i
            for i in kept.values()
            if specs[i.runnerSpecId].priority < spec.priority
            and reachable & {a.nodeId for a in i.assignments}
        ),
        key=lambda i: (specs[i.runnerSpecId].priority, -int(i.instanceId.rsplit("-", 1)[1])),
    )
    victims: list[InstanceCreated] = []
    for victim in candidates:
        victim_spec = specs[victim.runnerSpecId]
        if counts[victim.runnerSpecId] <= victim_spec.min_replicas:
            continue
        counts[victim.runnerSpecId] -= 1
        victims.append(victim)
        capacity.give(victim, _demand(victim_spec, victim.assignments))
        placed = _place(spec, instance_id, attempt, capacity)
        if not isinstance(placed, str):
            return placed, victims
    for victim in victims:
        capacity.take(victim, _demand(specs[victim.runnerSpecId], victim.assignments))
    return first
