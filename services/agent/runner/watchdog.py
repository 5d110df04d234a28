"""Every blocking collective runs under a deadline, and a rank waiting in one says so.

A guarded call still running after `WAIT_NOTE_S` records `collective_wait` (the site and
since when) and, once it returns, `collective_resumed`: a rank waiting on a peer shows as
waiting, not as idle or busy. When a guarded call overruns its deadline, the watchdog
records `pipeline_eval_timeout` with the site and memory, flushes the recorder and exits
with `WEDGED_EXIT`, so the supervisor can tell a wedge (a victim of a silent peer) from a
crash.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

from rankscope.services.agent.runner.recorder import Recorder
from rankscope.shared.timestamps import from_micros
from rankscope.shared.wire import Breadcrumb, Phase

__all__ = ["WAIT_NOTE_S", "WEDGED_EXIT", "Watchdog"]

WEDGED_EXIT = 75
"""Exit code of a runner whose collective did not finish in time."""

_BACKENDS = ("[ring]", "[mpi]", "[jaccl]", "[nccl]")
"""How mlx.distributed's backends start their errors (`[ring] connection to a peer was lost`)."""

WAIT_NOTE_S = 2.0
"""How long a guarded call runs before the rank records that it is waiting in it."""


class Watchdog:
    """One thread watching the deadline of whatever blocking call is in progress.

    Entering a guard wakes the thread only when it would otherwise look too late: while
    decoding, a guard per token with the same deadline costs no thread switch (the thread
    competes with the computing one for the rank's core)."""

    def __init__(self, recorder: Recorder) -> None:
        self._recorder = recorder
        self._lock = threading.Condition()
        self._deadline: float | None = None
        self._note_at = 0.0
        self._noted = False
        self._site = ""
        self._phase: Phase | None = None
        self._entered = 0
        """When the guarded call was entered, in microseconds since the epoch (formatted
        only when recorded)."""
        self._seconds = 0.0
        self._wake_at = math.inf
        """When the watching thread looks next (inf: only when woken)."""
        self.broke: str | None = None
        """The site of the collective (a guarded call with peers) in which the distributed
        backend raised, if it did: the ring lost a peer."""
        threading.Thread(target=self._watch, name="watchdog", daemon=True).start()

    @contextmanager
    def guard(
        self, site: str, seconds: float, phase: Phase | None = None, *, peers: bool = True
    ) -> Iterator[None]:
        """Run the body under a deadline of `seconds`; `site` names the call in entries,
        `phase` the phase a wait in it is recorded in (the current one by default), `peers`
        whether it waits on other ranks (a collective) or only on this one."""
        before = self._recorder.phase
        started = time.monotonic()
        with self._lock:
            self._deadline, self._seconds = started + seconds, seconds
            self._note_at, self._noted = started + WAIT_NOTE_S, False
            self._site, self._phase, self._entered = site, phase, time.time_ns() // 1000
            if min(self._deadline, self._note_at) < self._wake_at:
                self._lock.notify()
        try:
            yield
        except Exception as exc:
            if peers and str(exc).startswith(_BACKENDS):
                self.broke = site
            raise
        finally:
            with self._lock:
                self._deadline = None
                noted = self._noted
            if noted:
                self._recorder.record(
                    before,
                    Breadcrumb.COLLECTIVE_RESUMED,
                    attrs={"site": site, "waitedSeconds": round(time.monotonic() - started, 3)},
                )

    def advance(self) -> None:
        """The guarded call made progress (a chunk of a long prefill went through every
        rank): its deadline starts again, so a rank that computes is never taken for one
        stuck behind a silent peer."""
        with self._lock:
            if self._deadline is not None:
                self._deadline = time.monotonic() + self._seconds

    def _watch(self) -> None:
        with self._lock:
            while True:
                if self._deadline is None:
                    self._wake_at = math.inf
                    self._lock.wait()
                    continue
                moment = time.monotonic()
                if moment >= self._deadline:
                    self._expire()
                if not self._noted and moment >= self._note_at:
                    self._noted = True
                    since = from_micros(self._entered)
                    self._record(
                        Breadcrumb.COLLECTIVE_WAIT, f"waiting in {self._site} since {since}"
                    )
                    continue
                wake = self._deadline if self._noted else min(self._deadline, self._note_at)
                self._wake_at = wake
                self._lock.wait(wake - moment)

    def _record(self, event: str, detail: str, *, memory: bool = False) -> None:
        self._recorder.record(
            self._phase or self._recorder.phase,
            event,
            detail=detail,
            attrs={
                "site": self._site,
                "since": from_micros(self._entered),
                "timeoutSeconds": self._seconds,
            },
            memory=memory,
        )

    def _expire(self) -> NoReturn:
        self._record(
            Breadcrumb.COLLECTIVE_TIMEOUT,
            f"{self._site} did not finish within {self._seconds:g}s",
            memory=True,
        )
        self._recorder.flush()
        os._exit(WEDGED_EXIT)
