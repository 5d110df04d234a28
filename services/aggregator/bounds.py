"""What the aggregator holds and answers of what nodes say, bounded whatever they say: a
rank's stack cut to a size a person reads, the diagnosis answer to a size every client
takes. Pure."""

from __future__ import annotations

import msgspec

from rankscope.shared.wire import Diagnosis, DiagnosisQuery, Finding, RankEvidence, encode

__all__ = ["DIAGNOSIS_BYTES", "STACK_CHARS", "cut_stack", "diagnosis_answer"]

STACK_CHARS = 64 << 10
"""The most of one rank's stacks kept: every thread of a real program fits many times."""
DIAGNOSIS_BYTES = 2 << 20
"""The largest diagnosis answer: past it, stacks and then whole findings are left out."""
_STACKS_LEFT_OUT = "(left out: the diagnosis was over its size; ask for this instance alone)"


def cut_stack(stack: str | None) -> str | None:
    """`stack` within `STACK_CHARS`, its cut said at the end."""
    if stack is None or len(stack) <= STACK_CHARS:
        return stack
    return f"{stack[:STACK_CHARS]}\n... (cut: {STACK_CHARS:,} of {len(stack):,} characters kept)"


def _wanted(finding: Finding, query: DiagnosisQuery) -> bool:
    return (query.instanceId is None or finding.instanceId == query.instanceId) and (
        query.kind is None or finding.kind == query.kind
    )


def _without_stacks(finding: Finding) -> Finding:
    def bare(rank: RankEvidence) -> RankEvidence:
        return rank if rank.stack is None else msgspec.structs.replace(rank, stack=_STACKS_LEFT_OUT)

    return msgspec.structs.replace(finding, evidence=[bare(r) for r in finding.evidence])


def diagnosis_answer(
    findings: list[Finding],
    query: DiagnosisQuery,
    generated_at: str,
    limit: int = DIAGNOSIS_BYTES,
) -> bytes:
    """The open `findings` that `query` asks for, as JSON of at most `limit` bytes: whole
    when they fit, else without stacks, else the first that fit and a count of the rest."""
    chosen = [f for f in findings if _wanted(f, query)]
    answer = encode(Diagnosis(generatedAt=generated_at, findings=chosen))
    if len(answer) <= limit:
        return answer
    bare = [_without_stacks(f) for f in chosen]
    answer = encode(Diagnosis(generatedAt=generated_at, findings=bare))
    if len(answer) <= limit:
        return answer
    room = limit - len(encode(Diagnosis(generatedAt=generated_at, omitted=len(bare))))
    kept: list[Finding] = []
    for finding in bare:
        room -= len(encode(finding)) + 1
        if room < 0:
            break
        kept.append(finding)
    return encode(Diagnosis(generatedAt=generated_at, findings=kept, omitted=len(bare) - len(kept)))
