"""The watcher of one recorded rank (`python -m rankscope.services.record.watcher`, started
by the rank's recorder with its pipe as standard input).

It registers the rank with the rank-table service, numbers what the rank records and
publishes it as the rank's telemetry, and says how the process ended once the pipe closes
or the process is gone. The rank never waits on it: the pipe is read at once into a
bounded buffer whatever NATS does; what overflows is dropped and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

import msgspec
import psutil
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from rankscope.services.record.pipe import STACK_SIGNAL
from rankscope.shared import logs
from rankscope.shared.connection import close, connect
from rankscope.shared.processes import DUMPABLE, dump_stacks, process_state, signal_name
from rankscope.shared.recording import STOP_FILE, reaper_marker
from rankscope.shared.settings import Settings, SettingsError, load
from rankscope.shared.subjects import Subjects, TelemetryKind
from rankscope.shared.telemetry import TelemetryPublisher
from rankscope.shared.timestamps import now
from rankscope.shared.wire import (
    Attrs,
    FlightEntry,
    Memory,
    MemorySampled,
    MlxMemorySnapshot,
    NodeEvidence,
    Phase,
    RecordedRank,
    Registered,
    RunnerEvidence,
    RunnerRef,
    RunnerStatusChanged,
    RunnerStatusKind,
    StepPace,
    WireError,
    decode,
    encode,
)

__all__ = ["BUFFERED_LINES", "main"]

log = logging.getLogger("rankscope.record")
_T = TypeVar("_T")

BUFFERED_LINES = 10_000
"""Lines of the rank held while NATS or the rank-table service is away."""
EXIT_FILE_WAIT_S = 1.0
"""How long to wait for `rankscope record` (or a launcher under it) to say how a rank it
started ended, once it reaped the rank..."""
REAP_WAIT_S = 10.0
"""...and before, while the rank waits to be reaped by a parent that writes it: on a
loaded machine a launcher's thread may take seconds to get to it."""
STOP_FILE_WAIT_S = 0.3
"""How long a rank that did not end cleanly waits for `rankscope record` to say the user
stopped it (it writes that before it passes the signal on)."""
LET_GO_S = 5.0
"""How long, once its rank's end is told, the watcher waits for what its libraries left
running to take their cancellation before it exits regardless."""
_REGISTER_TIMEOUT_S = 2.0
_POLL_S = 0.5
_GATHER_POLL_S = 0.2


class Hello(msgspec.Struct, kw_only=True, frozen=True):
    """Who the rank is (its first line)."""

    jobId: str
    nodeId: str
    deviceRank: int
    worldSize: int
    pid: int
    host: str
    port: int
    command: str
    startedAt: str
    exitFile: str = ""
    """Where `rankscope record` writes how the processes it started ended."""
    stackFile: str = ""
    """Where the rank appends its stacks on `STACK_SIGNAL` (empty: it cannot)."""


class RawEntry(msgspec.Struct, kw_only=True, frozen=True):
    at: str
    phase: Phase
    event: str
    detail: str | None = None
    attrs: Attrs = {}
    dropped: int = 0


class RawMemory(msgspec.Struct, kw_only=True, frozen=True):
    at: str
    active: int
    peak: int
    cache: int
    source: str = "mlx.core"
    pace: StepPace | None = None


class Bye(msgspec.Struct, kw_only=True, frozen=True):
    code: int | None = None
    error: str | None = None


