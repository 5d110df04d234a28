"""The same fault is one signature however often, wherever and on whichever rank it
happens; another fault is another."""

from __future__ import annotations

from rankscope.shared.signatures import seen_before, signature
from rankscope.shared.wire import Finding, FindingKind, Phase, RankEvidence, RankRole

WAITING_STACK = """Current thread 0x00007f4869ff7b80 (most recent call first):
  File "{root}/services/agent/runner/process.py", line {line} in _agree
  File "{root}/services/agent/runner/process.py", line 213 in serve
  File "{root}/services/agent/runner/process.py", line 269 in runner_main
  File "/usr/lib/python3.11/multiprocessing/process.py", line 108 in run

Thread 0x00007f485a2fb6c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 327 in wait
"""


def _frozen(
    culprit: int = 1,
    phase: Phase = Phase.IDLE,
    kind: FindingKind = FindingKind.STALLED_RANK,
    since: str = "2026-11-25T10:00:00.000000Z",
    root: str = "/srv/a",
    line: int = 178,
) -> Finding:
    waiting = 1 - culprit
    return Finding(
        incidentId=f"id-{since}",
        instanceId="demo-0",
        kind=kind,
        culpritRanks=[culprit],
        culpritRunnerIds=[f"demo-0-a0-r{culprit}"],
        waitingRanks=[waiting],
        summary="frozen",
        since=since,
        evidence=[
            RankEvidence(runnerId=f"demo-0-a0-r{culprit}", nodeId="node-b",
                         deviceRank=culprit, phase=phase, role=RankRole.CULPRIT),
            RankEvidence(runnerId=f"demo-0-a0-r{waiting}", nodeId="node-a",
                         deviceRank=waiting, phase=Phase.TASK_AGREEMENT,
                         waitingIn="task_agreement", role=RankRole.WAITING,
                         stack=WAITING_STACK.format(root=root, line=line)),
        ],
    )  # fmt: skip


def test_the_same_fault_is_one_signature_on_any_rank_any_day_any_checkout() -> None:
    first = signature(_frozen())
    assert signature(_frozen(since="2026-11-26T08:00:00.000000Z")) == first
    assert signature(_frozen(culprit=0)) == first  # the other rank frozen in the same place
    assert signature(_frozen(root="/home/ops/rankscope", line=181)) == first  # paths, lines


def test_another_fault_is_another_signature() -> None:
    first = signature(_frozen())
    assert signature(_frozen(kind=FindingKind.DEAD_RANK)) != first  # killed, not frozen
    assert signature(_frozen(phase=Phase.DECODE_STREAM)) != first  # frozen elsewhere


def test_each_incident_says_how_often_its_fault_was_seen_before() -> None:
    days = [f"2026-11-2{d}T10:00:00.000000Z" for d in (3, 4, 5)]
    other = _frozen(kind=FindingKind.DEAD_RANK, since="2026-11-24T12:00:00.000000Z")
    told = seen_before(
        [_frozen(since=days[0]), _frozen(since=days[1]), other, _frozen(since=days[2])]
    )
    assert [t.seenBefore.count if t.seenBefore else 0 for t in told] == [0, 1, 0, 2]
    third = told[3].seenBefore
    assert third is not None
    assert (third.first, third.last) == (days[0], days[1])
    assert third.incidentIds == [f"id-{days[0]}", f"id-{days[1]}"]
    assert len({t.signature for t in told}) == 2
