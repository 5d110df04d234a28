"""The verdict on a PyTorch job's Flight Recorder dumps: what `rankscope fr analyze --json`
prints, and what `rankscope fr load` gives the aggregator as an incident's evidence."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from rankscope.shared.wire.base import CamelStruct
from rankscope.shared.wire.events import MAX_JOB_ID, MAX_WORLD, FlightEntry

__all__ = [
    "FrGroupStuck",
    "FrLoad",
    "FrMismatch",
    "FrOp",
    "FrRank",
    "FrRankEntries",
    "FrRole",
    "FrVerdict",
]

FrRole = Literal["culprit", "waiting", "done", "no dump"]


class FrOp(CamelStruct, kw_only=True, frozen=True):
    """One operation a rank recorded."""

    group: str
    """The process group's name (the same on every rank)."""
    groupDesc: str = ""
    op: str
    """As torch names it, without the backend: `all_reduce`, `send 0->3` (group ranks)."""
    seq: int
    """`collective_seq_id`, or `p2p_seq_id` for a send or receive."""
    p2p: bool = False
    sizes: str = ""
    """The inputs' shapes: `4027x5120`, several joined by `, `."""
    dtypes: str = ""
    createdAt: str | None = None
    state: str = ""


class FrGroupStuck(CamelStruct, kw_only=True, frozen=True):
    """A process group's first collective that not every member entered."""

    group: str
    groupDesc: str = ""
    ranks: list[int]
    collective: FrOp
    """As the first member that entered it recorded it."""
    entered: list[int]
    missing: list[int]
    """Members that never issued it (those without a dump among them)."""


class FrMismatch(CamelStruct, kw_only=True, frozen=True):
    """Members of a group that disagree on one collective: the same sequence number, a
    different operation, shape or type."""

    group: str
    groupDesc: str = ""
    seq: int
    field: Literal["operation", "sizes", "dtypes"]
    values: dict[str, list[int]]
    """Each value seen, with the ranks that recorded it."""
    culprits: list[int]
    """The ranks on the side fewer took (every side when they are as many)."""


class FrRank(CamelStruct, kw_only=True, frozen=True):
    """One rank as its dump (or the lack of one) shows it."""

    rank: Annotated[int, msgspec.Meta(ge=0, lt=MAX_WORLD)]
    role: FrRole
    waitingIn: FrOp | None = None
    """Its oldest operation not completed: where it waits."""
    waitingOn: list[int] = []
    """The ranks missing from `waitingIn` (or its peer, for a send or receive)."""
    lastOp: FrOp | None = None
    """The newest operation it recorded."""
    stack: list[str] = []
    """Where it issued `waitingIn` (else `lastOp`), innermost frame first, when the dump
    holds stacks."""
    dump: str | None = None


class FrVerdict(CamelStruct, kw_only=True, frozen=True):
    """Who a job waits on, judged from every rank's Flight Recorder dump."""

    culprits: list[int]
    summary: str
    ranks: Annotated[list[FrRank], msgspec.Meta(max_length=MAX_WORLD)]
    stuck: list[FrGroupStuck] = []
    mismatches: list[FrMismatch] = []
    withoutDump: list[int] = []
    """Members of the dumps' groups with no readable dump."""
    unread: list[str] = []
    """Files not read, each with why."""
    version: str = ""
    commLib: str = ""


class FrRankEntries(CamelStruct, kw_only=True, frozen=True):
    """One rank's newest records of a dump, as flight-recorder entries for its lane."""

    rank: Annotated[int, msgspec.Meta(ge=0, lt=MAX_WORLD)]
    entries: list[FlightEntry]


class FrLoad(CamelStruct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """A job's dumps put into rankscope (`rankscope fr load`, `POST /v1/fr/loads`): its
    ranks shown as instance `jobId`, the verdict as an incident of it."""

    jobId: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_JOB_ID)]
    verdict: FrVerdict
    ranks: Annotated[list[FrRankEntries], msgspec.Meta(min_length=1, max_length=MAX_WORLD)]
    loadedAt: str
    files: str = ""
    """Where the dumps were read, in words."""
