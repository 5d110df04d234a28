"""A recorded rank's pace (`services/record/hook.py`): an evaluation waiting on
collectives every rank joins is a step; a sampled one is timed in parts, its input as
work, the collective as wait, and computes what it would have computed anyway."""

from __future__ import annotations

import time

import mlx.core as mx
import pytest

from rankscope.services.record.hook import Recorder
from rankscope.services.record.rank import Cadence

pytestmark = pytest.mark.mlx


def _recorder() -> Recorder:
    return Recorder(mx, 0, 1, mx.eval)


def _issue(recorder: Recorder, op: str = "all_sum") -> mx.array:
    given = mx.tanh(mx.ones((64, 64)) @ mx.ones((64, 64)) / 64)
    result = mx.distributed.all_sum(given) if op == "all_sum" else given + 0
    recorder.collective(op, None, (given, result), 1 if op == "send" else None)
    return result


def test_a_sampled_step_is_timed_in_parts_named_by_its_collective_and_computes_the_same() -> None:
    recorder = _recorder()
    recorder.cadence.every = 1  # a job stepping slowly: each step sampled
    result = _issue(recorder)
    assert recorder.due("eval")
    recorder.sampled(lambda: mx.eval(result))
    recorder.evaluated(0.0)
    pace = recorder.take_pace()
    assert pace["steps"] == 1
    assert pace["workSeconds"] > 0
    assert pace["waitSeconds"] > 0
    assert [step for step, *_ in pace["sampled"]] == [1]  # its all_sum is world's first
    assert float(result.sum()) == pytest.approx(float(mx.tanh(mx.ones((64, 64))).sum()))
    assert recorder.take_pace()["steps"] == 0  # taken once


def _sampled(cadence: Cadence, steps: range, per_step: int = 1) -> list[int]:
    """The steps `cadence` samples of `steps`, each issuing `per_step` world collectives."""
    return [s for s in steps if cadence.due(s * per_step + 1, (s + 1) * per_step)]


def test_a_job_stepping_fast_samples_one_step_in_many_and_a_slow_one_every_step() -> None:
    fast, slow = Cadence(), Cadence()
    assert _sampled(fast, range(64)) == [15, 31, 47, 63]  # one in 16 until the rate is known
    fast.retune(issued=400, moment=time.monotonic() + 1)  # 400 a second: one in 64
    slow.retune(issued=4, moment=time.monotonic() + 1)  # a step of 250 ms: each
    assert fast.every == 64
    assert _sampled(fast, range(256)) == [63, 127, 191, 255]
    assert slow.every == 1
    assert _sampled(slow, range(8)) == list(range(8))
    # a step of three collectives: a multiple of `every` lands in one step of each 64/3
    assert len(_sampled(fast, range(256), per_step=3)) == 12


def test_ranks_at_either_side_of_a_rate_boundary_still_sample_common_steps() -> None:
    started = time.monotonic()
    one, other = Cadence(), Cadence()
    one.every = other.every = 1
    one.retune(issued=79, moment=started + 1)  # wants 8
    other.retune(issued=81, moment=started + 1)  # wants 16
    assert (one.every, other.every) == (8, 16)
    assert set(_sampled(other, range(200))) <= set(_sampled(one, range(200)))
    other.retune(issued=81 + 70, moment=started + 2)  # back under: kept until a quarter
    assert other.every == 16
    other.retune(issued=81 + 70 + 30, moment=started + 3)
    assert other.every == 4


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
