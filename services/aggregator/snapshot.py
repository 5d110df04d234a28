"""Snapshots of the aggregator's folded state, so that a restart replays only what came
after them.

A snapshot holds the state and, per stream, the stream's identity (its creation time) and
the last sequence folded in. It is a cache, never the truth: it is written atomically
(temporary file, fsync, rename) with a CRC, and one that does not decode, fails its CRC,
comes from another incarnation of a stream (deleted and made again) or runs past a
stream's end is ignored with a log line, and the views are rebuilt by a full replay.

A forked copy of the aggregator encodes and writes it: encoding hundreds of MB holds the
interpreter for most of a second, and the aggregator's loop pauses only for the fork.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import time
import warnings
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

import msgspec

from rankscope.services.aggregator.pace import PaceHistory, PaceImage
from rankscope.services.aggregator.runners import Runners, RunnerView, TaskView
from rankscope.services.aggregator.store import EntryStore, SeqTracker, StoreImage
from rankscope.services.aggregator.views import ClusterState
from rankscope.shared.synopsis import Synopsis
from rankscope.shared.wire import (
    FlightRecord,
    InstanceCreated,
    MlxMemorySnapshot,
    Phase,
    RunnerRef,
    RunnerStatusChanged,
    TaskCreated,
    TaskStatus,
)

__all__ = ["Position", "Snapshot", "SnapshotFile", "capture", "restore"]

log = logging.getLogger(__name__)

_MAGIC = b"RSSNAP1\n"

_COPY_NICENESS = 10
"""How much lower than the aggregator's the priority of the copy writing a snapshot is."""


class Position(msgspec.Struct, array_like=True, frozen=True):
    """How far into one stream a snapshot goes."""

    created: str
    """The stream's creation time: a stream made again under the same name differs."""
    seq: int
    """The last stream sequence folded into the snapshot."""


class _Runner(msgspec.Struct, array_like=True):
    ref: RunnerRef
    starts: list[int]
    ends: list[int]
    seen: int
    status: RunnerStatusChanged | None
    phase: Phase | None
    phase_detail: str | None
    phase_since: str | None
    last_at: str | None
    step: int | None
    task_id: str | None
    command_id: str | None
    memory: MlxMemorySnapshot | None
    heard: bool
    progressed: bool
    waiting_in: str | None = None
    gave_up: FlightRecord | None = None
    failure: RunnerStatusChanged | None = None
    folded: int = -1
    """The seq of the newest entry its synopsis folded."""
    pace: PaceImage | None = None


class _Task(msgspec.Struct, array_like=True):
    created: TaskCreated
    statuses: dict[str, TaskStatus]


class Snapshot(msgspec.Struct):
    """The folded state and the stream positions it covers."""

    positions: dict[str, Position]
    runners: list[_Runner]
    instances: list[InstanceCreated]
    tasks: dict[str, list[_Task]]
    store: StoreImage
    duplicates: int


def capture(state: ClusterState, positions: dict[str, Position]) -> Snapshot:
    """What `state` holds now, covering `positions` (take both without awaiting between)."""
    return Snapshot(
        positions=positions,
        runners=[
            _Runner(
                ref=view.ref,
                starts=list(view.seqs.starts),
                ends=list(view.seqs.ends),
                seen=view.seqs.seen,
                status=view.status,
                phase=view.synopsis.phase,
                phase_detail=view.synopsis.detail,
                phase_since=view.synopsis.phase_since,
                last_at=view.synopsis.last_at,
                step=view.synopsis.step,
                task_id=view.synopsis.task_id,
                command_id=view.synopsis.command_id,
                memory=view.synopsis.memory,
                heard=view.heard is not None,
                progressed=view.progressed is not None,
                waiting_in=view.waiting_in,
                gave_up=view.gave_up,
                failure=view.failure,
                folded=view.synopsis.seq,
                pace=view.pace.image() if view.pace is not None else None,
            )
            for view in state.runners.values()
        ],
        instances=list(state.instances.values()),
        tasks={
            instance: [_Task(created=t.created, statuses=dict(t.statuses)) for t in tasks.values()]
            for instance, tasks in state.tasks.items()
        },
        store=state.store.image(),
        duplicates=state.duplicates,
    )


def restore(state: ClusterState, snapshot: Snapshot, *, moment: float) -> None:
    """Make `state` hold what `snapshot` held, within its store's limits; runners heard of
    before count as heard at `moment`, as after a full replay.

    Raises:
        ValueError: the snapshot does not hold together; `state` is left unchanged.
    """
    store = EntryStore.from_image(
        snapshot.store,
        per_runner=state.store.per_runner,
        total=state.store.total,
        max_bytes=state.store.max_bytes,
    )
    runners = Runners()
    for held in snapshot.runners:
        if len(held.starts) != len(held.ends):
            raise ValueError(f"runner {held.ref.runnerId!r}: seq runs do not pair up")
        runners.add(
            RunnerView(
                ref=held.ref,
                seqs=SeqTracker(starts=held.starts, ends=held.ends, seen=held.seen),
                status=held.status,
                synopsis=Synopsis(
                    phase=held.phase,
                    phase_since=held.phase_since,
                    detail=held.phase_detail,
                    last_at=held.last_at,
                    task_id=held.task_id,
                    command_id=held.command_id,
                    step=held.step,
                    memory=held.memory,
                    seq=held.folded,
                ),
                progressed=moment if held.progressed else None,
                heard=moment if held.heard else None,
                waiting_in=held.waiting_in,
                gave_up=held.gave_up,
                failure=held.failure,
                pace=PaceHistory.from_image(held.pace) if held.pace is not None else None,
            )
        )
    state.store = store
    state.runners = runners
    state.instances = {i.instanceId: i for i in snapshot.instances}
    state.tasks = {
        instance: OrderedDict(
            (t.created.taskId, TaskView(created=t.created, statuses=dict(t.statuses)))
            for t in tasks
        )
        for instance, tasks in snapshot.tasks.items()
    }
    state.duplicates = snapshot.duplicates
    state.version += 1


