"""The runner process: join the ring, load the shard, warm up, then serve tasks that every
rank has agreed on. Spawned by the agent; talks to it only through queues."""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import queue
import signal
import threading
import traceback
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from setproctitle import setproctitle

from rankscope.services.agent.runner.channel import (
    PERMANENT_EXIT,
    STACK_SIGNAL,
    Stop,
    ToAgent,
    ToRunner,
)
from rankscope.services.agent.runner.config import RunnerConfig
from rankscope.services.agent.runner.generation import STREAM, Generation, RefusedError, barrier
from rankscope.services.agent.runner.memory import snapshot
from rankscope.services.agent.runner.pace import Pace
from rankscope.services.agent.runner.recorder import Recorder
from rankscope.services.agent.runner.shard import connect_group, load_shard, ring_hosts
from rankscope.services.agent.runner.watchdog import Watchdog
from rankscope.shared.processes import (
    die_with_parent,
    kill_when_orphaned,
    stop_watching,
    watch_parent,
)
from rankscope.shared.timestamps import now
from rankscope.shared.wire import (
    Breadcrumb,
    GenerationRequest,
    Phase,
    RunnerStatusKind,
    TaskCreated,
    TaskKind,
    TaskStatus,
)

__all__ = ["runner_main"]

_NO_TASK = -1
_DELIVER_S = 2.0
"""Longest a rank waits for its agent to take in what it said before connecting."""


class _Runner:
    def __init__(self, config: RunnerConfig, recorder: Recorder, tasks: Queue[ToRunner]) -> None:
        self.config = config
        self.recorder = recorder
        self.tasks = tasks
        self.watchdog = Watchdog(recorder)
        self.pending: dict[int, TaskCreated] = {}
        self.cancelled: set[str] = set()
        self.stopping = threading.Event()

    def start(self) -> tuple[Any, Generation]:
        config, record, status = self.config, self.recorder.record, self.recorder.status
        rank, timeouts = config.assignment, config.timeouts
        status(RunnerStatusKind.CONNECTING)
        record(
            Phase.CONNECT_GROUP,
            "init",
            attrs={
                "world_size": rank.worldSize,
                "rank": rank.deviceRank,
                "backend": "ring" if rank.worldSize > 1 else "none",
            },
        )
        self.recorder.deliver(_DELIVER_S)  # the connect holds the lock that sends them
        with self.watchdog.guard("connect_group", timeouts.connect):
            group = connect_group(rank, ring_hosts(config.assignments))
        status(RunnerStatusKind.CONNECTED)
        status(RunnerStatusKind.LOADING, f"layers [{rank.startLayer}, {rank.endLayer})")
        record(
            Phase.LOAD_MODEL,
            "start",
            detail=config.model_path,
            attrs={
                "startLayer": rank.startLayer,
                "endLayer": rank.endLayer,
                "nLayers": rank.nLayers,
            },
        )
        with self.watchdog.guard("load_model", timeouts.warmup, peers=False):
            shard = load_shard(
                Path(config.model_path), group, config.assignments, rank, self.recorder.pace
            )
        record(
            Phase.LOAD_MODEL,
            "loaded",
            memory=True,
            attrs={"layers": shard.layers, "parameterBytes": shard.parameter_bytes},
        )
        status(RunnerStatusKind.LOADED)
        status(RunnerStatusKind.WARMING_UP)
        record(Phase.WARMUP, "start")
        generation = Generation(
            config=config,
            shard=shard,
            group=group,
            recorder=self.recorder,
            watchdog=self.watchdog,
            cancelled=self.is_cancelled,
        )
        warm = TaskCreated(
            at=now(),
            taskId="warmup",
            instanceId=config.runner.instanceId,
            taskKind=TaskKind.START_WARMUP,
            request=GenerationRequest(prompt="warm up", maxTokens=2),
        )
        with self.watchdog.guard("warmup", timeouts.warmup):
            barrier(group)
            generation.run(warm)
        record(Phase.IDLE, Breadcrumb.RUNNER_READY, memory=True)
        status(RunnerStatusKind.READY)
        return group, generation

    def is_cancelled(self, task_id: str) -> bool:
        """Whether a cancel for `task_id` has reached this rank (checking for new ones), or
        the rank is stopping: either way every rank ends the task at the same step."""
        self._drain()
        return task_id in self.cancelled or self.stopping.is_set()

    def _wait(self, seconds: float) -> None:
        """Block until work arrives (a task, a cancel, a stop) or `seconds` pass."""
        try:
            item = self.tasks.get(timeout=seconds)
        except queue.Empty:
            return
        self._take(item)
        self._drain()

    def _drain(self) -> None:
        while True:
            try:
                item = self.tasks.get_nowait()
            except queue.Empty:
                return
            self._take(item)

    def _take(self, item: ToRunner) -> None:
        if isinstance(item, Stop):
            self.stopping.set()
            return
        seq, task = item.seq, item.task
        self.recorder.record(
            Phase.TASK_SUBMISSION,
            "task_acknowledged",
            task_id=task.taskId,
            command_id=task.commandId,
            attrs={"seq": seq},
        )
        if task.taskKind is TaskKind.CANCEL_TASK and task.targetTaskId:
            self.cancelled.add(task.targetTaskId)
            self.recorder.record(Phase.CANCEL_REQUESTED, "cancel", task_id=task.targetTaskId)
            self.recorder.task(task.taskId, TaskStatus.COMPLETE)  # the request is noted
        else:
            self.pending[seq] = task

    def _agree(self, group: Any) -> tuple[bool, TaskCreated | None]:
        """All ranks share whether they are stopping and their oldest pending task. One
        stopping rank stops them all in the same round, so no rank is left inside a
        collective its peer has quit. A task runs only when every rank has it; a task older
        than some rank's oldest never reached that rank: it is dropped."""
        local = [int(self.stopping.is_set()), min(self.pending, default=_NO_TASK)]
        with self.watchdog.guard(
            "task_agreement", self.config.timeouts.collective, Phase.TASK_AGREEMENT
        ):
            gathered = mx.distributed.all_gather(
                mx.array(local, dtype=mx.int64), group=group, stream=STREAM
            )
            shared = cast(list[list[int]], gathered.reshape(-1, 2).tolist())
        if any(stop for stop, _ in shared):
            self.stopping.set()
            return True, None
        oldest = [seq for _, seq in shared]
        if _NO_TASK in oldest:
            return False, None
        target = max(oldest)
        for seq in [s for s in self.pending if s < target]:
            dropped = self.pending.pop(seq)
            cancelled = dropped.taskId in self.cancelled
            self.recorder.task(
                dropped.taskId,
                TaskStatus.CANCELLED if cancelled else TaskStatus.FAILED,
                None if cancelled else "the task did not reach every rank",
            )
        if len(set(oldest)) > 1:
            return False, None
        task = self.pending.pop(target)
        self.recorder.record(
            Phase.TASK_AGREEMENT,
            "agreed",
            task_id=task.taskId,
            command_id=task.commandId,
            attrs={"agreed": 1, "different": 0, "queued": len(self.pending)},
        )
        return False, task

    def serve(self, group: Any, generation: Generation) -> None:
        status = self.recorder.status
        while True:
            if self.pending or self.stopping.is_set():
                self._drain()
            else:
                self._wait(self.config.idle_tick)
            stop, task = self._agree(group)
            if stop:
                for left in self.pending.values():  # nobody runs them after a restart either
                    self.recorder.task(left.taskId, TaskStatus.FAILED, "the runner was stopped")
                return
            if task is None:
                continue
            if task.taskId in self.cancelled:
                self.recorder.task(task.taskId, TaskStatus.CANCELLED)
                continue
            status(RunnerStatusKind.RUNNING, task.taskId)
            self.recorder.task(task.taskId, TaskStatus.RUNNING)
            try:
                finish = generation.run(task)
            except RefusedError as exc:  # every rank refuses it alike, before any collective
                self.recorder.task(task.taskId, TaskStatus.FAILED, str(exc), refused=True)
                status(RunnerStatusKind.READY)
                continue
            self.recorder.task(
                task.taskId,
                TaskStatus.CANCELLED if finish == "cancelled" else TaskStatus.COMPLETE,
                finish,
            )
            self.recorder.record(Phase.IDLE, "task_done", task_id=task.taskId)
            status(RunnerStatusKind.READY)


