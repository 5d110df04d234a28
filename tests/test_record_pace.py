"""A recorded rank's pace (`services/record/hook.py`): an evaluation waiting on
collectives every rank joins is a step; a sampled one is timed in parts, its input as
work, the collective as wait, and computes what it would have computed anyway."""

from __future__ import annotations

import time

import mlx.core as mx
import pytest

from rankscope.services.record import hook
from rankscope.services.record.hook import SAMPLE_EVERY, Recorder

pytestmark = pytest.mark.mlx


def _recorder() -> Recorder:
    return Recorder(mx, 0, 1, mx.eval)


def _issue(recorder: Recorder, op: str = "all_sum") -> mx.array:
    given = mx.tanh(mx.ones((64, 64)) @ mx.ones((64, 64)) / 64)
    result = mx.distributed.all_sum(given) if op == "all_sum" else given + 0
    recorder.collective(op, None, (given, result), 1 if op == "send" else None)
    return result


def test_a_sampled_step_is_timed_in_parts_and_computes_the_same() -> None:
    recorder = _recorder()
    result = _issue(recorder)
    assert recorder.due("eval")  # the first step is sampled
    recorder.sampled(lambda: mx.eval(result))
    recorder.evaluated(0.0)
    pace = recorder.take_pace()
    assert pace["steps"] == 1
    assert pace["workSeconds"] > 0
    assert pace["waitSeconds"] > 0
    assert float(result.sum()) == pytest.approx(float(mx.tanh(mx.ones((64, 64))).sum()))
    assert recorder.take_pace()["steps"] == 0  # taken once


def test_steps_are_sampled_one_in_so_many(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hook, "SAMPLE_GAP_S", 0.0)  # no least time: only the count holds
    monkeypatch.setattr(hook, "SAMPLE_ANYWAY_S", 60.0)
    recorder = _recorder()
    due = []
    for _ in range(SAMPLE_EVERY * 3):
        result = _issue(recorder)
        due.append(recorder.due("eval"))
        if due[-1]:
            recorder.sampled(lambda result=result: mx.eval(result))  # type: ignore[misc]
        else:
            mx.eval(result)
        recorder.evaluated(0.0)
    assert sum(due) == 3
    assert recorder.take_pace()["steps"] == 3


def test_steps_of_a_quarter_second_are_each_sampled() -> None:
    """Where steps are long, a few a second are timed however few steps that is: a
    rank's pace needs enough of them to tell a slowdown from its neighbours' turns."""
    recorder = _recorder()
    due = []
    for _ in range(4):
        result = _issue(recorder)
        due.append(recorder.due("eval"))
        recorder.sampled(lambda result=result: mx.eval(result))  # type: ignore[misc]
        recorder.evaluated(0.0)
        time.sleep(0.3)
    assert due == [True] * 4


def test_point_to_point_async_and_collective_free_evaluations_are_not_sampled() -> None:
    recorder = _recorder()
    _issue(recorder, "send")  # transfers pair with a peer's in its order: never split
    _issue(recorder)
    assert not recorder.due("eval")
    recorder.evaluated(0.0)
    _issue(recorder)
    assert not recorder.due("async_eval")
    recorder.evaluated(0.0)
    assert not recorder.due("item")  # nothing pending
