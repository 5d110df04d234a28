"""Every blocking collective runs under a deadline; a wedge leaves a breadcrumb and exits.

When a guarded call overruns, the watchdog records `pipeline_eval_timeout` with the site
and memory, flushes the recorder and exits with `WEDGED_EXIT`, so the supervisor can tell a
wedge from a crash.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from services.agent.runner.recorder import Recorder

__all__ = ["WEDGED_EXIT", "Watchdog"]

WEDGED_EXIT = 75
"""Exit code of a runner whose collective did not finish in time."""


class Watchdog:
    """One thread watching the deadline of whatever blocking call is in progress."""

    def __init__(self, recorder: Recorder) -> None:
        self._recorder = recorder
        self._lock = threading.Condition()
        self._deadline: float | None = None
        self._site = ""
        self._seconds = 0.0
        threading.Thread(target=self._watch, name="watchdog", daemon=True).start()

    @contextmanager
    def guard(self, site: str, seconds: float) -> Iterator[None]:
        """Run the body under a deadline of `seconds`; `site` names the call in the entry."""
        with self._lock:
            self._deadline, self._site, self._seconds = time.monotonic() + seconds, site, seconds
            self._lock.notify()
        try:
            yield
        finally:
            with self._lock:
                self._deadline = None

    def _watch(self) -> None:
        with self._lock:
            while True:
                if self._deadline is None:
                    self._lock.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._lock.wait(left)
                    continue
                self._recorder.record(
                    self._recorder.phase,
                    "pipeline_eval_timeout",
                    detail=f"{self._site} did not finish within {self._seconds:g}s",
                    attrs={"site": self._site, "timeoutSeconds": self._seconds},
                    memory=True,
                )
                self._recorder.flush()
                os._exit(WEDGED_EXIT)
