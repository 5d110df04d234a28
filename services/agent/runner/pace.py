"""A rank's pace: how long its decode steps take working and how long waiting for peers.

A pipeline rank's step is one evaluation of a graph that holds its peers' transfers and
its own layers alike, so no clock around it can tell a slow rank from one waiting on a
slow peer: the two take the same time a step. On a sampled step the rank evaluates its
input first (the wait: its upstream peer's transfer, or the end of the last step, which
the last rank's gather closes) and then its own layers (the work: its inputs at hand, no
peer involved). A slow rank's work grows; its peers' wait grows and their work does not.
The CPU time the process takes while it waits is kept too: a rank waits spinning, so one
stopped or starved while it waits takes less CPU in its wait than its peers do in theirs.

Evaluating inside the step costs two synchronisations and the overlap mlx-lm keeps
between building a step and computing the last, ~5-10% of a step on a small model, so
a step is sampled only once `SAMPLE_EVERY` steps and `SAMPLE_GAP_S` have passed since the
last sampled one (or `SAMPLE_ANYWAY_S`: where a step takes that long, two more
synchronisations cost nothing to speak of).
"""

from __future__ import annotations

import threading
import time

import mlx.core as mx

from rankscope.shared.wire import StepPace

__all__ = ["SAMPLE_ANYWAY_S", "SAMPLE_EVERY", "SAMPLE_GAP_S", "Pace"]

SAMPLE_EVERY = 32
"""Least decode steps from one sampled step to the next."""
SAMPLE_GAP_S = 0.1
"""Least time between two sampled steps: at a millisecond a token, one step in 100."""
SAMPLE_ANYWAY_S = 1.0
"""Time after a sampled step when the next is sampled, however few steps came between."""


class Pace:
    """Sums of one rank's sampled decode steps, taken by the memory sampler each second.

    Args:
        every: least steps from one sampled step to the next (1: any step).
        gap: least seconds between two sampled steps (0: no least).
    """

    def __init__(self, every: int = SAMPLE_EVERY, gap: float = SAMPLE_GAP_S) -> None:
        self._every, self._gap = every, gap
        self._unsampled = every
        self._lock = threading.Lock()
        self._next = 0.0
        self._sampling = False
        self._started = 0.0
        self._wait = 0.0
        self._wait_cpu = 0.0
        self._steps = 0
        self._work_s = 0.0
        self._wait_s = 0.0
        self._wait_cpu_s = 0.0

    def received(self, h: mx.array) -> mx.array:
        """The rank's input to its first layer (`h`: the embedding, or the hidden state
        from the previous rank); on a decode step due for a sample, evaluated and timed as
        wait."""
        if h.ndim != 3 or h.shape[1] != 1:
            return h  # a chunk of a prompt: not a decode step
        self._unsampled += 1
        moment = time.perf_counter()
        self._sampling = moment >= self._next and (
            self._unsampled >= self._every or moment >= self._next + SAMPLE_ANYWAY_S
        )
        if self._sampling:
            self._unsampled = 0
            started, cpu = time.perf_counter(), time.process_time()
            mx.eval(h)
            self._started = time.perf_counter()
            self._wait = self._started - started
            self._wait_cpu = time.process_time() - cpu
        return h

    def computed(self, h: mx.array) -> mx.array:
        """The output of the rank's last layer; on a sampled step, evaluated and timed as
        work."""
        if self._sampling:
            self._sampling = False
            mx.eval(h)
            ended = time.perf_counter()
            self._next = ended + self._gap
            with self._lock:
                self._steps += 1
                self._work_s += ended - self._started
                self._wait_s += self._wait
                self._wait_cpu_s += self._wait_cpu
        return h

    def take(self) -> StepPace:
        """The sums since the last take, reset."""
        with self._lock:
            taken = StepPace(
                steps=self._steps,
                workSeconds=self._work_s,
                waitSeconds=self._wait_s,
                waitCpuSeconds=self._wait_cpu_s,
            )
            self._steps, self._work_s, self._wait_s, self._wait_cpu_s = 0, 0.0, 0.0, 0.0
        return taken
