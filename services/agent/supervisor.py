"""Supervise one runner process: spawn it, turn what it reports into numbered telemetry,
classify how it ended, restart it (up to a crash breaker, which a victim of its peers
does not trip: a collective timed out, or its ring lost a peer), and tear it down on
release.

The supervisor numbers every telemetry message of its runner (entries, memory samples,
status changes) with one gap-free `seq`, continuing where the stream left off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from pathlib import Path

from rankscope.services.agent.restarts import Restarts
from rankscope.services.agent.runner.channel import (
    PERMANENT_EXIT,
    STACK_SIGNAL,
    Assigned,
    Delivered,
    Entries,
    Entry,
    Memory,
    Output,
    Status,
    Stop,
    TaskReport,
    ToAgent,
    ToRunner,
)
from rankscope.services.agent.runner.config import RunnerConfig
from rankscope.services.agent.runner.entry import runner_main
from rankscope.services.agent.runner.watchdog import WEDGED_EXIT
from rankscope.shared.processes import DUMPABLE, dump_stacks, process_state, signal_name
from rankscope.shared.subjects import Subjects, TelemetryKind
from rankscope.shared.synopsis import Synopsis, advance
from rankscope.shared.telemetry import TelemetryPublisher
from rankscope.shared.timestamps import now
from rankscope.shared.wire import (
    Breadcrumb,
    FlightEntry,
    MemorySampled,
    Phase,
    RunnerEvidence,
    RunnerStatusChanged,
    RunnerStatusKind,
    RunnerSupervisorDiagnostics,
    TaskCreated,
    TaskStatus,
    TimelineEntry,
    TokenChunk,
    encode,
)

__all__ = ["RunnerSupervisor", "exit_cause"]

log = logging.getLogger(__name__)

KEEP_ENTRIES = 128
_TELEMETRY_QUEUE = 1024
_STOP_GRACE_S = 3.0  # twice this fits within `up`'s 8 s grace for the agent
_STARTING = frozenset(
    {
        RunnerStatusKind.IDLE,
        RunnerStatusKind.CONNECTING,
        RunnerStatusKind.CONNECTED,
        RunnerStatusKind.LOADING,
        RunnerStatusKind.LOADED,
        RunnerStatusKind.WARMING_UP,
    }
)
"""Where a runner has no task to finish: a stop ends it at once (SIGTERM)."""


def exit_cause(code: int) -> str:
    """How a runner process ended, in words."""
    if code == WEDGED_EXIT:
        return "watchdog: a collective did not finish in time"
    if code == PERMANENT_EXIT:
        return "it could not load its model"
    name = signal_name(code)
    return f"killed by {name}" if name else f"exit code {code}"


class RunnerSupervisor:
    """One runner process and everything known about it.

    Args:
        config: the rank to run.
        subjects: subject builders.
        publisher: where telemetry goes.
        first_seq: the next `seq` (one past the last one in the stream).
        on_output: called with each chunk of generated text.
        on_task: called with (task id, status, detail, refused) as this rank reports them.
    """

    def __init__(
        self,
        *,
        config: RunnerConfig,
        subjects: Subjects,
        publisher: TelemetryPublisher,
        first_seq: int,
        on_output: Callable[[TokenChunk], None],
        on_task: Callable[[str, TaskStatus, str | None, bool], None],
    ) -> None:
        self.config = config
        self._subjects = subjects
        self._publisher = publisher
        self._seq = first_seq
        self._on_output = on_output
        self._on_task = on_task
        self._context = multiprocessing.get_context("spawn")
        self._process: BaseProcess | None = None
        self._tasks: Queue[ToRunner] | None = None
        self._readers: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._restarts = Restarts()
        self._stacks_ready = False
        """Whether the process can write its stacks (SIGUSR1 would kill it before)."""
        self._lost_peer: str | None = None
        """The collective in which the process's ring lost a peer, if it did."""
        self._connect_deadline: asyncio.TimerHandle | None = None
        self._connect_overdue = False
        """Whether the agent ended the process for connecting past its deadline."""
        self._releasing = False
        self.exited = asyncio.Event()
        self.gave_up = False
        self.restarts = 0
        self.status = RunnerStatusKind.IDLE
        self.status_since, self.status_since_at = time.monotonic(), now()
        self.synopsis = Synopsis()
        """Where its entries say it is (phase, task, memory)."""
        self.phase_since = time.monotonic()
        self.completed_tasks = 0
        self.exit_code: int | None = None
        self.dropped_entries = 0
        self.entries: deque[TimelineEntry] = deque(maxlen=KEEP_ENTRIES)

    @property
    def runner_id(self) -> str:
        """The runner's id."""
        return self.config.runner.runnerId

    @property
    def pid(self) -> int | None:
        """The process id while it runs."""
        return self._process.pid if self._process is not None else None

    @property
    def alive(self) -> bool:
        """Whether the runner process is alive."""
        return self._process is not None and self._process.is_alive()

    def _subject(self, kind: TelemetryKind) -> str:
        ref = self.config.runner
        return self._subjects.runner(ref.nodeId, ref.instanceId, ref.deviceRank, kind)

    def _next_seq(self) -> int:
        seq, self._seq = self._seq, self._seq + 1
        return seq

    def start(self) -> None:
        """Spawn the runner process and start listening to it."""
        self._loop = asyncio.get_running_loop()
        telemetry: Queue[ToAgent] = self._context.Queue(_TELEMETRY_QUEUE)
        control: Queue[ToAgent] = self._context.Queue()
        self._tasks = self._context.Queue()
        self._process = self._context.Process(
            target=runner_main,
            args=(self.config, telemetry, control, self._tasks),
            name=f"runner-{self.runner_id}",
        )
        self._process.start()
        self._stacks_ready = False
        self._lost_peer = None
        self._connect_overdue = False
        self.exited.clear()
        self._readers = [
            threading.Thread(target=self._read, args=(channel, self._process), daemon=True)
            for channel in (telemetry, control)
        ]
        for reader in self._readers:
            reader.start()
        self._loop.add_reader(self._process.sentinel, self._on_exit_signal)
        log.info("runner started", extra={"runnerId": self.runner_id, "pid": self.pid})

    def _read(self, channel: Queue[ToAgent], process: BaseProcess) -> None:
        assert self._loop is not None
        while True:
            try:
                item = channel.get(timeout=0.2)
            except queue.Empty:
                if not process.is_alive():
                    return
                continue
            except (EOFError, OSError):
                return
            if isinstance(item, Delivered):
                continue
            try:
                self._loop.call_soon_threadsafe(self._handle, item)
            except RuntimeError:  # the agent's loop is gone: nobody is listening any more
                return

    def _entry(self, item: Entry) -> None:
        self._stacks_ready = True  # its first entry comes after it can dump its stacks
        attrs = item.attrs
        if item.event == Breadcrumb.PEER_LOST:
            self._lost_peer = str(attrs.get("site", item.phase.value))
        if item.dropped:
            attrs = {**attrs, "droppedBefore": item.dropped}
            self.dropped_entries += item.dropped
        self._record(
            FlightEntry(
                seq=self._next_seq(),
                at=item.at,
                phase=item.phase,
                event=item.event,
                detail=item.detail,
                attrs=attrs,
                taskId=item.taskId,
                commandId=item.commandId,
                mlxMemory=item.memory,
            )
        )

    def _handle(self, item: ToAgent) -> None:
        match item:
            case Entry():
                self._entry(item)
            case Entries(entries):
                for entry in entries:
                    self._entry(entry)
            case Memory(snapshot, pace):
                self.synopsis = replace(self.synopsis, memory=snapshot)
                sample = MemorySampled(
                    runner=self.config.runner, seq=self._next_seq(), snapshot=snapshot, pace=pace
                )
                self._publisher.telemetry(
                    self._subject("memory"), encode(sample), self.runner_id, sample.seq
                )
            case Status(kind, detail):
                if kind is RunnerStatusKind.READY:
                    self._restarts.ready()
                self._set_status(kind, detail)
            case TaskReport():
                self.completed_tasks += item.status is TaskStatus.COMPLETE
                self._on_task(item.taskId, item.status, item.detail, item.refused)
            case Output():
                prompt, completion = item.tokens if item.tokens else (None, None)
                self._on_output(
                    TokenChunk(
                        commandId=item.commandId,
                        seq=item.seq,
                        text=item.text,
                        finishReason=item.finish,
                        promptTokens=prompt,
                        completionTokens=completion,
                    )
                )

    def _record(self, entry: FlightEntry) -> None:
        before, self.synopsis = self.synopsis, advance(self.synopsis, [entry])
        if self.synopsis.phase is not before.phase:
            self.phase_since = time.monotonic()
        ref = self.config.runner
        self.entries.append(entry.of(ref))
        self._publisher.entry(ref, self._subject("phase"), entry)

    def _set_status(
        self,
        kind: RunnerStatusKind,
        detail: str | None = None,
        exit_code: int | None = None,
        signal: str | None = None,
    ) -> None:
        if kind is not self.status:
            self.status_since, self.status_since_at = time.monotonic(), now()
        self.status = kind
        self._keep_connect_deadline()
        self.exit_code = exit_code
        event = RunnerStatusChanged(
            runner=self.config.runner,
            seq=self._next_seq(),
            at=now(),
            statusKind=kind,
            pid=self.pid,
            processAlive=self.alive,
            detail=detail,
            exitCode=exit_code,
            signal=signal,
        )
        self._publisher.telemetry(self._subject("status"), encode(event), self.runner_id, event.seq)

    def _keep_connect_deadline(self) -> None:
        """A rank connecting its ring cannot keep its own deadline there (MLX holds the
        interpreter's lock until every peer has come, so its watchdog never runs): the
        agent keeps it."""
        if self._connect_deadline is not None:
            self._connect_deadline.cancel()
            self._connect_deadline = None
        if self.status is RunnerStatusKind.CONNECTING and self._loop is not None:
            seconds = self.config.timeouts.connect
            self._connect_deadline = self._loop.call_later(seconds, self._end_overdue_connect)

    def _end_overdue_connect(self) -> None:
        """What its watchdog would have done: a `pipeline_eval_timeout` breadcrumb, then the
        process ends as a victim of its peers (restarted without tripping the breaker)."""
        self._connect_deadline = None
        process, seconds = self._process, self.config.timeouts.connect
        if process is None or not process.is_alive() or self._releasing:
            return
        self._record(
            FlightEntry(
                seq=self._next_seq(),
                at=now(),
                phase=Phase.CONNECT_GROUP,
                event=Breadcrumb.COLLECTIVE_TIMEOUT,
                detail=f"connect_group did not finish within {seconds:g}s",
                attrs={"site": "connect_group", "timeoutSeconds": seconds, "endedBy": "agent"},
            )
        )
        self._connect_overdue = True
        process.kill()

    def submit(self, seq: int, task: TaskCreated) -> None:
        """Hand a task (with its stream sequence, the order all ranks agree on) to the runner."""
        if self._tasks is not None and self.alive:
            self._tasks.put(Assigned(seq, task))

    def _on_exit_signal(self) -> None:
        assert self._loop is not None
        assert self._process is not None
        self._loop.remove_reader(self._process.sentinel)
        self._loop.create_task(self._after_exit(self._process))

    async def _after_exit(self, process: BaseProcess) -> None:
        process.join()
        for reader in self._readers:
            await asyncio.to_thread(reader.join)
        code = process.exitcode if process.exitcode is not None else -1
        cause = exit_cause(code)
        if self._connect_overdue:
            cause = f"its ring did not connect within {self.config.timeouts.connect:g}s ({cause})"
        elif self._lost_peer is not None:
            cause = f"lost its peer in {self._lost_peer} ({cause})"
        elif self._releasing and self.status in _STARTING:
            cause = f"stopped while starting ({cause})"
        if self._releasing:
            if self.status is not RunnerStatusKind.SHUTDOWN:
                self._set_status(RunnerStatusKind.SHUTDOWN, cause, code, signal_name(code))
        else:
            self._crash(code, cause)
        self.exited.set()

    def _crash(self, code: int, cause: str) -> None:
        log.error("runner died: %s", cause, extra={"runnerId": self.runner_id})
        task_id = self.synopsis.task_id
        if task_id is not None:  # it will never finish: whoever waits is told
            self._on_task(task_id, TaskStatus.FAILED, f"the runner died: {cause}", False)
            self.synopsis = replace(self.synopsis, task_id=None, command_id=None)
        self._record(
            FlightEntry(
                seq=self._next_seq(),
                at=now(),
                phase=Phase.ERROR,
                event="process_exited",
                detail=cause,
                attrs={"exitCode": code, "failedIn": (self.synopsis.phase or Phase.CREATED).value},
            )
        )
        then = self._restarts.exited(
            time.monotonic(),
            victim=code == WEDGED_EXIT or self._lost_peer is not None or self._connect_overdue,
            permanent=code == PERMANENT_EXIT,
        )
        self.gave_up = then.delay is None
        detail = f"{cause}; {then.why_not or 'restarting'}"
        self._set_status(RunnerStatusKind.FAILED, detail, code, signal_name(code))
        if then.delay is not None:
            self.restarts += 1
            assert self._loop is not None
            self._loop.call_later(then.delay, self._restart)

    def _restart(self) -> None:
        if not self._releasing:
            self.start()

    async def release(self) -> None:
        """Stop the runner: one that serves is asked to stop with its peers between steps,
        SIGTERM after a grace period; one still starting has no task to finish and ends on
        SIGTERM at once. SIGKILL after another grace period."""
        self._releasing = True
        process = self._process
        if process is None:
            return
        if not process.is_alive():  # its exit may not be taken in yet
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.exited.wait(), _STOP_GRACE_S)
            return
        starting = self.status in _STARTING
        if self._tasks is not None and not starting:
            self._tasks.put(Stop())
        escalation = (process.terminate, process.kill)
        for action in escalation if starting else (None, *escalation):
            if action is not None and process.is_alive():
                action()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.exited.wait(), _STOP_GRACE_S)
                return

    async def capture(self) -> RunnerEvidence:
        """Its process state, its threads' stacks (none from a stopped process, which runs
        no code until continued, nor from one still starting) and its memory, now."""
        pid = self.pid if self.alive else None
        state = process_state(pid)
        stack = None
        path = self.config.stack_path
        if pid is not None and path is not None and self._stacks_ready and state in DUMPABLE:
            stack = await dump_stacks(pid, Path(path), STACK_SIGNAL, first="in runner_main")
        return RunnerEvidence(
            runnerId=self.runner_id,
            pid=pid,
            process=state,
            stack=stack,
            mlxMemory=self.synopsis.memory,
            capturedAt=now(),
        )

    def live(self) -> RunnerSupervisorDiagnostics:
        """The supervisor's view right now."""
        ref, rank = self.config.runner, self.config.assignment
        return RunnerSupervisorDiagnostics(
            runnerId=ref.runnerId,
            nodeId=ref.nodeId,
            instanceId=ref.instanceId,
            modelId=ref.modelId,
            deviceRank=rank.deviceRank,
            worldSize=rank.worldSize,
            startLayer=rank.startLayer,
            endLayer=rank.endLayer,
            nLayers=rank.nLayers,
            pid=self.pid,
            processAlive=self.alive,
            statusKind=self.status.value,
            statusSince=self.status_since_at,
            secondsInStatus=round(time.monotonic() - self.status_since, 3),
            exitCode=self.exit_code,
            phase=self.synopsis.phase,
            phaseStartedAt=self.synopsis.phase_since,
            phaseDetail=self.synopsis.detail,
            secondsInPhase=round(time.monotonic() - self.phase_since, 3),
            completedTaskCount=self.completed_tasks,
            lastProgressAt=self.synopsis.last_at,
            activeTaskId=self.synopsis.task_id,
            activeCommandId=self.synopsis.command_id,
            lastMlxMemory=self.synopsis.memory,
            restarts=self.restarts,
            droppedEntries=self.dropped_entries,
            acknowledgedSeq=self._publisher.acknowledged.get(ref.runnerId),
            entries=list(self.entries),
        )
