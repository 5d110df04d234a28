"""The open incidents from one judgement to the next, on virtual time: an incident opens
once and asks for its evidence, is told again only when what it tells changes, keeps the
evidence its agents send, and clears stamped with the time given, never the clock's."""

from __future__ import annotations

import msgspec

from rankscope.services.aggregator.bounds import STACK_CHARS
from rankscope.services.aggregator.diagnosis import Incident
from rankscope.services.aggregator.incidents import Incidents
from rankscope.shared.wire import (
    Finding,
    FindingKind,
    ProcessState,
    RankEvidence,
    RankRole,
    RunnerEvidence,
)
from tests.aggregator.builders import at

SETTLING = 25.0


def _finding(
    kind: FindingKind = FindingKind.STALLED_RANK, since: float = 0, **changes: object
) -> Finding:
    ranks = [
        RankEvidence(runnerId=f"i-r{r}", nodeId=f"node-{r}", deviceRank=r,
                     role=RankRole.CULPRIT if r == 1 else RankRole.WAITING)
        for r in (0, 1)
    ]  # fmt: skip
    found = Finding(
        instanceId="i",
        kind=kind,
        culpritRanks=[1],
        culpritRunnerIds=["i-r1"],
        waitingRanks=[0],
        summary="rank 1 (node-1) made no progress",
        since=at(since),
        evidence=ranks,
        incidentId="i-1",
    )
    return msgspec.structs.replace(found, **changes)


def _held(finding: Finding, moment: float) -> dict[str, Incident]:
    return {"i": Incident(finding=finding, opened=moment)}


def _captured(runner: str, stack: str = "File train.py, line 9 in all_sum") -> RunnerEvidence:
    return RunnerEvidence(
        runnerId=runner, process=ProcessState.STOPPED, stack=stack, capturedAt=at(2)
    )


def test_an_incident_opens_once_asks_for_its_evidence_and_is_told_again_only_on_news() -> None:
    incidents = Incidents(settling=SETTLING)
    first = incidents.settle(_held(_finding(), 100.0), at=100.0, wall=at(0))
    assert [f.incidentId for f in first.changed] == ["i-1"]
    assert first.capture == first.changed
    aged = _finding(summary="rank 1 (node-1) made no progress for 12 s")  # wording only
    again = incidents.settle(_held(aged, 100.0), at=101.0, wall=at(1))
    assert (again.changed, again.cleared, again.capture) == ([], [], [])
    assert incidents.open["i"].finding.summary.endswith("for 12 s")  # held as judged


def test_evidence_captured_is_kept_cut_to_size_for_the_ranks_asked_alone() -> None:
    incidents = Incidents(settling=SETTLING)
    opened = incidents.settle(_held(_finding(), 100.0), at=100.0, wall=at(0)).capture[0]
    huge = "x" * (STACK_CHARS * 3)
    answered = [_captured("i-r1", huge), _captured("i-r9")]  # r9: not asked, not its own
    assert incidents.captured(opened, ["i-r1"], answered)
    told = incidents.settle(_held(_finding(), 100.0), at=101.0, wall=at(1))
    (finding,) = told.changed  # its evidence is news: told again
    culprit = next(e for e in finding.evidence if e.runnerId == "i-r1")
    assert culprit.process is ProcessState.STOPPED
    assert culprit.stack is not None
    assert len(culprit.stack) < len(huge)
    assert culprit.capturedAt == at(2)
    assert {e.runnerId for e in finding.evidence} == {"i-r0", "i-r1"}


def test_a_cleared_incident_is_stamped_with_the_time_given_and_its_evidence_dropped() -> None:
    incidents = Incidents(settling=SETTLING)
    opened = incidents.settle(_held(_finding(), 100.0), at=100.0, wall=at(0)).capture[0]
    cleared = incidents.settle({}, at=130.0, wall=at(30)).cleared
    assert [(f.open, f.clearedAt) for f in cleared] == [(False, at(30))]
    assert incidents.open == {}
    assert not incidents.captured(opened, ["i-r1"], [_captured("i-r1")])  # too late


def test_an_instance_stays_unsettled_for_the_settling_time_after_anything_but_slowness() -> None:
    incidents = Incidents(settling=SETTLING)
    incidents.settle(_held(_finding(), 100.0), at=100.0, wall=at(0))
    incidents.settle({}, at=101.0, wall=at(1))
    assert incidents.unsettled == {"i": 100.0}
    incidents.settle({}, at=100.0 + SETTLING, wall=at(SETTLING))
    assert incidents.unsettled == {}
    slow = _finding(FindingKind.SLOW_RANK, since=200)
    incidents.settle(_held(slow, 200.0), at=200.0, wall=at(100))
    assert incidents.unsettled == {}


def test_a_new_incident_of_the_same_instance_clears_the_old_one_and_opens_anew() -> None:
    incidents = Incidents(settling=SETTLING)
    incidents.settle(_held(_finding(), 100.0), at=100.0, wall=at(0))
    later = _finding(FindingKind.DEAD_RANK, since=40, incidentId="i-2")
    settled = incidents.settle(_held(later, 140.0), at=140.0, wall=at(40))
    assert [f.incidentId for f in settled.cleared] == ["i-1"]
    assert [f.incidentId for f in settled.changed] == ["i-2"]
    assert settled.capture == settled.changed


def test_a_flood_asks_for_no_evidence_and_an_incident_taken_up_is_watched_again() -> None:
    incidents = Incidents(settling=SETTLING)
    flood = _finding(FindingKind.TELEMETRY_FLOOD)
    assert incidents.settle(_held(flood, 1.0), at=1.0, wall=at(0)).capture == []
    left = _finding(unwatchedSince=at(5))
    fresh = Incidents(settling=SETTLING)
    fresh.take_up({"i": left}, at=50.0, wall=at(45))
    taken = fresh.open["i"]
    assert (taken.opened, taken.finding.unwatchedUntil) == (50.0, at(45))
    kept = fresh.settle(_held(_finding(), 51.0), at=51.0, wall=at(46)).changed
    assert kept == []  # the same incident: nothing new to tell
    assert fresh.open["i"].finding.unwatchedSince == at(5)  # the gap kept as judged anew
