"""The open incidents of an aggregator's instances from one judgement to the next: what
opened, changed or cleared, whose ranks to capture evidence of, and the evidence kept with
each. Pure: the judgement, the time and the agents' answers come in, findings to publish
and captures to ask for go out; `findings.py` does the asking and the publishing."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import msgspec

from rankscope.services.aggregator.bounds import cut_stack
from rankscope.services.aggregator.diagnosis import Incident
from rankscope.shared.wire import Finding, FindingKind, RunnerEvidence

__all__ = ["Incidents", "Settled"]

EvidenceKey = tuple[str, str]
"""An incident's (instance, since)."""


@dataclass(frozen=True, slots=True)
class Settled:
    """What one judgement changed, as effects."""

    changed: list[Finding]
    """Findings opened, or changed in what they tell an operator: to publish."""
    cleared: list[Finding]
    """Findings that closed, `clearedAt` stamped: to publish."""
    capture: list[Finding]
    """Findings just opened whose ranks' stacks and memory to ask their agents for."""


class Incidents:
    """The open incident of each instance (`""`: an outage; a flood's key: a node sending
    more than is kept), the evidence captured of each, and when each instance last had an
    incident other than `slow_rank` open.

    Args:
        settling: seconds an instance's pace is left unjudged after another incident.
    """

    def __init__(self, settling: float) -> None:
        self._settling = settling
        self.open: dict[str, Incident] = {}
        self.unsettled: dict[str, float] = {}
        """When each instance last had an incident other than `slow_rank` open."""
        self._evidence: dict[EvidenceKey, dict[str, RunnerEvidence]] = {}

    def culprits(self) -> set[str]:
        """The runners the open incidents blame."""
        return {r for i in self.open.values() for r in i.finding.culpritRunnerIds}

    def take_up(self, found: Mapping[str, Finding], *, at: float, wall: str) -> None:
        """Hold the incidents another aggregator left open, as it published them last; one
        it said it stopped watching is watched again from `wall`."""
        for key, finding in found.items():
            if finding.unwatchedSince and not finding.unwatchedUntil:
                finding = msgspec.structs.replace(finding, unwatchedUntil=wall)
            self.open[key] = Incident(finding=finding, opened=at)

    def settle(self, found: Mapping[str, Incident], *, at: float, wall: str) -> Settled:
        """Hold what a judgement at `at` (`wall`: the same moment on the wall clock) found;
        what changed, what cleared and what to capture evidence of."""
        before = self.open
        opened = [
            i.finding
            for key, i in found.items()
            if key not in before or before[key].finding.since != i.finding.since
        ]
        for finding in opened:
            self._evidence[_key(finding)] = {}
        kept = {
            key: _unwatched(before.get(key), self._with_evidence(i)) for key, i in found.items()
        }
        changed = [
            i.finding
            for key, i in kept.items()
            if key not in before or _told(before[key].finding) != _told(i.finding)
        ]
        cleared = [
            msgspec.structs.replace(i.finding, open=False, clearedAt=wall)
            for key, i in before.items()
            if key not in kept or kept[key].finding.since != i.finding.since
        ]
        self.open = kept
        self.unsettled = {i: t for i, t in self.unsettled.items() if at - t < self._settling}
        for key, incident in kept.items():
            if incident.finding.kind is not FindingKind.SLOW_RANK:
                self.unsettled[key] = at
        live = {_key(i.finding) for i in kept.values()}
        for gone in set(self._evidence) - live:
            del self._evidence[gone]
        capture = [
            f for f in opened if f.evidence and f.kind is not FindingKind.TELEMETRY_FLOOD
        ]  # a flood's ranks have nothing to show of it
        return Settled(changed=changed, cleared=cleared, capture=capture)

    def captured(
        self, finding: Finding, asked: Iterable[str], answered: Iterable[RunnerEvidence]
    ) -> bool:
        """An agent's evidence of `finding`'s ranks `asked`, kept (stacks cut to size) for
        those asked alone, while the incident is open; whether it was."""
        held = self._evidence.get(_key(finding))
        if held is None:
            return False  # the incident is over already
        wanted = set(asked)
        for runner in answered:
            if runner.runnerId in wanted:  # one speaks only for the runners asked of it
                held[runner.runnerId] = msgspec.structs.replace(
                    runner, stack=cut_stack(runner.stack)
                )
        return True

    def _with_evidence(self, incident: Incident) -> Incident:
        held = self._evidence.get(_key(incident.finding))
        if not held:
            return incident
        ranks = [
            msgspec.structs.replace(
                rank,
                process=captured.process,
                stack=captured.stack,
                mlxMemory=captured.mlxMemory,
                capturedAt=captured.capturedAt,
            )
            if (captured := held.get(rank.runnerId)) is not None
            else rank
            for rank in incident.finding.evidence
        ]
        finding = msgspec.structs.replace(incident.finding, evidence=ranks)
        return dataclasses.replace(incident, finding=finding)


def _key(finding: Finding) -> EvidenceKey:
    return finding.instanceId, finding.since


def _unwatched(before: Incident | None, incident: Incident) -> Incident:
    """`incident` judged anew, keeping the time rankscope did not watch it (if it is the
    same incident)."""
    kept = before.finding if before is not None else None
    if kept is None or not kept.unwatchedSince or kept.since != incident.finding.since:
        return incident
    finding = msgspec.structs.replace(
        incident.finding, unwatchedSince=kept.unwatchedSince, unwatchedUntil=kept.unwatchedUntil
    )
    return dataclasses.replace(incident, finding=finding)


def _told(finding: Finding) -> tuple[object, ...]:
    """What an operator is told by a finding, but for its wording (which ages each second)."""
    return (
        finding.since,
        finding.kind,
        finding.culpritRunnerIds,
        finding.waitingRanks,
        [(e.gaveUp, e.exitReason, e.processAlive, e.capturedAt) for e in finding.evidence],
    )
