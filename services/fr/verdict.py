"""Who a PyTorch job waits on, judged from its ranks' Flight Recorder dumps.

Every member of a process group issues its collectives in one order, numbered alike
(`collective_seq_id`). For each group, the first collective that some members issued and
others did not names the missing ones, and the members that issued it wait on them. A rank
can be missing from one group because it waits in another: the culprits are the ranks the
waiting ends at, those that wait on nobody (or, in a cycle, every rank of it). Members that
issued the same number with a different operation, shape or type disagree: the side fewer
took is named. Send and receive are matched by peer: a rank waits on a peer that has
nothing outstanding towards it.

A record counts as completed when torch says so (`state`, a completion time) or its group's
counter on that rank (`pg_status.last_completed_collective`) has passed it; only a group
with no send or receive on that rank has a counter of collectives alone.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from rankscope.services.fr.dumps import Dump, DumpError, Entry
from rankscope.shared.wire.fr import (
    FrGroupStuck,
    FrMismatch,
    FrOp,
    FrRank,
    FrRole,
    FrVerdict,
)

__all__ = ["judge", "op_of", "outstanding"]

STACK_FRAMES = 12
"""Frames of a rank's stack kept in the verdict."""
_SAME_SHAPES = frozenset(
    {
        "all_reduce",
        "allreduce",
        "allreduce_coalesced",
        "all_reduce_coalesced",
        "broadcast",
        "reduce",
        "all_gather",
        "_all_gather_base",
        "all_gather_into_tensor",
        "reduce_scatter",
        "_reduce_scatter_base",
        "reduce_scatter_tensor",
    }
)
"""Collectives every member gives inputs of one shape (not all_to_all, gather, scatter)."""
_PEER = re.compile(r"(send|recv)\s+(\d+)\s*(?:->|<-)\s*(\d+)")


