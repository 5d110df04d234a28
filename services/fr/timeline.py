"""A job's dumps as rankscope shows a job: each rank's newest records as flight-recorder
entries for its lane (completed ones as steps, outstanding ones as waits), and the verdict,
in one `FrLoad` for `rankscope fr load`. Pure: the time of the load is an argument."""

from __future__ import annotations

from collections.abc import Sequence

from rankscope.services.fr.dumps import Dump, Entry
from rankscope.services.fr.verdict import op_of, outstanding
from rankscope.services.fr.words import operation
from rankscope.shared.wire import FlightEntry, Phase
from rankscope.shared.wire.fr import FrLoad, FrRankEntries, FrVerdict

__all__ = ["ENTRIES_PER_RANK", "as_load"]

ENTRIES_PER_RANK = 200
"""The newest records of each rank put on its lane (torch keeps 2,000 by default)."""


def _entry(seq: int, entry: Entry, waiting: bool, at: str) -> FlightEntry:
    op = op_of(entry, entry.process_group[1])
    site = f"{op.op} #{op.seq} (group {op.group})"
    return FlightEntry(
        seq=seq,
        at=op.createdAt or at,
        phase=Phase.DECODE_BARRIER if waiting else Phase.IDLE,
        event="collective_wait" if waiting else "collective_done",
        detail=f"{'waiting in' if waiting else 'completed'} {operation(op)}",
        attrs={"site": site, "step": op.seq, "op": op.op, "group": op.group},
    )


def _lane(dump: Dump, at: str, kept: int) -> list[FlightEntry]:
    waiting = outstanding(dump)
    newest = sorted(dump.entries, key=lambda e: (e.time_created_ns or 0, e.record_id))
    newest = newest[-kept:]
    return [_entry(seq, e, e.record_id in waiting, at) for seq, e in enumerate(newest)]


def as_load(
    job: str,
    dumps: Sequence[Dump],
    verdict: FrVerdict,
    *,
    loaded_at: str,
    files: str,
    kept: int = ENTRIES_PER_RANK,
) -> FrLoad:
    """What `rankscope fr load` gives rankscope of `dumps` judged as `verdict`, the newest
    `kept` records of each rank on its lane."""
    return FrLoad(
        jobId=job,
        verdict=verdict,
        ranks=[FrRankEntries(rank=d.rank, entries=_lane(d, loaded_at, kept)) for d in dumps],
        loadedAt=loaded_at,
        files=files,
    )
