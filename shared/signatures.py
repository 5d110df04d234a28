"""What makes two incidents the same fault: their kind, where the culprits stood and the
innermost frames the ranks' stacks were in, with paths and line numbers left out, so the
same hang seen again (after a restart, on another day) is known for what it is."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

import msgspec

from rankscope.shared.wire import Finding, SeenBefore

__all__ = ["FRAMES", "FaultHistory", "seen_before", "signature"]

FRAMES = 3
"""Innermost frames of each rank's main thread that a signature holds."""

_FRAME = re.compile(r'File "(?:.*[/\\])?([^/\\"]+)", line \d+ in (\S+)')


def _frames(stack: str | None) -> list[str]:
    """The innermost frames of a faulthandler dump's first thread: `file.py:function`."""
    if not stack:
        return []
    first = stack.strip().split("\n\n")[0]
    return [f"{m.group(1)}:{m.group(2)}" for m in _FRAME.finditer(first)][:FRAMES]


def signature(finding: Finding) -> str:
    """The fault `finding` is, as a short hash: the same for the same fault wherever and
    whenever it happens, whichever rank it hits."""
    culprits = set(finding.culpritRunnerIds)
    parts = [finding.kind.value]
    for role in (True, False):
        for rank in finding.evidence:
            if (rank.runnerId in culprits) != role:
                continue
            where = rank.waitingIn or (rank.phase.value if rank.phase else "")
            parts.append(
                f"{'culprit' if role else 'waiting'} {where} {' > '.join(_frames(rank.stack))}"
            )
    ordered = [parts[0], *sorted(set(parts[1:]))]
    return hashlib.sha256("\n".join(ordered).encode()).hexdigest()[:12]


def seen_before(incidents: Sequence[Finding]) -> list[Finding]:
    """`incidents` (oldest first), each with its signature and how often the same fault
    was seen before it, first and last when."""
    earlier: dict[str, list[Finding]] = {}
    told = []
    for finding in incidents:
        mark = signature(finding)
        before = earlier.setdefault(mark, [])
        seen = (
            SeenBefore(
                count=len(before),
                first=before[0].since,
                last=before[-1].since,
                incidentIds=[f.incidentId for f in before[-20:] if f.incidentId],
            )
            if before
            else None
        )
        told.append(msgspec.structs.replace(finding, signature=mark, seenBefore=seen))
        before.append(finding)
    return told


class FaultHistory:
    """The last word of every incident seen so far, by the fault it was: what an alert
    says of how often its fault was seen before."""

    def __init__(self) -> None:
        self._last: dict[str, Finding] = {}

    def add(self, finding: Finding) -> None:
        """Note a word of an incident (the last one counts)."""
        if finding.incidentId:
            self._last[finding.incidentId] = finding

    def before(self, finding: Finding) -> SeenBefore | None:
        """The incidents of `finding`'s fault that opened before it, if any."""
        mark = signature(finding)
        earlier = sorted(
            (
                f
                for f in self._last.values()
                if f.since < finding.since
                and f.incidentId != finding.incidentId
                and signature(f) == mark
            ),
            key=lambda f: f.since,
        )
        if not earlier:
            return None
        return SeenBefore(
            count=len(earlier),
            first=earlier[0].since,
            last=earlier[-1].since,
            incidentIds=[f.incidentId for f in earlier[-20:] if f.incidentId],
        )
