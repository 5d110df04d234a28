"""The runner's end of the flight recorder: never blocks inference.

Entries go into a bounded queue to the agent with `put_nowait`; when the agent falls
behind, entries are dropped and the count rides along with the next entry that fits.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from multiprocessing.queues import Queue
from typing import Any

from services.agent.runner.channel import ENTRY, MEMORY, OUTPUT, STATUS, TASK
from shared.timestamps import now
from shared.wire import Attrs, MlxMemorySnapshot, Phase, RunnerStatusKind, TaskStatus

__all__ = ["Recorder"]


class Recorder:
    """Records phase transitions, memory, status, task status and output of one runner.

    Args:
        telemetry: bounded queue for entries and memory snapshots (may drop).
        control: queue for status, task status and output (never drops).
        memory: takes an MLX memory snapshot.
        enabled: record entries at all (off only to measure what recording costs).
    """

    def __init__(
        self,
        *,
        telemetry: Queue[Any],
        control: Queue[Any],
        memory: Callable[[], MlxMemorySnapshot],
        enabled: bool = True,
    ) -> None:
        self._enabled = enabled
        self._telemetry = telemetry
        self._control = control
        self._memory = memory
        self.phase = Phase.CREATED
        self.dropped = 0
        self._unreported_drops = 0

    def record(
        self,
        phase: Phase,
        event: str,
        *,
        detail: str | None = None,
        attrs: Attrs | None = None,
        task_id: str | None = None,
        command_id: str | None = None,
        memory: bool = False,
    ) -> None:
        """Record one entry; with `memory`, attach an MLX memory snapshot."""
        self.phase = phase
        if not self._enabled:
            return
        message = (
            ENTRY,
            now(),
            phase.value,
            event,
            detail,
            attrs or {},
            task_id,
            command_id,
            self._memory() if memory else None,
            self._unreported_drops,
        )
        try:
            self._telemetry.put_nowait(message)
        except queue.Full:
            self.dropped += 1
            self._unreported_drops += 1
        else:
            self._unreported_drops = 0

    def sample_memory(self) -> None:
        """Send a periodic memory snapshot (dropped, not waited for, when the queue is full)."""
        try:
            self._telemetry.put_nowait((MEMORY, self._memory()))
        except queue.Full:
            self.dropped += 1

    def status(self, kind: RunnerStatusKind, detail: str | None = None) -> None:
        """Report a runner status change."""
        self._control.put((STATUS, kind.value, detail))

    def task(self, task_id: str, status: TaskStatus, detail: str | None = None) -> None:
        """Report this rank's status of a task."""
        self._control.put((TASK, task_id, status.value, detail))

    def output(
        self,
        command_id: str,
        seq: int,
        text: str,
        finish: str | None = None,
        tokens: tuple[int, int] | None = None,
    ) -> None:
        """Send generated text for a command, in order; the last chunk carries `finish` and
        the (prompt, completion) token counts."""
        self._control.put((OUTPUT, command_id, seq, text, finish, tokens))

    def flush(self) -> None:
        """Push everything queued to the agent before this process exits."""
        for channel in (self._telemetry, self._control):
            channel.close()
            channel.join_thread()