def _sample_memory(recorder: Recorder, every: float, stop: threading.Event) -> None:
    while not stop.wait(every):
        recorder.sample_memory()


def runner_main(
    config: RunnerConfig,
    telemetry: Queue[ToAgent],
    control: Queue[ToAgent],
    tasks: Queue[ToRunner],
) -> None:
    """Entry point of the spawned runner process."""
    tie = die_with_parent(signal.SIGKILL)  # even from inside a collective, no handler runs
    if tie is not None:
        tie()
    parent = multiprocessing.parent_process()
    agent = parent.pid if parent is not None else None
    if agent is not None and tie is None:
        kill_when_orphaned(agent)  # even while its ring connects, holding the GIL
    elif agent is not None:
        watch_parent(agent, signal.SIGKILL)  # at once if the agent died before the tie
    ref = config.runner
    setproctitle(f"rankscope runner {ref.instanceId} rank {ref.deviceRank} {ref.nodeId}")
    if config.stack_path is not None:  # the stacks on request, even from inside a collective
        faulthandler.register(
            STACK_SIGNAL,
            file=open(config.stack_path, "a"),  # noqa: SIM115  (open for the process's life)
            all_threads=True,
        )
    recorder = Recorder(
        telemetry=telemetry,
        control=control,
        memory=snapshot,
        pace=Pace() if config.assignment.worldSize > 1 else None,
    )
    runner = _Runner(config, recorder, tasks)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # starting, it has no task to finish
    recorder.record(Phase.CREATED, "process_started", memory=True, attrs={"pid": os.getpid()})
    sampler = threading.Thread(
        target=_sample_memory, daemon=True, args=(recorder, config.memory_interval, runner.stopping)
    )
    sampler.start()
    code = 0
    try:
        group, generation = runner.start()
        signal.signal(signal.SIGTERM, lambda *_: runner.stopping.set())  # stop with its peers
        runner.serve(group, generation)
        recorder.status(RunnerStatusKind.SHUTTING_DOWN)
        recorder.record(Phase.SHUTDOWN_CLEANUP, "stopping", memory=True)
        recorder.status(RunnerStatusKind.SHUTDOWN)
    except Exception as exc:
        site = runner.watchdog.broke  # raised inside a collective: a peer went away
        permanent = site is None and recorder.phase is Phase.LOAD_MODEL
        recorder.record(
            Phase.ERROR,
            Breadcrumb.PEER_LOST if site else type(exc).__name__,
            detail=str(exc)[:500],
            memory=True,
            attrs={
                "failedIn": recorder.phase.value,
                "exception": type(exc).__name__,
                "traceback": traceback.format_exc()[-2000:],
                "permanent": permanent,
                **({"site": site} if site else {}),
            },
        )
        recorder.status(RunnerStatusKind.FAILED, f"{type(exc).__name__}: {exc}")
        code = PERMANENT_EXIT if permanent else 1
    runner.stopping.set()
    sampler.join()
    recorder.flush()
    stop_watching()
    os._exit(code)
