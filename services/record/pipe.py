"""A recorded rank's line to its watcher, and what the process says of itself. Standard
library only, loaded by path as `hook.py` is (`site/sitecustomize.py` loads it first).

The watcher (`rankscope.services.record.watcher`, run by `RANKSCOPE_RECORD_PYTHON`) is
started beside the process and reads JSON lines from a non-blocking pipe: a full pipe
drops the line and counts it, never blocks the program. The first line says who the rank
is: its process, when it started, where its stacks go on request.
"""

from __future__ import annotations

import contextlib
import errno
import faulthandler
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from typing import Any

__all__ = ["STACK_SIGNAL", "Pipe", "name_process", "note_child_exits", "now"]

STACK_SIGNAL = signal.SIGUSR1
"""Makes a recorded rank write its stacks, as a runner does."""
_COMMAND_CHARS = 256


def now() -> str:
    """The wall clock as a wire timestamp."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Pipe:
    """The lines of one rank to its watcher."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._lock = threading.Lock()
        self.dropped = 0
        """Lines dropped since the last entry (the pipe was full)."""

    @property
    def open(self) -> bool:
        """Whether lines still go anywhere."""
        return self._fd is not None

    def start(self, **hello: Any) -> None:
        """Start the watcher and say who this rank is (`hello`, beside what the process
        says of itself)."""
        python = os.environ.get("RANKSCOPE_RECORD_PYTHON", sys.executable)
        log = os.environ.get("RANKSCOPE_RECORD_LOG")
        with contextlib.ExitStack() as files:
            err = files.enter_context(open(log, "ab")) if log else subprocess.DEVNULL
            watcher = subprocess.Popen(
                [python, "-m", "rankscope.services.record.watcher"],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=err,
                start_new_session=True,  # a Ctrl-C for the program is not for it
                close_fds=True,
            )
        assert watcher.stdin is not None
        exits = os.environ.get("RANKSCOPE_RECORD_EXITS")
        if exits:  # `rankscope record` started this process: it will say how it ended
            with contextlib.suppress(OSError):
                open(os.path.join(exits, f"{os.getpid()}.rank"), "w").close()
        self._fd = os.dup(watcher.stdin.fileno())
        watcher.stdin.close()
        os.set_blocking(self._fd, False)
        self.send(
            "hello",
            **hello,
            pid=os.getpid(),
            host=os.environ.get("RANKSCOPE_RECORD_HOST", "127.0.0.1"),
            command=" ".join(sys.argv)[:_COMMAND_CHARS] or sys.executable,
            startedAt=_started_at(),
            exitFile=exits or "",
            stackFile=_stacks_on_request(),
        )

    def send(self, kind: str, **fields: Any) -> None:
        """One line to the watcher; dropped (and counted) when the pipe is full."""
        if self._fd is None:
            return
        line = json.dumps({kind: fields}, separators=(",", ":"), default=str).encode() + b"\n"
        with self._lock:
            try:
                written = os.write(self._fd, line)
            except BlockingIOError:
                self.dropped += 1
                return
            except OSError as exc:  # the watcher is gone: recording ends, the program not
                if exc.errno in (errno.EPIPE, errno.EBADF):
                    self._fd = None
                return
            if written < len(line):  # rare: finish the line rather than tear it
                os.set_blocking(self._fd, True)
                with contextlib.suppress(OSError):
                    os.write(self._fd, line[written:])
                os.set_blocking(self._fd, False)

    def entry(self, phase: str, event: str, detail: str | None = None, **attrs: Any) -> None:
        """A flight-recorder entry of this rank."""
        dropped, self.dropped = self.dropped, 0
        self.send(
            "entry", at=now(), phase=phase, event=event, detail=detail, attrs=attrs,
            dropped=dropped,
        )  # fmt: skip

    def close(self) -> None:
        """No more lines: the watcher reads to the end and goes."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _started_at() -> str:
    """When this process started, to the second (the same however often asked)."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as stat:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as boot:
            booted = next(int(line.split()[1]) for line in boot if line.startswith("btime"))
        seconds = booted + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        seconds = _FIRST_SEEN
    return datetime.fromtimestamp(int(seconds), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


_FIRST_SEEN = time.time()
"""When this module was first imported: the start time where the system keeps none."""


def _stacks_on_request() -> str:
    """Have `faulthandler` append every thread's stack to a file on `STACK_SIGNAL`, even
    from inside a blocked collective (after the program's own handler, if it has one);
    the file's path, empty when that cannot be."""
    previous = signal.getsignal(STACK_SIGNAL)
    try:
        handle, path = tempfile.mkstemp(prefix="rankscope-stacks-", suffix=".txt")
        os.close(handle)
        faulthandler.register(
            STACK_SIGNAL,
            file=open(path, "a"),  # noqa: SIM115  (open for the process's life)
            all_threads=True,
            chain=callable(previous),
        )
    except (OSError, RuntimeError, ValueError):
        return ""
    return path


def name_process(job: str, rank: int) -> None:
    """Add the job and rank to the process's title (`ps`: `python train.py [rankscope
    train-7 rank 1]`) where setproctitle can be imported (a Python without it keeps its)."""
    try:
        from setproctitle import getproctitle, setproctitle
    except ImportError:
        return
    setproctitle(f"{getproctitle()} [rankscope {job} rank {rank}]")


def note_child_exits() -> None:
    """In a launcher under `rankscope record` (`mlx.launch` is Python too): write how
    each child that is a recorded rank ended, where its watcher reads it (a watcher is
    the rank's child, so cannot learn its exit status or signal itself)."""
    exits = os.environ.get("RANKSCOPE_RECORD_EXITS")
    handle = getattr(subprocess.Popen, "_handle_exitstatus", None)
    if not exits or handle is None:
        return

    @functools.wraps(handle)
    def wrapped(self: subprocess.Popen[Any], *args: Any, **kwargs: Any) -> None:
        handle(self, *args, **kwargs)
        marker = os.path.join(exits, f"{self.pid}.rank")
        if self.returncode is not None and os.path.exists(marker):
            with contextlib.suppress(OSError):
                staged = os.path.join(exits, f"{self.pid}.tmp")
                with open(staged, "w") as out:
                    json.dump({"returncode": self.returncode}, out)
                os.replace(staged, os.path.join(exits, str(self.pid)))
                os.remove(marker)

    subprocess.Popen._handle_exitstatus = wrapped  # type: ignore[attr-defined]
    with contextlib.suppress(OSError):  # the watchers wait for what it writes (reaper_marker)
        open(os.path.join(exits, f"{os.getpid()}.reaps"), "w").close()
