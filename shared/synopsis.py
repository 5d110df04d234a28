"""Where a runner is, as its flight-recorder entries tell it: the one fold the agent (live,
per entry) and the aggregator (per batch, from the stream) both make."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

from rankscope.shared.wire import FlightRecord, MlxMemorySnapshot, Phase

__all__ = ["Synopsis", "advance"]

_MEMORY = attrgetter("mlxMemory")


@dataclass(frozen=True, slots=True)
class Synopsis:
    """A runner's state after the entries folded so far."""

    phase: Phase | None = None
    phase_since: str | None = None
    """When its current phase began: the first entry of the trailing run of that phase."""
    detail: str | None = None
    last_at: str | None = None
    """When its last entry was recorded."""
    task_id: str | None = None
    """The task it is working on (none once idle)."""
    command_id: str | None = None
    step: int | None = None
    """The last pipeline step an entry named."""
    memory: MlxMemorySnapshot | None = None
    """The last MLX memory snapshot an entry carried."""
    seq: int = -1
    """The seq of the newest entry folded."""


def advance(
    synopsis: Synopsis, entries: Sequence[FlightRecord], *, received: str | None = None
) -> Synopsis:
    """`synopsis` moved on by `entries` (in seq order); those no newer than the newest
    folded are skipped, so a batch that arrives after a later one moves nothing back. With
    `received`, when they arrived: no entry's time counts as later than that (a runner's
    clock ahead of the receiver's does not put its phases in the future)."""
    entries = [e for e in entries if e.seq > synopsis.seq]
    if not entries:
        return synopsis
    last = entries[-1]
    run = len(entries) - 1  # the trailing run of the last phase starts here
    while run > 0 and entries[run - 1].phase is last.phase:
        run -= 1
    since = synopsis.phase_since
    if run > 0 or last.phase is not synopsis.phase:
        since = entries[run].at
    task: tuple[str | None, str | None] | None = None
    step: int | None = None
    for entry in reversed(entries):  # newest first: most entries name a task and a step
        if task is None and entry.phase is Phase.IDLE:
            task = None, None
        elif task is None and entry.taskId is not None:
            task = entry.taskId, entry.commandId
        if step is None and entry.attrs:
            found = entry.attrs.get("step")
            step = found if isinstance(found, int) and not isinstance(found, bool) else None
        if task is not None and step is not None:
            break
    # few entries carry a snapshot: looked for without a Python step an entry
    memory = next(filter(None, map(_MEMORY, reversed(entries))), None)
    if task is None:
        task = synopsis.task_id, synopsis.command_id
    last_at = last.at
    if received is not None:  # no entry counts as later than its arrival
        since = min(since, received) if since is not None else None
        last_at = min(last_at, received)
    return Synopsis(  # not `dataclasses.replace`: ingest folds one batch a message
        phase=last.phase,
        phase_since=since,
        detail=last.detail,
        last_at=last_at,
        task_id=task[0],
        command_id=task[1],
        step=synopsis.step if step is None else step,
        memory=synopsis.memory if memory is None else memory,
        seq=last.seq,
    )