class Line(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """One line of the pipe: one of these is set."""

    hello: Hello | None = None
    entry: RawEntry | None = None
    memory: RawMemory | None = None
    bye: Bye | None = None


class _Pipe:
    """The rank's lines, read by a thread as they come, the newest `BUFFERED_LINES` kept."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.lines: deque[Line] = deque(maxlen=BUFFERED_LINES)
        self.dropped = 0
        self.closed = asyncio.Event()
        self.closed_at: str | None = None
        self.closed_since = 0.0
        """When it closed, in monotonic seconds."""
        """When the rank's end of the pipe closed: when its process ended, to the ms."""
        self._ready = asyncio.Event()
        self._loop = loop
        threading.Thread(target=self._read, name="pipe", daemon=True).start()

    def _read(self) -> None:
        for raw in sys.stdin.buffer:
            try:
                line = msgspec.json.decode(raw, type=Line)
            except msgspec.ValidationError as exc:
                log.warning("a line of the rank is not understood: %s", exc)
                continue
            if len(self.lines) == self.lines.maxlen:
                self.dropped += 1
            self.lines.append(line)
            self._loop.call_soon_threadsafe(self._ready.set)
        self.closed_at, self.closed_since = now(), time.monotonic()
        self._loop.call_soon_threadsafe(self.closed.set)

    async def wait(self, seconds: float) -> None:
        """Until a line or the end comes, or `seconds` pass."""
        self._ready.clear()
        if self.lines or self.closed.is_set():
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready.wait(), seconds)


class _Rank:
    """The recorded rank as the bus knows it: its identity and its next seq."""

    def __init__(self, hello: Hello, runner: RunnerRef, subjects: Subjects) -> None:
        self.hello, self.runner, self.subjects = hello, runner, subjects
        self.seq = 0
        self.bye: Bye | None = None
        self.memory: MlxMemorySnapshot | None = None
        """Its last memory sample."""

    def next_seq(self, skip: int = 0) -> int:
        self.seq += skip
        seq, self.seq = self.seq, self.seq + 1
        return seq

    def subject(self, kind: TelemetryKind) -> str:
        r = self.runner
        return self.subjects.runner(r.nodeId, r.instanceId, r.deviceRank, kind)

    def publish(self, line: Line, publisher: TelemetryPublisher) -> None:
        if line.entry is not None:
            raw = line.entry
            attrs = {**raw.attrs, "droppedBefore": raw.dropped} if raw.dropped else raw.attrs
            entry = FlightEntry(
                seq=self.next_seq(raw.dropped),
                at=raw.at,
                phase=raw.phase,
                event=raw.event,
                detail=raw.detail,
                attrs=attrs,
            )
            publisher.entry(self.runner, self.subject("phase"), entry)
        elif line.memory is not None:
            sample = line.memory
            snapshot = MlxMemorySnapshot(
                generatedAt=sample.at,
                active=Memory(inBytes=sample.active),
                cache=Memory(inBytes=sample.cache),
                peak=Memory(inBytes=sample.peak),
                source=sample.source,
            )
            self.memory = snapshot
            seq = self.next_seq()
            message = MemorySampled(
                runner=self.runner, seq=seq, snapshot=snapshot, pace=sample.pace
            )
            publisher.telemetry(self.subject("memory"), encode(message), self.runner.runnerId, seq)
        elif line.bye is not None:
            self.bye = line.bye

    def status(self, publisher: TelemetryPublisher, status: RunnerStatusChanged) -> None:
        publisher.telemetry(
            self.subject("status"), encode(status), self.runner.runnerId, status.seq
        )

    async def evidence(self, msg: Msg) -> None:
        """Answer for the rank's evidence: its process state, its stacks (when it can
        write them: not stopped), its last memory sample."""
        pid, path = self.hello.pid, self.hello.stackFile
        state = process_state(pid)
        stack = None
        if path and state in DUMPABLE:
            stack = await dump_stacks(pid, Path(path), STACK_SIGNAL, first="Current thread")
        captured = RunnerEvidence(
            runnerId=self.runner.runnerId,
            pid=pid,
            process=state,
            stack=stack,
            mlxMemory=self.memory,
            capturedAt=now(),
        )
        with contextlib.suppress(NatsError):
            await msg.respond(encode(NodeEvidence(nodeId=self.runner.nodeId, runners=[captured])))

    def ended(self, at: str) -> RunnerStatusChanged:
        """How the process ended: as `rankscope record` saw it (its parent), else as the
        rank said on its way out, else killed (by a signal it did not handle, or
        `os._exit`)."""
        code, sig, detail = _exit_file(self.hello), None, None
        if code is None and self.bye is not None:
            code, detail = (self.bye.code or 0), self.bye.error
        if code is not None and code < 0:
            sig, detail = signal_name(code), detail or f"killed by {signal_name(code)}"
        if code is None:
            detail = "ended without exiting through Python: a signal it did not handle, or os._exit"
        clean = code == 0
        asked = None if clean else _stop_asked(self.hello)
        if asked is not None:
            detail = f"stopped by the user ({asked}); " + (detail or f"exited with status {code}")
        return RunnerStatusChanged(
            runner=self.runner,
            seq=self.next_seq(),
            at=at,
            statusKind=RunnerStatusKind.SHUTDOWN if clean or asked else RunnerStatusKind.FAILED,
            pid=self.hello.pid,
            processAlive=False,
            detail=detail or ("exited" if clean else f"exited with status {code}"),
            exitCode=code if sig is None else None,
            signal=sig,
            stoppedByUser=asked is not None,
        )


