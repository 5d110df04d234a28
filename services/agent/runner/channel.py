"""Messages between a runner process and its agent, one struct per kind (pickled across
the process boundary, as cheap as tuples: msgspec structs pickle as their fields).

To the runner, one queue: its instance's tasks, each with its place in the task stream,
and at last a `Stop`. To the agent, two queues: telemetry (bounded; a full queue drops
and counts, never stalls inference) and control (status, task status, generated text:
must all arrive, and are few). Entries that went together (several tokens' worth) travel
as one `Entries` message: one wakeup of the agent for all of them.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import msgspec

from rankscope.shared.wire import (
    Attrs,
    MlxMemorySnapshot,
    Phase,
    RunnerStatusKind,
    StepPace,
    TaskCreated,
    TaskStatus,
)

__all__ = [
    "PERMANENT_EXIT",
    "STACK_SIGNAL",
    "Assigned",
    "Delivered",
    "Entries",
    "Entry",
    "Memory",
    "Output",
    "Status",
    "Stop",
    "TaskReport",
    "ToAgent",
    "ToRunner",
]

STACK_SIGNAL = signal.SIGUSR1
"""Makes a runner write its threads' Python stacks to its `stack_path` (faulthandler, so
it works while the interpreter is blocked in C)."""

PERMANENT_EXIT = 78
"""Exit code of a runner that failed loading its model: the same error would recur on
every start (a missing file, an architecture it cannot split), so it is not restarted."""


class Entry(msgspec.Struct, kw_only=True):
    """One flight-recorder entry, not yet numbered (the agent gives it its `seq`)."""

    at: str
    phase: Phase
    event: str
    detail: str | None = None
    attrs: Attrs
    taskId: str | None = None
    commandId: str | None = None
    memory: MlxMemorySnapshot | None = None
    dropped: int = 0
    """Entries dropped (the queue was full) since the last one that went."""


class Entries(msgspec.Struct, frozen=True):
    """Entries that went together, in order."""

    entries: list[Entry]


class Memory(msgspec.Struct, frozen=True):
    """A periodic MLX memory sample, with the rank's pace since the last one."""

    sample: MlxMemorySnapshot
    pace: StepPace | None = None


class Status(msgspec.Struct, frozen=True):
    """The runner's status changed."""

    kind: RunnerStatusKind
    detail: str | None = None


class TaskReport(msgspec.Struct, frozen=True, kw_only=True):
    """This rank's status of a task; `refused`: failed as asked, before any work."""

    taskId: str
    status: TaskStatus
    detail: str | None = None
    refused: bool = False


class Output(msgspec.Struct, frozen=True, kw_only=True):
    """Generated text of a command, numbered from 0; the last has `finish` and the
    (prompt, completion) token counts."""

    commandId: str
    seq: int
    text: str
    finish: str | None = None
    tokens: tuple[int, int] | None = None


class Delivered:
    """Put after messages that must be out before the runner blocks holding the
    interpreter's lock (MLX's ring connect does), which stops a queue's feeder thread: the
    feeder pickles it only once everything put before it is written, and `out` is set
    then. The agent drops it."""

    def __init__(self) -> None:
        self.out = threading.Event()

    def __reduce__(self) -> tuple[Any, ...]:
        self.out.set()
        return (Delivered, ())


ToAgent = Entry | Entries | Memory | Status | TaskReport | Output | Delivered


class Assigned(msgspec.Struct, frozen=True):
    """A task of the runner's instance; `seq`, its place in the task stream, orders it
    alike on every rank."""

    seq: int
    task: TaskCreated


class Stop(msgspec.Struct, frozen=True):
    """Stop serving (the agent releases the runner)."""


ToRunner = Assigned | Stop
