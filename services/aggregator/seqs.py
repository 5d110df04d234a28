"""Which `seq`s of a runner's entries were seen: redeliveries told apart, gaps counted,
as runs whose memory grows with the gaps, not the seqs. Pure."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["MAX_RUNS", "SeqTracker"]

MAX_RUNS = 4096
"""Runs of seen seqs kept per runner: past it the oldest gap is closed, so a runner sending
every other seq costs a bound (its missing seqs are still counted; one of them arriving
after that is taken for a redelivery)."""


@dataclass(slots=True)
class SeqTracker:
    """Which `seq`s of one runner were seen, as sorted, disjoint, non-touching runs
    `[start, end)`: memory grows with the gaps, up to `MAX_RUNS`, not with the seqs,
    wherever history begins."""

    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    seen: int = 0
    """Distinct seqs seen."""

    def add(self, seq: int) -> bool:
        """Note `seq`; False when it was seen before (a redelivery)."""
        starts, ends = self.starts, self.ends
        index = bisect.bisect_right(starts, seq) - 1
        if index >= 0 and seq < ends[index]:
            return False
        joins_left = index >= 0 and ends[index] == seq
        joins_right = index + 1 < len(starts) and starts[index + 1] == seq + 1
        if joins_left and joins_right:
            ends[index] = ends[index + 1]
            del starts[index + 1], ends[index + 1]
        elif joins_left:
            ends[index] = seq + 1
        elif joins_right:
            starts[index + 1] = seq
        else:
            starts.insert(index + 1, seq)
            ends.insert(index + 1, seq + 1)
            if len(starts) > MAX_RUNS:  # the oldest gap is forgotten: still counted missing
                ends[0] = ends[1]
                del starts[1], ends[1]
        self.seen += 1
        return True

    def follows(self, seqs: Sequence[int]) -> bool:
        """Whether `seqs` (some) are the next consecutive seqs after the newest seen."""
        ends = self.ends
        if not ends or not seqs or seqs[0] != ends[-1]:
            return False
        return len(seqs) == 1 or seqs == list(range(ends[-1], ends[-1] + len(seqs)))

    def fresh(self, seqs: Sequence[int]) -> Sequence[int]:
        """Note every seq of a batch (`seqs`, in its order); the positions of those not
        seen before."""
        if self.follows(seqs):  # the usual case: the next consecutive batch
            self.advance(len(seqs))
            return range(len(seqs))
        return [index for index, seq in enumerate(seqs) if self.add(seq)]

    def advance(self, count: int) -> None:
        """Note the next `count` seqs after the newest seen (`follows` said they are)."""
        self.ends[-1] += count
        self.seen += count

    @property
    def first(self) -> int | None:
        """The oldest seq seen: where the history this aggregator holds begins."""
        return self.starts[0] if self.starts else None

    @property
    def last(self) -> int | None:
        """The newest seq seen."""
        return self.ends[-1] - 1 if self.ends else None

    @property
    def missing(self) -> int:
        """Seqs between the oldest and the newest seen that never arrived."""
        return self.ends[-1] - self.starts[0] - self.seen if self.starts else 0