def _time(ns: int | None) -> str | None:
    if not ns:
        return None
    return datetime.fromtimestamp(ns / 1e9, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _shape(sizes: list[object]) -> str:
    return ", ".join("x".join(str(d) for d in s) if isinstance(s, list) else str(s) for s in sizes)


def op_of(entry: Entry, desc: str) -> FrOp:
    return FrOp(
        group=entry.group,
        groupDesc=desc or entry.process_group[1],
        op=entry.op,
        seq=entry.p2p_seq_id if entry.is_p2p else entry.collective_seq_id,
        p2p=entry.is_p2p,
        sizes=_shape(entry.input_sizes),
        dtypes=", ".join(entry.input_dtypes),
        createdAt=_time(entry.time_created_ns),
        state=entry.state,
    )


@dataclass
class _Rank:
    """One rank's records, with what is completed told apart."""

    dump: Dump
    done: dict[str, int] = field(default_factory=dict)
    """Per group name: its last completed collective, where the counter is one of
    collectives alone."""
    issued: dict[str, int] = field(default_factory=lambda: defaultdict(lambda: -1))
    """Per group name: the highest collective number it issued."""
    active: list[Entry] = field(default_factory=list)

    @classmethod
    def of(cls, dump: Dump) -> _Rank:
        rank = cls(dump)
        names: dict[str, str] = {}
        with_p2p: set[str] = set()
        for entry in dump.entries:
            names[str(entry.pg_id)] = entry.group
            if entry.is_p2p:
                with_p2p.add(entry.group)
            else:
                rank.issued[entry.group] = max(rank.issued[entry.group], entry.collective_seq_id)
        for local, status in dump.pg_status.items():
            name = names.get(local)
            if name is not None and name not in with_p2p:
                rank.done[name] = status.last_completed_collective
                rank.issued[name] = max(rank.issued[name], status.last_enqueued_collective)
        ordered = sorted(dump.entries, key=lambda e: (e.time_created_ns or 0, e.record_id))
        rank.active = [e for e in ordered if not rank.completed(e)]
        return rank

    def completed(self, entry: Entry) -> bool:
        if entry.state == "completed" or entry.retired or entry.time_discovered_completed_ns:
            return True
        return not entry.is_p2p and entry.collective_seq_id <= self.done.get(entry.group, -1)


class _Judge:
    def __init__(self, dumps: Sequence[Dump]) -> None:
        self.ranks = {d.rank: _Rank.of(d) for d in dumps}
        self.groups: dict[str, tuple[str, list[int]]] = {}
        unnamed: set[int] = set()
        for dump in dumps:
            for key, group in dump.pg_config.items():
                name = group.name or key
                if not name:  # gloo's rows in torch 2.14: joined by their records below
                    unnamed.update(group.members())
                elif group.members() and name not in self.groups:
                    self.groups[name] = (group.desc, group.members())
        recorded: dict[str, tuple[str, set[int]]] = {}
        for dump in dumps:
            for entry in dump.entries:
                desc, ranks = recorded.setdefault(entry.group, (entry.process_group[1], set()))
                ranks.add(dump.rank)
        for name, (desc, ranks) in recorded.items():
            if name not in self.groups:  # the world is every rank; another group, who used it
                world = desc == "default_pg" or name == "0"
                members = {*self.ranks, *unnamed} if world else ranks
                self.groups[name] = (desc, sorted(members))
        self.waits: dict[int, set[int]] = defaultdict(set)

    def desc(self, group: str) -> str:
        return self.groups.get(group, ("", []))[0]

    def stuck(self) -> list[FrGroupStuck]:
        """Each group's first collective some members issued and others did not; every
        member that issued it waits on those that did not."""
        found = []
        for name, (desc, members) in self.groups.items():
            if len(members) < 2:
                continue
            numbers = sorted(
                {
                    e.collective_seq_id
                    for m in members
                    if m in self.ranks
                    for e in self.ranks[m].active
                    if e.group == name and not e.is_p2p
                }
            )
            for number in numbers:
                entered = [
                    m for m in members if m in self.ranks and self.ranks[m].issued[name] >= number
                ]
                missing = [m for m in members if m not in entered]
                if not missing:
                    continue
                first = next(
                    (
                        e
                        for e in self.ranks[entered[0]].dump.entries
                        if e.group == name and not e.is_p2p and e.collective_seq_id == number
                    ),
                    None,
                )
                for rank in entered:
                    self.waits[rank].update(missing)
                collective = op_of(first, desc) if first else FrOp(group=name, op="?", seq=number)
                found.append(
                    FrGroupStuck(
                        group=name,
                        groupDesc=desc,
                        ranks=members,
                        collective=collective,
                        entered=entered,
                        missing=missing,
                    )
                )
                break
        return found

    def peer_waits(self) -> None:
        """A rank whose oldest outstanding record is a send or receive waits on its peer,
        unless the peer has a send or receive towards it outstanding too."""
        for rank, held in self.ranks.items():
            if not held.active or not held.active[0].is_p2p:
                continue
            peer = self.peer(held.active[0])
            if peer is None or peer == rank:
                continue
            other = self.ranks.get(peer)
            if other is None or not any(e.is_p2p and self.peer(e) == rank for e in other.active):
                self.waits[rank].add(peer)

    def peer(self, entry: Entry) -> int | None:
        """The global rank at the other end of a send or receive."""
        found = _PEER.search(entry.op)
        members = self.groups.get(entry.group, ("", []))[1]
        if not found or not members:
            return None
        index = int(found.group(3))
        return members[index] if index < len(members) else None

    def culprits(self) -> list[int]:
        """The ranks every wait ends at: waited on, and waiting on none that does not
        (through some chain) wait on them in turn."""
        reach: dict[int, set[int]] = {}

        def reachable(start: int) -> set[int]:
            if start not in reach:
                seen, todo = {start}, [start]
                while todo:
                    for nxt in self.waits.get(todo.pop(), ()):
                        if nxt not in seen:
                            seen.add(nxt)
                            todo.append(nxt)
                reach[start] = seen
            return reach[start]

        waited = set().union(*self.waits.values()) if self.waits else set()
        return sorted(v for v in waited if all(v in reachable(u) for u in reachable(v)))


def _mismatches(judge: _Judge) -> list[FrMismatch]:
    """Per group and field, the first collective number its members recorded differently."""
    found = []
    for name, (desc, members) in judge.groups.items():
        by_number: dict[int, dict[int, Entry]] = defaultdict(dict)
        for member in members:
            for entry in judge.ranks[member].dump.entries if member in judge.ranks else ():
                if entry.group == name and not entry.is_p2p:
                    by_number[entry.collective_seq_id].setdefault(member, entry)
        said: set[str] = set()
        for number in sorted(by_number):
            recorded = by_number[number]
            for what, value in (
                ("operation", lambda e: e.op),
                ("sizes", lambda e: _shape(e.input_sizes)),
                ("dtypes", lambda e: ", ".join(e.input_dtypes)),
            ):
                if what == "sizes" and not all(e.op in _SAME_SHAPES for e in recorded.values()):
                    continue
                sides: dict[str, list[int]] = defaultdict(list)
                for member, entry in recorded.items():
                    sides[value(entry)].append(member)
                if len(sides) < 2 or what in said or "operation" in said:
                    continue
                said.add(what)
                fewest = min(len(r) for r in sides.values())
                culprits = sorted(r for side in sides.values() if len(side) == fewest for r in side)
                found.append(
                    FrMismatch(
                        group=name,
                        groupDesc=desc,
                        seq=number,
                        field=what,  # type: ignore[arg-type]
                        values=dict(sides),
                        culprits=culprits,
                    )
                )
    return found


def _stack(entry: Entry | None) -> list[str]:
    if entry is None:
        return []
    return [f"{f.name} ({f.filename}:{f.line})" for f in entry.frames[:STACK_FRAMES]]


def _ranks(judge: _Judge, culprits: set[int], without: list[int]) -> list[FrRank]:
    shown = []
    for rank in sorted({*judge.ranks, *without}):
        held = judge.ranks.get(rank)
        if held is None:
            shown.append(FrRank(rank=rank, role="culprit" if rank in culprits else "no dump"))
            continue
        waiting = held.active[0] if held.active else None
        last = max(held.dump.entries, key=lambda e: e.record_id, default=None)
        role: FrRole = "culprit" if rank in culprits else "waiting" if waiting else "done"
        shown.append(
            FrRank(
                rank=rank,
                role=role,
                waitingIn=op_of(waiting, judge.desc(waiting.group)) if waiting else None,
                waitingOn=sorted(judge.waits.get(rank, ())),
                lastOp=op_of(last, judge.desc(last.group)) if last else None,
                stack=_stack(waiting or last),
                dump=held.dump.source,
            )
        )
    return shown


def _summary(
    culprits: list[int],
    stuck: list[FrGroupStuck],
    mismatches: list[FrMismatch],
    ranks: list[FrRank],
) -> str:
    """One sentence: who, and the plainest evidence (the stopped collective most ranks wait
    in, else the one most entered)."""
    waiting = sum(r.role == "waiting" for r in ranks)
    waits = f"{waiting} rank{'s' if waiting != 1 else ''} wait"
    inside: dict[tuple[str, int], int] = defaultdict(int)
    for rank in ranks:
        if rank.waitingIn is not None and not rank.waitingIn.p2p:
            inside[(rank.waitingIn.group, rank.waitingIn.seq)] += 1
    if not culprits:
        if waiting:
            return (
                f"{waits} inside collectives every member entered: no rank is missing (the "
                "collectives themselves did not finish: the network, a device)"
            )
        return "no rank waits: every recorded operation completed"
    one = len(culprits) == 1
    who = f"rank{'' if one else 's'} {', '.join(map(str, culprits))} {'is' if one else 'are'}"
    named = [s for s in stuck if set(s.missing) & set(culprits)]
    if named:
        widest = max(named, key=lambda s: (inside[(s.group, s.collective.seq)], len(s.entered)))
        op = widest.collective
        return (
            f"{who} the culprit: missing from {op.op} #{op.seq} of "
            f"{widest.groupDesc or 'group'} {widest.group}, which "
            f"{len(widest.entered)} other{'s' if len(widest.entered) != 1 else ''} entered; "
            f"{waits}"
        )
    m = next(m for m in mismatches if set(m.culprits) & set(culprits))
    group = f"{m.groupDesc or 'group'} {m.group}"
    return f"{who} the culprit: the {m.field} of #{m.seq} of {group} differs; {waits}"


def outstanding(dump: Dump) -> set[int]:
    """The `record_id`s of the dump's records not completed."""
    return {entry.record_id for entry in _Rank.of(dump).active}


def judge(dumps: Sequence[Dump], unread: Sequence[DumpError] = ()) -> FrVerdict:
    """The verdict on one job's dumps (one a rank); `unread`: files that could not be read."""
    judging = _Judge(dumps)
    without = sorted(
        {m for _, members in judging.groups.values() for m in members} - set(judging.ranks)
    )
    stuck = judging.stuck()
    judging.peer_waits()
    mismatches = _mismatches(judging)
    culprits = set(judging.culprits()) | {r for m in mismatches for r in m.culprits}
    ranks = _ranks(judging, culprits, without)
    first = dumps[0] if dumps else None
    return FrVerdict(
        culprits=sorted(culprits),
        summary=_summary(sorted(culprits), stuck, mismatches, ranks),
        ranks=ranks,
        stuck=stuck,
        mismatches=mismatches,
        withoutDump=without,
        unread=[str(u) for u in unread],
        version=first.version if first else "",
        commLib=first.comm_lib_version if first else "",
    )