def _in_copy(work: Callable[[], None], report: int) -> NoReturn:
    """Run `work` in a forked copy and leave, saying why on `report` when it fails. The
    copy yields the CPU to the aggregator and its neighbours, dies of the signals that stop
    the aggregator, and runs nothing of the parent's on its way out (no loop, no atexit,
    no buffered output)."""
    code = 0
    try:
        with contextlib.suppress(ValueError):  # forked off the main thread: nothing to reset
            signal.set_wakeup_fd(-1)
            for stop in (signal.SIGINT, signal.SIGTERM):
                signal.signal(stop, signal.SIG_DFL)
        gc.disable()
        os.nice(_COPY_NICENESS)
        work()
    except BaseException as exc:  # whatever it is, the parent hears of it
        os.write(report, str(exc).encode()[:4096])
        code = 1
    finally:
        os._exit(code)


def _reap(pid: int) -> tuple[int, float]:
    """The exit code and CPU seconds of a copy that has closed its end of the pipe (it is
    exiting)."""
    _, status, usage = os.wait4(pid, 0)
    return os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Millions of new objects would set off full collections that find nothing to free."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class SnapshotFile:
    """Where snapshots are kept: one file, replaced whole."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _write(self, snapshot: Snapshot, parent: int) -> None:
        """Replace the file with `snapshot` (blocking), unless the aggregator `parent`
        that forked this copy is gone: a successor may have written a newer one."""
        body = msgspec.msgpack.encode(snapshot)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self._temporary(os.getpid())
        try:
            with temporary.open("wb") as out:
                out.write(_MAGIC + zlib.crc32(body).to_bytes(4, "big") + body)
                out.flush()
                os.fsync(out.fileno())
            if os.getppid() != parent:
                raise OSError("the aggregator that took it is gone")
            temporary.replace(self.path)
        finally:
            temporary.unlink(missing_ok=True)

    async def keep(
        self, state: ClusterState, positions: dict[str, Position]
    ) -> tuple[float, float]:
        """Write what `state` holds now, covering `positions`, from a forked copy of this
        process; returns once it is written, with the seconds the fork held this process
        and the CPU seconds the copy took.
        Cancelled, the copy is stopped and leaves nothing behind.

        Raises:
            OSError: the copy could not write it (with the copy's reason).
        """
        reasons, report = os.pipe()
        parent, started = os.getpid(), time.perf_counter()
        with warnings.catch_warnings():  # the copy takes no lock another thread could hold
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            os.close(reasons)
            _in_copy(lambda: self._write(capture(state, positions), parent), report)
        paused = time.perf_counter() - started
        os.close(report)
        loop, said = asyncio.get_running_loop(), bytearray()
        ended = loop.create_future()

        def on_readable() -> None:  # the copy's reason, then the end of it as it exits
            if chunk := os.read(reasons, 4096):
                said.extend(chunk)
            elif not ended.done():
                ended.set_result(None)

        loop.add_reader(reasons, on_readable)
        try:
            await ended
        except asyncio.CancelledError:
            os.kill(pid, signal.SIGKILL)
            _reap(pid)
            self._temporary(pid).unlink(missing_ok=True)
            raise
        finally:
            loop.remove_reader(reasons)
            os.close(reasons)
        code, cpu = _reap(pid)
        if code:
            raise OSError(said.decode(errors="replace") or f"the copy writing it ended with {code}")
        return paused, cpu

    def _temporary(self, pid: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{pid}.tmp")

    def read(self) -> Snapshot | None:
        """The snapshot kept, or None when there is none or it cannot be trusted
        (blocking: run it in a thread)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("snapshot %s unreadable (%s); replaying in full", self.path, exc)
            return None
        head = len(_MAGIC) + 4
        body = memoryview(data)[head:]  # a copy of hundreds of MB would cost seconds
        if data[: len(_MAGIC)] != _MAGIC or zlib.crc32(body) != int.from_bytes(
            data[len(_MAGIC) : head], "big"
        ):
            log.warning("snapshot %s is damaged; replaying in full", self.path)
            return None
        try:
            with _collector_paused():
                return msgspec.msgpack.decode(body, type=Snapshot)
        except msgspec.DecodeError as exc:
            log.warning("snapshot %s does not decode (%s); replaying in full", self.path, exc)
            return None
