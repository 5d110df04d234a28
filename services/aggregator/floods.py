"""A node that sends more than the aggregator keeps, named as a finding of the
installation (`telemetry_flood`) for as long as it gives up history to the byte bound,
and `FLOOD_HOLD_S` after. Pure: what the store gave up, the views and the time in,
incidents out."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from rankscope.services.aggregator.diagnosis import Incident
from rankscope.services.aggregator.views import ClusterState
from rankscope.shared.wire import Finding, FindingKind, RankEvidence, RankRole, incident_id

__all__ = ["FLOOD_HOLD_S", "Floods"]

FLOOD_HOLD_S = 60.0
"""How long a node stays named after it last gave up history."""
NAMED_RANKS = 16
"""The most of a flooding node's runners a finding lists."""


@dataclass(slots=True)
class Floods:
    """The nodes that gave up history lately, each with how much and when it last did.

    Args:
        partition: this aggregator's partition, in each incident's key: each partition
            names the floods it sees, and takes up only its own after a restart.
    """

    partition: str
    seen: dict[str, tuple[int, float]] = field(default_factory=dict)

    def key(self, node_id: str) -> str:
        """The incident key of `node_id`'s flood (never an instance id: those are tokens)."""
        return f"flood\0{self.partition}\0{node_id}"

    def owns(self, finding: Finding) -> str | None:
        """The key of `finding` if it is an open flood incident of this partition's."""
        if finding.kind is not FindingKind.TELEMETRY_FLOOD or not finding.evidence:
            return None
        key = self.key(finding.evidence[0].nodeId)
        return key if incident_id(key, finding.since) == finding.incidentId else None

    def judge(
        self,
        trimmed: Mapping[str, int],
        state: ClusterState,
        incidents: Mapping[str, Incident],
        *,
        now: float,
        wall: str,
    ) -> dict[str, Incident]:
        """The flood incidents open at `now` (monotonic; `wall` the time of day), given
        the bytes each node has given up so far (`trimmed`) and the incidents open before."""
        for node, amount in trimmed.items():
            if amount > self.seen.get(node, (0, 0.0))[0]:
                self.seen[node] = (amount, now)
        found: dict[str, Incident] = {}
        for node, (amount, last) in self.seen.items():
            key = self.key(node)
            previous = incidents.get(key)
            if now - last > FLOOD_HOLD_S:
                continue
            since = previous.finding.since if previous is not None else wall
            ranks = sorted(
                (v.ref for v in state.runners.values() if v.ref.nodeId == node),
                key=lambda ref: (ref.instanceId, ref.deviceRank),
            )[:NAMED_RANKS]
            finding = Finding(
                instanceId="",
                kind=FindingKind.TELEMETRY_FLOOD,
                culpritRanks=[r.deviceRank for r in ranks],
                culpritRunnerIds=[r.runnerId for r in ranks],
                summary=f"node {node} sends more than the aggregator keeps "
                f"(RANKSCOPE_RETENTION_BYTES): {amount / (1 << 20):.1f} MiB of its own "
                "oldest entries given up so far, so every other node's stay",
                since=since,
                evidence=[
                    RankEvidence(
                        runnerId=r.runnerId,
                        nodeId=node,
                        deviceRank=r.deviceRank,
                        role=RankRole.CULPRIT,
                    )
                    for r in ranks
                ]
                or [RankEvidence(runnerId="", nodeId=node, deviceRank=0, role=RankRole.CULPRIT)],
                incidentId=incident_id(key, since),
            )
            opened = previous.opened if previous is not None else now
            found[key] = Incident(finding=finding, opened=opened)
        return found
