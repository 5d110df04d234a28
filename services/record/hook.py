"""The flight recorder inside a recorded program: wraps `mlx.core.distributed` and MLX's
evaluation so every rank says where it waits, without changing what the program computes.

Standard library only (it runs in the program's interpreter, whatever else that has):
what it records goes as JSON lines down a pipe to a watcher process
(`rankscope.services.record.watcher`) that speaks NATS; a full pipe drops and counts,
never blocks. The watcher is started with `RANKSCOPE_RECORD_PYTHON` (the interpreter of
`rankscope record`), so the program's interpreter needs nothing of rankscope's.

What is recorded per rank: the group's start, each collective's number in its group,
an evaluation that has lasted `WAIT_NOTE_S` (`collective_wait`, in the first collective
issued since the last evaluation, else in the evaluation itself: `mx.compile`d code hides
its collectives) and its end (`collective_resumed`), MLX memory and the rank's pace every
second, named steps, and how the process exits.

The pace: an evaluation that waits on collectives is one step. On a sampled step each
collective's input is evaluated first (work: this rank's own computation), then the
collective (wait: its peers, and the transfer), then the rest (work). Only collectives
every rank joins alike (`all_sum`, `all_gather`, ...) are split so; a step with
point-to-point transfers, or whose collectives compiled code hides, is not sampled. Every
rank samples the same steps (`Cadence`), and says each one's work and wait under its
first world collective's number: the rank the others wait on arrives last, and waits
least, on the same step.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from rankscope.services.record.pipe import name_process
from rankscope.services.record.rank import (
    SAMPLED_KEPT,
    WAIT_NOTE_S,
    Cadence,
    RankRecorder,
    node_id,
    note_exits,
)
from rankscope.services.record.rank import step as _step

__all__ = [
    "COLLECTIVES",
    "WAIT_NOTE_S",
    "Recorder",
    "install",
    "step",
]

COLLECTIVES = (
    "all_sum",
    "all_gather",
    "all_max",
    "all_min",
    "sum_scatter",
    "send",
    "recv",
    "recv_like",
)
_POINT_TO_POINT = frozenset({"send", "recv", "recv_like"})
_EVALUATIONS = ("eval", "async_eval")  # async_eval too waits when the last one has not finished
_ARRAY_EVALUATIONS = ("item", "tolist")


def _ring_port(rank: int) -> int:
    """This rank's ring port from `mlx.launch`'s hostfile, 0 when there is none."""
    try:
        with open(os.environ["MLX_HOSTFILE"]) as hostfile:
            address = json.load(hostfile)[rank][0]
        return int(str(address).rsplit(":", 1)[1])
    except (KeyError, OSError, ValueError, IndexError, TypeError):
        return 0


class Recorder(RankRecorder):
    """One MLX rank's recording: the evaluation in progress and its pace (`evaluate`:
    MLX's own `eval`, unrecorded)."""

    def __init__(self, mx: Any, rank: int, size: int, evaluate: Callable[..., Any]) -> None:
        super().__init__(rank, size)
        self.mx = mx
        self.pending: list[tuple[str, str, int, dict[str, Any]]] = []
        """Collectives issued since the last evaluation returned: (op, group, number,
        attrs)."""
        self.operands: list[tuple[Any, Any]] | None = []
        """The (input, result) of each pending collective, None once a point-to-point one
        is among them: what a sampled step evaluates one by one."""
        self.evaluate = evaluate
        self.cadence = Cadence()
        self._sampled: list[tuple[int, float, float, float]] = []
        self._step_ended: float | None = None
        """When the last evaluation with world collectives returned (`perf_counter`)."""
        self._steps = 0
        self._work = 0.0
        self._wait = 0.0
        self.waiting_since: float | None = None
        self.waiting_call = ""
        self.noted = False
        self._lock = threading.Lock()

    def memory(self) -> dict[str, Any]:
        mx = self.mx
        return {
            "source": "mlx.core",
            "active": mx.get_active_memory(),
            "peak": mx.get_peak_memory(),
            "cache": mx.get_cache_memory(),
        }

    def each_second(self, moment: float) -> None:
        self.cadence.retune(self.counts.get("world", 0), moment)

    def poll(self, moment: float) -> None:
        since, pending = self.waiting_since, self.pending
        if since is not None and not self.noted and moment - since >= WAIT_NOTE_S:
            self.noted = True
            self._note_wait(pending)

    def take_pace(self) -> dict[str, Any]:
        """The sampled steps since the last take (`StepPace`'s fields), reset."""
        with self._lock:
            pace = {
                "steps": self._steps,
                "workSeconds": self._work,
                "waitSeconds": self._wait,
                "sampled": self._sampled,
            }
            self._steps, self._work, self._wait, self._sampled = 0, 0.0, 0.0, []
        return pace

    def _note_wait(self, pending: list[tuple[str, str, int, dict[str, Any]]]) -> None:
        """Say the evaluation in progress has waited a while: in its first pending
        collective, or (none issued since the last one: they are inside compiled code, or
        there are none) in the evaluation itself."""
        if not pending:
            self.note_wait(f"{self.waiting_call}()")
            return
        op, group, number, attrs = pending[0]
        site = f"{op} #{number} (group {group})"
        self.note_wait(site, op=op, group=group, step=number, pending=len(pending), **attrs)

    # What the program calls

    def collective(self, op: str, group: Any, operands: tuple[Any, Any], peer: Any) -> None:
        """A collective was issued (MLX runs it when its result is evaluated): `operands`,
        its input (None for `recv`) and its result."""
        given, result = operands
        shape, nbytes = result.shape, result.nbytes
        name = "world" if group is None or group.size() == self.size else f"of {group.size()}"
        number = self.counts[name] = self.counts.get(name, 0) + 1
        self.issued = (op, name, number)
        attrs: dict[str, Any] = {"shape": "x".join(map(str, shape)) or "scalar", "bytes": nbytes}
        if peer is not None:
            attrs["peer"] = peer
        self.pending.append((op, name, number, attrs))
        if op in _POINT_TO_POINT:
            self.operands = None
        elif self.operands is not None:
            self.operands.append((given, result))

    def due(self, call: str) -> bool:
        """Whether the evaluation `call` starting now is a step to sample."""
        if not self.operands or call == "async_eval":
            return False
        world = [number for _, group, number, _ in self.pending if group == "world"]
        return bool(world) and self.cadence.due(world[0], world[-1])

    def sampled(self, run: Callable[[], Any]) -> Any:
        """Run the evaluation `run` as a sampled step: each pending collective's input,
        then the collective, then the rest, each timed."""
        step = next(number for _, group, number, _ in self.pending if group == "world")
        ended, work, wait = self._step_ended, 0.0, 0.0
        gap = time.perf_counter() - ended if ended is not None else 0.0
        for given, result in self.operands or ():
            started = time.perf_counter()
            if given is not None:
                self.evaluate(given)
            computed = time.perf_counter()
            self.evaluate(result)
            done = time.perf_counter()
            work, wait = work + computed - started, wait + done - computed
        started = time.perf_counter()
        value = run()
        work += time.perf_counter() - started
        with self._lock:
            self._steps += 1
            self._work += work
            self._wait += wait
            if len(self._sampled) < SAMPLED_KEPT:
                self._sampled.append((step, work, wait, gap))
        return value

    def evaluating(self, call: str) -> float:
        """An evaluation (`call`: `eval`, `item`, ...) starts: when it did."""
        started = time.monotonic()
        self.waiting_since, self.waiting_call, self.noted = started, call, False
        return started

    def evaluated(self, started: float) -> None:
        """The evaluation that started at `started` returned: its collectives are done."""
        if any(group == "world" for _, group, _, _ in self.pending):
            self._step_ended = time.perf_counter()
        if self.noted:
            self.note_resumed(time.monotonic() - started)
        self.pending, self.operands, self.waiting_since, self.noted = [], [], None, False


