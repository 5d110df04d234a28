"""The aggregator's snapshot file: written atomically (temporary file, fsync, rename)
with a CRC by a forked copy of the aggregator (encoding hundreds of MB holds the
interpreter for most of a second; the aggregator's loop pauses only for the fork), and
read back, or ignored with a log line when it does not decode or fails its CRC.
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

import msgspec

from rankscope.services.aggregator.snapshot import Position, Snapshot, capture
from rankscope.services.aggregator.views import ClusterState

__all__ = ["SnapshotFile"]

log = logging.getLogger(__name__)

_MAGIC = b"RSSNAP1\n"

_COPY_NICENESS = 10
"""How much lower than the aggregator's the priority of the copy writing a snapshot is."""


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
