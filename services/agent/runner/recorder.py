"""The runner's end of the flight recorder: never blocks inference.

Entries go into a bounded queue to the agent with `put_nowait`; when the agent falls
behind, entries are dropped and the count rides along with the next entry that fits.

What comes once a token (its entry, its text) goes at most once a `BATCH_WINDOW_S`: at
hundreds of tokens a second, each message to the agent (a wakeup of the agent, of NATS
and of every client) carries several tokens. Anything else sends what waits before it at
once, so a rank that stops in a collective has it all out with its `collective_wait`.
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
import time
from collections.abc import Callable
from multiprocessing.queues import Queue

from rankscope.services.agent.runner.channel import (
    Delivered,
    Entries,
    Entry,
    Memory,
    Output,
    Status,
    TaskReport,
    ToAgent,
)
from rankscope.services.agent.runner.pace import Pace
from rankscope.shared.timestamps import now
from rankscope.shared.wire import Attrs, MlxMemorySnapshot, Phase, RunnerStatusKind, TaskStatus

__all__ = ["BATCH_WINDOW_S", "Recorder"]

BATCH_WINDOW_S = 0.025
"""Longest a token's entry or text waits for the next tokens' before going to the agent."""


class Recorder:
    """Records phase transitions, memory, status, task status and output of one runner;
    safe to call from any thread (the watchdog records from its own).

    Args:
        telemetry: bounded queue for entries and memory snapshots (may drop).
        control: queue for status, task status and output (never drops).
        memory: takes an MLX memory snapshot.
        pace: the rank's pace, sent with each periodic memory sample (none in a world of
            one: no peer to keep pace with).
        enabled: record entries at all (off only to measure what recording costs).
        window: seconds a token's entry or text may wait for the next ones.
    """

    def __init__(
        self,
        *,
        telemetry: Queue[ToAgent],
        control: Queue[ToAgent],
        memory: Callable[[], MlxMemorySnapshot],
        pace: Pace | None = None,
        enabled: bool = True,
        window: float = BATCH_WINDOW_S,
    ) -> None:
        self._enabled = enabled
        self._telemetry = telemetry
        self._control = control
        self._memory = memory
        self.pace = pace
        self._window = window
        self._lock = threading.Lock()
        self.phase = Phase.CREATED
        self.dropped = 0
        self._unreported_drops = 0
        self._entries: list[Entry] = []
        self._entries_sent = -math.inf
        self._command: str | None = None
        """The command whose text is being sent, with its next chunk's seq, the text
        waiting to go and when its last chunk went."""
        self._seq = 0
        self._text = ""
        self._text_sent = -math.inf

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
        batch: bool = False,
    ) -> None:
        """Record one entry; with `memory`, attach an MLX memory snapshot. A `batch` entry
        (one a token) may wait for the next ones; any other goes at once, after them."""
        self.phase = phase
        if not self._enabled:
            return
        entry = Entry(
            at=now(),
            phase=phase,
            event=event,
            detail=detail,
            attrs=attrs or {},
            taskId=task_id,
            commandId=command_id,
            memory=self._memory() if memory else None,
        )
        with self._lock:
            self._entries.append(entry)
            moment = time.monotonic()
            if batch and moment - self._entries_sent < self._window:
                return
            self._send_entries(moment)
            if not batch:
                self._send_text(moment)

    def _send_entries(self, moment: float) -> None:
        entries, self._entries, self._entries_sent = self._entries, [], moment
        if not entries:
            return
        entries[0].dropped = self._unreported_drops
        try:
            self._telemetry.put_nowait(entries[0] if len(entries) == 1 else Entries(entries))
        except queue.Full:
            self.dropped += len(entries)
            self._unreported_drops += len(entries)
        else:
            self._unreported_drops = 0

    def sample_memory(self) -> None:
        """Send a periodic memory snapshot and the pace since the last (dropped, not waited
        for, when the queue is full), after the entries waiting."""
        sample = self._memory()  # outside the lock: inference never waits on it
        pace = self.pace.take() if self.pace is not None else None
        with self._lock:
            self._send_entries(time.monotonic())
            try:
                self._telemetry.put_nowait(Memory(sample, pace))
            except queue.Full:
                self.dropped += 1

    def status(self, kind: RunnerStatusKind, detail: str | None = None) -> None:
        """Report a runner status change."""
        self._control.put(Status(kind, detail))

    def task(
        self,
        task_id: str,
        status: TaskStatus,
        detail: str | None = None,
        *,
        refused: bool = False,
    ) -> None:
        """Report this rank's status of a task (`refused`: failed as asked, before any work:
        the request is at fault)."""
        self._control.put(TaskReport(taskId=task_id, status=status, detail=detail, refused=refused))

    def output(
        self,
        command_id: str,
        text: str,
        finish: str | None = None,
        tokens: tuple[int, int] | None = None,
    ) -> None:
        """Send generated text for a command, in order, in chunks numbered from 0; text may
        wait for the next tokens' unless it is the command's first or last. The last chunk
        carries `finish` and the (prompt, completion) token counts."""
        with self._lock:
            moment = time.monotonic()
            if command_id != self._command:
                self._send_text(moment)
                self._command, self._seq, self._text_sent = command_id, 0, -math.inf
            self._text += text
            if finish is None and moment - self._text_sent < self._window:
                return
            self._send_text(moment, finish, tokens)
            if finish is not None:
                self._command = None

    def _send_text(
        self, moment: float, finish: str | None = None, tokens: tuple[int, int] | None = None
    ) -> None:
        if self._command is None or (not self._text and finish is None):
            return
        self._control.put(
            Output(
                commandId=self._command,
                seq=self._seq,
                text=self._text,
                finish=finish,
                tokens=tokens,
            )
        )
        self._seq, self._text, self._text_sent = self._seq + 1, "", moment

    def _send_waiting(self) -> None:
        """Send the entries and text still waiting for the next tokens'."""
        with self._lock:
            moment = time.monotonic()
            self._send_entries(moment)
            self._send_text(moment)

    def deliver(self, timeout: float) -> None:
        """Wait (up to `timeout`: a stalled agent must not stall the rank) until all recorded
        so far is written to the agent, before a call that holds the interpreter's lock."""
        self._send_waiting()
        markers = []
        for channel in (self._telemetry, self._control):
            with contextlib.suppress(queue.Full):  # the agent is behind: nothing to wait for
                marker = Delivered()
                channel.put_nowait(marker)
                markers.append(marker)
        deadline = time.monotonic() + timeout
        for marker in markers:
            marker.out.wait(max(0.0, deadline - time.monotonic()))

    def flush(self) -> None:
        """Push everything waiting or queued to the agent before this process exits."""
        self._send_waiting()
        for channel in (self._telemetry, self._control):
            channel.close()
            channel.join_thread()