_recorder: Recorder | None = None


def _job_id(mx: Any, original_all_sum: Callable[..., Any], group: Any) -> str:
    """The job id every rank agrees on: given, else rank 0's drawn and summed to all."""
    given = os.environ.get("RANKSCOPE_RECORD_JOB")
    if given:
        return given
    mine = secrets.token_bytes(6) if group.rank() == 0 else bytes(6)
    summed = original_all_sum(mx.array(list(mine), dtype=mx.int32), group=group)
    return "job-" + bytes(int(b) for b in summed.tolist()).hex()


def _wrap_init(
    mx: Any, init: Callable[..., Any], all_sum: Callable[..., Any], plain_eval: Callable[..., Any]
) -> Callable[..., Any]:
    @functools.wraps(init)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        global _recorder
        group = init(*args, **kwargs)
        if _recorder is None and group.size() > 1:
            recorder = Recorder(mx, group.rank(), group.size(), plain_eval)
            job = _job_id(mx, all_sum, group)
            recorder.attach(job, node_id(), _ring_port(group.rank()))
            name_process(job, group.rank())
            recorder.entry("connect_group", "group_ready", rank=group.rank(), size=group.size())
            _recorder = recorder
        return group

    return wrapped


def _wrap_collective(op: str, original: Callable[..., Any]) -> Callable[..., Any]:
    peer_arg = 1 if op in ("send", "recv_like") else None

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        recorder = _recorder
        if recorder is not None:
            peer = kwargs.get("src", kwargs.get("dst"))
            if peer is None and peer_arg is not None and len(args) > peer_arg:
                peer = args[peer_arg]
            given = args[0] if args and op != "recv" else kwargs.get("x")
            recorder.collective(op, kwargs.get("group"), (given, result), peer)
        return result

    return wrapped


def _wrap_evaluation(call: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        recorder = _recorder
        if recorder is None:
            return original(*args, **kwargs)
        started = recorder.evaluating(call)
        try:
            if recorder.due(call):
                return recorder.sampled(lambda: original(*args, **kwargs))
            return original(*args, **kwargs)
        finally:
            recorder.evaluated(started)

    return wrapped


_installed = False


def install(mx: Any) -> None:
    """Wrap `mx` (the imported `mlx.core`): recording starts when the program's
    distributed group does. Installing twice changes nothing."""
    global _installed
    if _installed:
        return
    _installed = True
    distributed = mx.distributed
    originals = {op: getattr(distributed, op) for op in COLLECTIVES if hasattr(distributed, op)}
    distributed.init = _wrap_init(mx, distributed.init, originals["all_sum"], mx.eval)
    for op, original in originals.items():
        setattr(distributed, op, _wrap_collective(op, original))
    for name in _EVALUATIONS:
        setattr(mx, name, _wrap_evaluation(name, getattr(mx, name)))
    for name in _ARRAY_EVALUATIONS:
        setattr(mx.array, name, _wrap_evaluation(name, getattr(mx.array, name)))
    note_exits(lambda: _recorder)


@contextlib.contextmanager
def step(name: str) -> Iterator[None]:
    """Name a step of the program on its rank's timeline (`with step("forward"):`)."""
    with _step(_recorder, name):
        yield
