"""A Flight Recorder verdict in words: the culprits first, with what they did; then the
groups that stopped, the disagreements, and the ranks that wait, alike ones on one line."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from rankscope.shared.wire.fr import FrOp, FrRank, FrVerdict

__all__ = ["operation", "ranks_said", "verdict_words"]

STACK_SHOWN = 6
"""Frames of a culprit's stack printed (the JSON has more)."""


def ranks_said(ranks: Iterable[int]) -> str:
    """`0-3, 8, 12-15`: ranks in runs."""
    runs: list[list[int]] = []
    for rank in sorted(set(ranks)):
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)


def _plural(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) != 1 else ''} {ranks_said(ranks)}"


def operation(op: FrOp) -> str:
    """`all_reduce #6 [4 Float] of default_pg (group 0)`."""
    group = f"{op.groupDesc} (group {op.group})" if op.groupDesc else f"group {op.group}"
    shape = " ".join(part for part in (op.sizes, op.dtypes) if part)
    return f"{op.op} #{op.seq}{f' [{shape}]' if shape else ''} of {group}"


def _since(op: FrOp) -> str:
    return f", issued {op.createdAt[:19]}Z" if op.createdAt else ""


def _culprit(rank: FrRank, verdict: FrVerdict) -> Iterator[str]:
    missing = [s for s in verdict.stuck if rank.rank in s.missing]
    disagrees = [m for m in verdict.mismatches if rank.rank in m.culprits]
    if rank.role == "culprit" and rank.dump is None:
        yield f"rank {rank.rank}: no dump was read for it"
    else:
        yield f"rank {rank.rank}:"
    for stuck in missing:
        yield (
            f"  missing from {operation(stuck.collective)}, which {_plural(stuck.entered)} entered"
        )
    for mismatch in disagrees:
        sides = "; ".join(f"{value} by {_plural(r)}" for value, r in mismatch.values.items())
        where = f"#{mismatch.seq} of group {mismatch.group}"
        yield f"  disagrees on the {mismatch.field} of {where}: {sides}"
    if rank.waitingIn is not None:
        on = f", waiting on {_plural(rank.waitingOn)}" if rank.waitingOn else ""
        yield f"  itself inside {operation(rank.waitingIn)}{_since(rank.waitingIn)}{on}"
    elif rank.dump is not None:
        last = f"; its last: {operation(rank.lastOp)}" if rank.lastOp else ""
        yield f"  inside no collective: stuck outside them (its own code, a lock, I/O){last}"
    for frame in rank.stack[:STACK_SHOWN]:
        yield f"    {frame}"


def _waiting(ranks: list[FrRank]) -> Iterator[str]:
    """Ranks waiting alike (the same operation, on the same ranks), one line each."""
    alike: dict[tuple[str, str, int, tuple[int, ...]], tuple[FrOp, list[int]]] = {}
    for rank in ranks:
        if rank.waitingIn is not None:
            op = rank.waitingIn
            key = (op.group, op.op, op.seq, tuple(rank.waitingOn))
            alike.setdefault(key, (op, []))[1].append(rank.rank)
    for (_, _, _, on), (op, held) in sorted(alike.items(), key=lambda kv: kv[1][1][0]):
        waits = f", waiting on {_plural(list(on))}" if on else ""
        yield f"  {_plural(held)}: in {operation(op)}{_since(op)}{waits}"


def verdict_words(verdict: FrVerdict) -> str:
    """The verdict as an operator reads it."""
    dumped = [r.rank for r in verdict.ranks if r.dump is not None]
    lib = f", {verdict.commLib}" if verdict.commLib else ""
    lines = [f"Flight Recorder dumps of {_plural(dumped)} (version {verdict.version or '?'}{lib})"]
    lines.append(verdict.summary)
    culprits = [r for r in verdict.ranks if r.rank in verdict.culprits]
    if culprits:
        lines.append("")
        lines.append("culprits")
        for rank in culprits:
            lines.extend(f"  {line}" for line in _culprit(rank, verdict))
    if verdict.stuck:
        lines.append("")
        lines.append("process groups stopped (the first collective not every member entered)")
        for stuck in verdict.stuck:
            lines.append(
                f"  {operation(stuck.collective)}: entered by {ranks_said(stuck.entered)}; "
                f"missing {ranks_said(stuck.missing)}"
            )
    victims = [r for r in verdict.ranks if r.role == "waiting"]
    if victims:
        lines.append("")
        lines.append("waiting")
        lines.extend(_waiting(victims))
    if verdict.withoutDump:
        lines.append("")
        lines.append(f"no dump read for {_plural(verdict.withoutDump)}")
    for unread in verdict.unread:
        lines.append(f"not read: {unread}")
    return "\n".join(lines)