def _exit_file(hello: Hello) -> int | None:
    """The return code the rank's parent wrote for its pid (`rankscope record`, or a Python
    launcher under it), if it writes one."""
    if not hello.exitFile:
        return None
    folder = Path(hello.exitFile)
    path = folder / str(hello.pid)
    started = time.monotonic()
    deadline = started + EXIT_FILE_WAIT_S
    while True:
        with contextlib.suppress(OSError, ValueError, KeyError):
            code = int(json.loads(path.read_text())["returncode"])
            path.unlink()  # read: `rankscope record` may go
            return code
        waited = time.monotonic()
        if waited - started < REAP_WAIT_S and _awaits_reaper(hello.pid, folder):
            deadline = waited + EXIT_FILE_WAIT_S
        if waited >= deadline:
            return None
        time.sleep(0.05)


def _awaits_reaper(pid: int, folder: Path) -> bool:
    """Whether the process `pid` has ended but not yet been reaped by its parent, and that
    parent writes how its ranks end once it reaps them (`reaper_marker`)."""
    with contextlib.suppress(psutil.Error):
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return (folder / reaper_marker(process.ppid())).exists()
    return False


def _stop_asked(hello: Hello) -> str | None:
    """The signal the user stopped the job with through `rankscope record`, if they did;
    a moment's wait for it, as the rank may have ended before record wrote it down."""
    if not hello.exitFile:
        return None
    path = Path(hello.exitFile) / STOP_FILE
    deadline = time.monotonic() + STOP_FILE_WAIT_S
    while True:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            return str(json.loads(path.read_text())["signal"])
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _publish(pipe: _Pipe, rank: _Rank, publisher: TelemetryPublisher) -> None:
    """What the rank said since, its seqs skipping what the pipe's buffer dropped (the
    aggregator counts the gap)."""
    if pipe.dropped:
        rank.seq, pipe.dropped = rank.seq + pipe.dropped, 0
    while pipe.lines:
        rank.publish(pipe.lines.popleft(), publisher)


async def _before_giving_up(pipe: _Pipe, work: Awaitable[_T], give_up: float) -> _T | None:
    """What `work` comes to, or None once the rank has been gone `give_up` seconds without
    it (NATS away, the rank-table service not answering)."""
    task = asyncio.ensure_future(work)
    while not task.done():
        if pipe.closed.is_set() and time.monotonic() - pipe.closed_since > give_up:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, NatsError, OSError):
                await task
            return None
        await asyncio.wait({task}, timeout=1.0)
    return task.result()


async def _register(nc: Client, subjects: Subjects, hello: Hello) -> RunnerRef | None:
    """Ask until the rank-table service has announced the rank's job (None: it refused,
    said why in the log)."""
    request = RecordedRank(
        jobId=hello.jobId,
        nodeId=hello.nodeId,
        deviceRank=hello.deviceRank,
        worldSize=hello.worldSize,
        pid=hello.pid,
        host=hello.host,
        port=hello.port,
        command=hello.command,
        startedAt=hello.startedAt,
    )
    while True:
        try:
            reply = await nc.request(
                subjects.record_register(hello.nodeId), encode(request), timeout=_REGISTER_TIMEOUT_S
            )
            answer = decode(reply.data, Registered)
        except (NatsError, TimeoutError, WireError) as exc:
            log.info(
                "registering rank %d of %s: %s; asking again", hello.deviceRank, hello.jobId, exc
            )
            await asyncio.sleep(1.0)
            continue
        if answer.runner is None:
            log.error(
                "rank %d of %s not recorded: %s", hello.deviceRank, hello.jobId, answer.refused
            )
            return None
        if answer.announced:
            return answer.runner
        await asyncio.sleep(_GATHER_POLL_S)  # its peers have not all registered yet


