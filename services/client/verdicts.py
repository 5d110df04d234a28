"""The diagnosis as the CLI tells it: each rank's verdict beside placements and timelines,
and findings in the order a reader needs them, the culprit and its evidence first.

Times are UTC and say so (`19:03:20Z`); relative times are computed when printed.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

__all__ = ["clock", "finding_lines", "pace_lines", "verdicts", "where_it_waits"]

WAIT_FRAMES = 4
"""Innermost frames of a waiting thread's stack that say where it waits."""

_EVIDENCE = ("phase", "step", "waitingIn", "gaveUp", "exitReason", "process", "lastProgressAt")
"""What `diagnose --verbose` says of each rank, in this order."""
_SHADES = " ▁▂▃▄▅▆▇█"
"""A slice of a rank's pace, from its quickest (blank-ish) to twice that or more."""


def clock(at: str | None, now: datetime | None = None) -> str:
    """A wire timestamp as the time of day in UTC and how long ago: `19:03:20Z (38s ago)`;
    a moment of another day keeps its date."""
    if not at:
        return "-"
    moment = datetime.fromisoformat(at)
    now = now or datetime.now(UTC)
    ago = max(0, int((now - moment).total_seconds()))
    when = f"{at[11:19]}Z" if moment.date() == now.date() else f"{at[:10]} {at[11:19]}Z"
    if ago < 120:
        return f"{when} ({ago}s ago)"
    if ago < 7200:
        return f"{when} ({ago // 60}m ago)"
    return f"{when} ({ago // 3600}h ago)"


def verdicts(findings: Iterable[dict[str, Any]]) -> dict[str, str]:
    """What the open findings say of each rank they name, by runner id."""
    said: dict[str, str] = {}
    for finding in findings:
        if not finding.get("open", True):
            continue
        culprits = ", ".join(f"rank {r}" for r in finding["culpritRanks"])
        since = clock(finding["since"])
        for rank in finding.get("evidence", []):
            if rank["runnerId"] in finding["culpritRunnerIds"]:
                said[rank["runnerId"]] = f"<- {finding['kind']} since {since}"
            else:
                where = rank.get("waitingIn") or rank.get("phase") or "?"
                said[rank["runnerId"]] = f"waiting on {culprits} in {where}"
    return said


def where_it_waits(stack: str, frames: int = WAIT_FRAMES) -> list[str]:
    """The first thread of a faulthandler dump (the main one, innermost frame first) cut
    to its innermost `frames` frames."""
    first = stack.strip().split("\n\n")[0].splitlines()
    kept = first[: frames + 1]
    if len(first) > len(kept):
        kept.append(f"  ... {len(first) - len(kept)} more frames (--stacks shows them all)")
    return kept


def finding_lines(finding: dict[str, Any], verbose: bool, stacks: bool = False) -> list[str]:
    """A finding as lines: what and who first; with `verbose`, each rank's evidence, the
    culprits before the ranks waiting on them, each stack cut to where it waits (whole
    with `stacks`)."""
    where = finding["instanceId"] or "(installation)"
    state = "" if finding.get("open", True) else f", cleared {clock(finding.get('clearedAt'))}"
    named = f"; incident {finding['incidentId']}" if finding.get("incidentId") else ""
    lines = [
        f"{finding['kind']} {where}: {finding['summary']} "
        f"(since {clock(finding['since'])}{state}{named})"
    ]
    if unwatched := finding.get("unwatchedSince"):
        until = clock(finding["unwatchedUntil"]) if finding.get("unwatchedUntil") else "now"
        lines.append(
            f"  rankscope did not watch it from {clock(unwatched)} to {until}: what happened "
            "meanwhile was not seen"
        )
    if seen := finding.get("seenBefore"):
        times = "once" if seen["count"] == 1 else f"{seen['count']} times"
        lines.append(
            f"  the same fault ({finding.get('signature')}) seen {times} before: first "
            f"{clock(seen['first'])}, last {clock(seen['last'])}"
        )
    if not verbose:
        return lines
    culprits = set(finding["culpritRunnerIds"])
    ranks = sorted(finding.get("evidence", []), key=lambda r: r["runnerId"] not in culprits)
    for rank in ranks:
        said = [f"{key} {rank[key]}" for key in _EVIDENCE if rank.get(key) is not None]
        if pace := rank.get("pace"):
            said.append(_pace_words(pace))
        role = "CULPRIT" if rank["runnerId"] in culprits else "waiting"
        lines.append(
            f"  {role} rank {rank['deviceRank']} ({rank['nodeId']}): "
            + (", ".join(said) or "no data")
        )
        stack = rank.get("stack") or ""
        shown = stack.strip().splitlines() if stacks else where_it_waits(stack) if stack else []
        lines += [f"      {line.strip()}" for line in shown]
    return lines


def _pace_words(pace: dict[str, Any]) -> str:
    usual = pace.get("usualWorkMs")
    against = f" (usually {usual:.3g}, {pace['ratio']:.2g}x)" if usual and pace.get("ratio") else ""
    said = f"work {pace['workMs']:.3g} ms a step{against}, wait {pace['waitMs']:.3g} ms"
    if (waited_on := pace.get("waitedOn")) is not None and pace.get("layers"):
        said += (
            f"; {pace['layers']} layers, {pace.get('workVsPeers') or 0:.2g}x its peers' work per "
            f"layer; the pipeline loses {waited_on:.0%} of its work a step to it, the most per "
            f"layer in {pace.get('lastArrival') or 0:.0%} of the span"
        )
    elif waited_on is not None:
        said += (
            f"; the job loses {waited_on:.0%} of its time waiting for it, last to arrive on "
            f"{pace.get('lastArrival') or 0:.0%} of its steps"
        )
    return said


def pace_lines(series: Iterable[dict[str, Any]]) -> list[str]:
    """Each rank's work per step over time as a strip: each character a slice of time,
    shaded by how many times its own quickest slice it took (█: twice or more), then its
    latest work and wait a step. Ranks differ by design, so each is held to itself; a
    slow rank's strip darkens while its peers' stays light."""
    lines = []
    for rank in series:
        points = rank.get("points") or []
        if not points:
            continue
        works = sorted(p["workMs"] for p in points)
        quickest = works[len(works) // 10] or works[-1] or 1.0
        strip = "".join(
            _SHADES[min(round(max(p["workMs"] / quickest - 1, 0) * 8), 8)] for p in points
        )
        last = points[-1]
        lines.append(
            f"  {rank['instanceId']} rank {rank['deviceRank']} ({rank['nodeId']})  "
            f"|{strip}|  {last['workMs']:.3g} ms work, {last['waitMs']:.3g} ms wait a step"
        )
    return lines
