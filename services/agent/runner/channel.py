"""Messages from a runner process to its agent, as plain tuples (cheap to pickle).

Two queues: telemetry (bounded; a full queue drops and counts, never stalls inference) and
control (status, task status, generated text: must all arrive, and are few). Entries that
went together (several tokens' worth) travel as one `ENTRIES` message: one wakeup of the
agent for all of them.
"""

from __future__ import annotations

from typing import Literal

from shared.wire import Attrs, MlxMemorySnapshot

__all__ = [
    "ENTRIES",
    "ENTRY",
    "MEMORY",
    "OUTPUT",
    "STATUS",
    "TASK",
    "EntriesMessage",
    "EntryMessage",
    "MemoryMessage",
    "OutputMessage",
    "StatusMessage",
    "TaskMessage",
]

ENTRY: Literal["entry"] = "entry"
ENTRIES: Literal["entries"] = "entries"
MEMORY: Literal["memory"] = "memory"
STATUS: Literal["status"] = "status"
TASK: Literal["task"] = "task"
OUTPUT: Literal["output"] = "output"

EntryMessage = tuple[
    Literal["entry"],
    str,  # at
    str,  # phase
    str,  # event
    str | None,  # detail
    Attrs,
    str | None,  # taskId
    str | None,  # commandId
    MlxMemorySnapshot | None,
    int,  # entries dropped before this one
]
EntriesMessage = tuple[Literal["entries"], list[EntryMessage]]
MemoryMessage = tuple[Literal["memory"], MlxMemorySnapshot]
StatusMessage = tuple[Literal["status"], str, str | None]  # statusKind, detail
TaskMessage = tuple[Literal["task"], str, str, str | None]  # taskId, taskStatus, detail
# commandId, seq, text, finish, (prompt tokens, completion tokens) on the last chunk
OutputMessage = tuple[Literal["output"], str, int, str, str | None, tuple[int, int] | None]