async def watch(settings: Settings) -> None:
    """Watch the rank on the other end of standard input until it ends."""
    pipe = _Pipe(asyncio.get_running_loop())
    while not pipe.lines and not pipe.closed.is_set():
        await pipe.wait(1.0)
    if not pipe.lines or (hello := pipe.lines.popleft().hello) is None:
        return
    subjects = Subjects(settings.subject_prefix)
    name = f"rankscope-record-{hello.jobId}-{hello.deviceRank}"
    nc = await _before_giving_up(
        pipe, connect(settings, name), settings.record_give_up
    )  # retries until it answers
    if nc is None:
        log.error("NATS never answered; rank %d of %s not recorded", hello.deviceRank, hello.jobId)
        return
    try:
        runner = await _before_giving_up(
            pipe, _register(nc, subjects, hello), settings.record_give_up
        )
        if runner is None:
            return
        rank = _Rank(hello, runner, subjects)
        await nc.subscribe(
            subjects.record_evidence(runner.nodeId, runner.runnerId), cb=rank.evidence
        )
        publisher = TelemetryPublisher(nc=nc)
        stop = asyncio.Event()
        publishing = asyncio.create_task(publisher.run(stop, drain_for=settings.record_give_up))
        rank.status(
            publisher,
            RunnerStatusChanged(
                runner=runner,
                seq=rank.next_seq(),
                at=now(),
                statusKind=RunnerStatusKind.RUNNING,
                pid=hello.pid,
                processAlive=True,
            ),
        )
        while True:
            _publish(pipe, rank, publisher)
            if pipe.closed.is_set() or _gone(hello.pid):
                break
            await pipe.wait(_POLL_S)
        ended_at = pipe.closed_at or now()
        _publish(pipe, rank, publisher)
        rank.status(publisher, await asyncio.to_thread(rank.ended, ended_at))
        stop.set()
        await publishing
    finally:
        await close(nc)
        if hello.stackFile:
            with contextlib.suppress(OSError):
                os.remove(hello.stackFile)


async def let_go(seconds: float) -> list[asyncio.Task[object]]:
    """Cancel every other task and wait up to `seconds` for them to end; the ones that did
    not (a task that swallows its cancellation would hold `asyncio.run` forever)."""
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in others:
        task.cancel()
    if not others:
        return []
    _, pending = await asyncio.wait(others, timeout=seconds)
    return list(pending)


async def _watch_and_exit(settings: Settings) -> None:
    """`watch`, then exit even if a task will not end: nats.py's reconnect loop can swallow
    a cancellation (nats-io/nats.py#981), and a watcher whose NATS went away with its job
    would otherwise outlive the job for good."""
    failed = False
    try:
        await watch(settings)
    except Exception:
        failed = True
        log.exception("watching the rank failed")
    stuck = await let_go(LET_GO_S)
    if stuck:
        log.warning("exiting with %d task(s) that ignored cancellation: %s", len(stuck), stuck)
        logging.shutdown()
        os._exit(1 if failed else 0)
    if failed:
        raise SystemExit(1)


def main() -> int:
    """The watcher's entry point; settings come from `RANKSCOPE_*` variables."""
    try:
        settings = load()
    except SettingsError as exc:
        print(f"rankscope record: {exc}", file=sys.stderr)
        return 2
    logs.configure(settings.log_format, settings.log_level)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_watch_and_exit(settings))
    return 0


if __name__ == "__main__":
    os.nice(5)  # the ranks' work comes first
    sys.exit(main())
