"""Signals sent to `rankscope record` passed on to the command it runs, as launchers do
(one that asks to end, to every process under it, as a terminal does), and, once the
command ended, the ranks it leaves behind ended the same way: a launcher that dies of
SIGTERM without its ranks (mlx.launch does) leaves no rank running under rankscope.

A terminal's Ctrl-C and Ctrl-\\ reach the command itself (one process group), so on Linux,
where the sender of a signal can be learnt, those are not passed on twice; on macOS, where
it cannot, SIGINT and SIGQUIT are left to the terminal.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence

import psutil

__all__ = ["Relay"]

_PASSED_ON = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
_FROM_TERMINAL = (signal.SIGINT, signal.SIGQUIT)
"""A terminal sends these to the command itself (one process group)."""
_ENDING = {signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGQUIT}
"""Signals that ask a program to end: what the command leaves behind is ended too."""
_SI_KERNEL = 0x80
"""Linux's `si_code` of a signal the kernel sent: the terminal's Ctrl-C and Ctrl-\\."""
GRACE_S = 5.0
"""How long a rank left behind has to end after the signal before it is killed."""


class Relay:
    """The command's process, and the signals that asked it to end."""

    def __init__(
        self,
        command: Sequence[str],
        env: dict[str, str],
        kill_after: float,
        stopping: Callable[[signal.Signals], None] = lambda _: None,
    ) -> None:
        self.kill_after = kill_after
        """How long after a signal asked the command to end its ranks may still run while
        it waits for them, before those still running are killed (blocked in a collective
        whose peer ended, they run no handler)."""
        self.ending: signal.Signals | None = None
        """The last signal that asked the command to end, if any did."""
        self._stopping = stopping
        """Told of each signal that asks the command to end, before it is passed on."""
        self._family: dict[int, psutil.Process] = {}
        self._asked_at: float | None = None
        """When a signal first asked the command to end (monotonic)."""
        watched = {*_PASSED_ON, *_FROM_TERMINAL}
        if not hasattr(signal, "sigwaitinfo"):  # macOS
            self.child = subprocess.Popen(command, env=env)
            for sig in _PASSED_ON:
                signal.signal(sig, lambda number, _frame: self._received(number, False))
            for sig in _FROM_TERMINAL:
                signal.signal(sig, lambda number, _frame: self._received(number, True))
            return
        signal.pthread_sigmask(signal.SIG_BLOCK, watched)  # taken by `_relay` alone
        self.child = subprocess.Popen(
            command,
            env=env,
            preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_UNBLOCK, watched),
        )
        threading.Thread(target=self._relay, args=(watched,), daemon=True).start()

    def _relay(self, watched: set[signal.Signals]) -> None:
        while True:
            got = signal.sigwaitinfo(watched)
            terminal = got.si_signo in _FROM_TERMINAL and got.si_code == _SI_KERNEL
            self._received(got.si_signo, terminal)

    def _received(self, number: int, terminal: bool) -> None:
        """Pass the signal on unless the terminal sent it to the command already: one that
        asks to end to every process under the command, as a terminal does to its process
        group (a launcher may pass it on to its ranks or not: mlx.launch does not), any
        other to the command alone."""
        sig = signal.Signals(number)
        if sig in _ENDING:
            self.ending = sig
            self._asked_at = self._asked_at or time.monotonic()
            self._stopping(sig)
            self._gather()
        if terminal:
            return
        with contextlib.suppress(ProcessLookupError):
            self.child.send_signal(sig)
        for process in self._family.values() if sig in _ENDING else ():
            with contextlib.suppress(psutil.Error):
                process.send_signal(sig)

    def wait(self) -> int:
        """Wait for the command; once it ended, end what it left behind of those a signal
        asked to end (the signal again, then SIGKILL after `GRACE_S`). Its exit status.

        A rank blocked in a collective whose peer already ended runs no Python, so no
        signal ends it, and a launcher waiting for it never ends either: once a signal
        asked the job to end, ranks still running `kill_after` seconds later are killed,
        and the command itself `GRACE_S` after (a launcher wedged once its ranks ended:
        mlx.launch can deadlock on a Ctrl-C that lands as it reaps them)."""
        while True:
            try:
                returncode = self.child.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                asked = self._asked_at
                late = time.monotonic() - asked if asked is not None else 0.0
                if asked is not None and late >= self.kill_after:
                    self._kill_stuck()
                if asked is not None and late >= self.kill_after + GRACE_S:
                    with contextlib.suppress(ProcessLookupError):
                        self.child.kill()
        if self.ending is None:
            return returncode
        left = [p for p in self._family.values() if p.is_running()]
        for process in left:
            with contextlib.suppress(psutil.Error):
                process.send_signal(self.ending)
        _, alive = psutil.wait_procs(left, timeout=GRACE_S)
        for process in alive:
            with contextlib.suppress(psutil.Error):
                process.kill()
        psutil.wait_procs(alive, timeout=GRACE_S)
        return returncode

    def _gather(self) -> None:
        """Add the processes under the command, in its session, to those ended with it: a
        process in a session of its own (a rank's recording watcher) is no part of the job
        a terminal would signal, and ends on its own."""
        with contextlib.suppress(psutil.Error, OSError):
            session = os.getsid(self.child.pid)
            for process in psutil.Process(self.child.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error, OSError):
                    if os.getsid(process.pid) == session:
                        self._family.setdefault(process.pid, process)

    def _kill_stuck(self) -> None:
        """Kill the ranks of the job still running (those under the command now too: one
        a launcher started again, or not yet listed when the stop came), the command
        itself left to end once they have."""
        self._gather()
        for process in self._family.values():
            with contextlib.suppress(psutil.Error):
                if process.is_running():
                    process.kill()
