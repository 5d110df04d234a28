"""A rank's pace: how long its decode steps take working and how long waiting for peers.

A pipeline rank's step is one evaluation of a graph that holds its peers' transfers and
its own layers alike, so no clock around it can tell a slow rank from one waiting on a
slow peer: the two take the same time a step. On a sampled step the rank evaluates its
input first (the wait: its upstream peer's transfer, or the end of the last step, which
the last rank's gather closes) and then its own layers (the work: its inputs at hand, no
peer involved). A slow rank's work grows; its peers' wait grows and their work does not.

Evaluating inside the step costs two synchronisations and the overlap mlx-lm keeps
between building a step and computing the last, ~5-10% of a step on a small model, so
a step is sampled only once `SAMPLE_GAP_S` has passed since the last sampled one ended.
"""

from __future__ import annotations

import threading
import time

import mlx.core as mx

from rankscope.shared.wire import StepPace

__all__ = ["SAMPLE_GAP_S", "Pace"]

SAMPLE_GAP_S = 0.025
"""Least time between two sampled steps: at a millisecond a token, one step in 25."""


class Pace:
    """Sums of one rank's sampled decode steps, taken by the memory sampler each second.

    Args:
        gap: least seconds between two sampled steps (0: every step).
    """

    def __init__(self, gap: float = SAMPLE_GAP_S) -> None:
        self._gap = gap
        self._lock = threading.Lock()
        self._next = 0.0
        self._sampling = False
        self._started = 0.0
        self._wait = 0.0
        self._steps = 0
        self._work_s = 0.0
        self._wait_s = 0.0

    def received(self, h: mx.array) -> mx.array:
        """The rank's input to its first layer (`h`: the embedding, or the hidden state
        from the previous rank); on a decode step due for a sample, evaluated and timed as
        wait."""
        self._sampling = h.ndim == 3 and h.shape[1] == 1 and time.perf_counter() >= self._next
        if self._sampling:
            started = time.perf_counter()
            mx.eval(h)
            self._started = time.perf_counter()
            self._wait = self._started - started
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
        return h

    def take(self) -> StepPace:
        """The sums since the last take, reset."""
        with self._lock:
            taken = StepPace(steps=self._steps, workSeconds=self._work_s, waitSeconds=self._wait_s)
            self._steps, self._work_s, self._wait_s = 0, 0.0, 0.0
        return taken
