"""Name the rank an instance is waiting on, and keep naming it for the whole incident.

Pure: the cluster state, the clock and the incidents open so far in; incidents out.
Progress is judged by when the aggregator last received an entry from a rank (its own
clock), not by the runners' clocks.

A rank that gave up on a peer (its collective timed out, or the ring lost the peer) is a
victim: it is listed as waiting, with how it ended, and never named, whether it is down,
restarting or waiting again. An incident keeps its culprits and its `since` until each
culprit makes progress (an entry after the incident opened) or, for a stall, is
confirmed dead; whatever the victims do meanwhile does not change it.

With nothing stuck, a rank working slower than it usually does while its peers do not is
named `slow_rank` (`pace`), until it is back in line.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

from rankscope.services.aggregator.rules import Incident, Judge, Thresholds, Verdict, evidence
from rankscope.services.aggregator.views import ClusterState
from rankscope.shared.wire import Finding, FindingKind, InstanceCreated, incident_id

__all__ = ["DEFAULTS", "Incident", "Thresholds", "diagnose"]

DEFAULTS = Thresholds()
"""The thresholds a diagnosis applies unless told others."""


def diagnose(
    state: ClusterState,
    *,
    now: float,
    wall: str,
    incidents: Mapping[str, Incident],
    placed_at: Callable[[str], float],
    thresholds: Thresholds = DEFAULTS,
    outage: tuple[FindingKind, str, str] | None = None,
    instances: Iterable[InstanceCreated] | None = None,
    unsettled: Mapping[str, float] | None = None,
) -> dict[str, Incident]:
    """The open incident of every live instance that has one, by instance id; during an
    outage of NATS or JetStream, that outage (under the empty id) and the incidents open
    before it.

    Args:
        state: the cluster state.
        now: the aggregator's monotonic clock now.
        wall: the wall clock now (the `since` of an incident opening now).
        incidents: what the last call returned.
        placed_at: monotonic time the aggregator learnt of an instance's placement.
        thresholds: how long is too long.
        outage: (kind, since, why) when the aggregator cannot reach NATS or JetStream
            does not store: what it holds is stale, so no incident opens or clears
            meanwhile.
        instances: the instances judged, as they are now (all by default; one released
            since is not).
        unsettled: when each instance last had an incident other than `slow_rank` open
            (monotonic). Its pace is not judged for a slow window after: a rank stopped or
            restarted, and its peers with it, step unevenly for a while once going again
            (catching up, chats sent again), which is no rank being slow.
    """
    if outage is not None:
        kind, since, why = outage
        previous = incidents.get("")
        bus = Finding(
            instanceId="",
            kind=kind,
            culpritRanks=[],
            culpritRunnerIds=[],
            summary=why,
            since=since,
            incidentId=incident_id(kind.value, since),
        )
        return {**incidents, "": Incident(bus, previous.opened if previous else now)}
    found: dict[str, Incident] = {}
    for picked in state.instances.values() if instances is None else instances:
        instance = state.instances.get(picked.instanceId)
        if instance is None:
            continue  # released since it was picked
        views = [state.runners[a.runnerId] for a in instance.assignments]
        judge = Judge(state, views, now, wall, placed_at(instance.instanceId), thresholds)
        previous = incidents.get(instance.instanceId)
        if instance.recorded is not None and instance.recorded.dump is not None:
            continue  # a post-mortem: its dumps were judged as they were loaded
        if instance.recorded is not None:
            verdict = judge.recorded()
        else:
            verdict = judge.verdict()
            if (
                previous is not None
                and previous.finding.kind is not FindingKind.SLOW_RANK
                and judge.at_fault(previous)
                and not _widens(previous, verdict)
                and not _sharpens(previous, verdict)
            ):
                verdict = judge.kept(previous)
        if (
            verdict is None
            and now - (unsettled or {}).get(instance.instanceId, -math.inf)
            >= thresholds.slow.window
        ):
            verdict = judge.slow(previous)
        if verdict is None:
            continue
        found[instance.instanceId] = _incident(judge, instance, verdict, previous, wall)
    return found


def _widens(previous: Incident, verdict: Verdict | None) -> bool:
    """Whether `verdict` is `previous` with more ranks at fault (a second rank found dead)."""
    if verdict is None or verdict.kind is not previous.finding.kind:
        return False
    return set(previous.finding.culpritRunnerIds) < {v.ref.runnerId for v in verdict.culprits}


def _sharpens(previous: Incident, verdict: Verdict | None) -> bool:
    """Whether `verdict` says of `previous`'s culprits what is now known: held behind its
    peers at first, the rank has since been silent long enough to be called frozen."""
    return (
        verdict is not None
        and verdict.kind is FindingKind.STALLED_RANK
        and previous.finding.kind is FindingKind.RANK_DISAGREEMENT
        and {v.ref.runnerId for v in verdict.culprits} == set(previous.finding.culpritRunnerIds)
    )


def _incident(
    judge: Judge,
    instance: InstanceCreated,
    verdict: Verdict,
    previous: Incident | None,
    wall: str,
) -> Incident:
    culprits = [v.ref.runnerId for v in verdict.culprits]
    same = (  # the same incident, widened or sharpened: it keeps its since
        previous is not None
        and (previous.finding.kind is verdict.kind or _sharpens(previous, verdict))
        and set(previous.finding.culpritRunnerIds) <= set(culprits)
    )
    task_id = next((v.synopsis.task_id for v in verdict.culprits if v.synopsis.task_id), None)
    since = previous.finding.since if same and previous else wall
    finding = Finding(
        instanceId=instance.instanceId,
        kind=verdict.kind,
        culpritRanks=[v.ref.deviceRank for v in verdict.culprits],
        culpritRunnerIds=culprits,
        waitingRanks=[v.ref.deviceRank for v in verdict.waiting],
        summary=judge.summary(verdict, task_id),
        since=since,
        evidence=[evidence(judge, v, v.ref.runnerId in culprits) for v in judge.views],
        incidentId=incident_id(instance.instanceId, since),
    )
    if same and previous is not None:
        found = previous.found if verdict.held else judge.now
        return Incident(finding=finding, opened=previous.opened, found=found)
    return Incident(finding=finding, opened=judge.now)
