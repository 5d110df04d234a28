"""The stage a pipeline waits on, read by comparing its stages' work per layer over the same
span: named from its first step, with the share of the pipeline's work lost to it; stages
holding different layers, a machine-wide slowdown and a stage held up once name nobody; a
stage stopped while it waits named by the wait it did not spin through."""

from __future__ import annotations

import random

from rankscope.services.aggregator.pace import PaceHistory
from rankscope.services.aggregator.stages import StageLimits, judge_stages
from rankscope.shared.wire import StepPace

LAYER_S = 0.0002
"""A layer's work a step."""


class Pipeline:
    """Stages holding `layers` each, sampling ten steps a second: a stage's step works
    `LAYER_S` a layer times its slowdown, with noise; it is stopped `stopped` seconds a
    step while it waits, and waits spinning at `spin` CPU seconds a second otherwise (said
    where `cpu`), times its own `spins`."""

    def __init__(self, layers: list[int], seed: int = 1, spin: float = 0.8) -> None:
        self.layers = layers
        self.slowdown = [1.0] * len(layers)
        self.stopped = [0.0] * len(layers)
        self.spin = spin
        self.spins = [1.0] * len(layers)
        self.cpu = True
        self.histories = [PaceHistory() for _ in layers]
        self.now = 1000.0
        self.noise = random.Random(seed)

    def run(self, seconds: int, named: frozenset[int] = frozenset()) -> list[list[int]]:
        """`seconds` of steps, judged each second: the stages named."""
        found = []
        for _ in range(seconds):
            self.now += 1.0
            works = [
                held * LAYER_S * slow * self.noise.uniform(0.85, 1.2)
                for held, slow in zip(self.layers, self.slowdown, strict=True)
            ]
            step = sum(works) + sum(self.stopped)
            for history, work, stopped, spins in zip(
                self.histories, works, self.stopped, self.spins, strict=True
            ):
                wait = step - work
                cpu = (wait - stopped) * self.spin * spins * self.noise.uniform(0.85, 1.0)
                pace = StepPace(
                    steps=10,
                    workSeconds=10 * work,
                    waitSeconds=10 * wait,
                    waitCpuSeconds=10 * cpu if self.cpu else None,
                )
                history.add(self.now, pace)
            straggle = judge_stages(self.histories, self.layers, self.now, StageLimits(), named)
            named = frozenset(straggle.stragglers) if straggle else frozenset()
            found.append(sorted(named))
        return found


def test_a_stage_slow_from_its_first_step_is_named_with_the_work_lost_to_it() -> None:
    pipeline = Pipeline([8, 8, 8, 8])
    pipeline.slowdown[2] = 1.3
    found = pipeline.run(30)
    first = next(i for i, named in enumerate(found) if named) + 1
    assert first <= 15
    assert {tuple(named) for named in found} <= {(), (2,)}
    assert all(found[first:])
    straggle = judge_stages(pipeline.histories, pipeline.layers, pipeline.now, StageLimits())
    assert straggle is not None
    assert straggle.layers == [8, 8, 8, 8]
    assert abs(straggle.work_vs_peers(2) - 1.3) < 0.1
    assert abs(straggle.waited_on[2] - 0.3 / 4.3) < 0.03  # its excess over the line's work
    assert straggle.last[2] > 0.9


def test_stages_holding_different_layers_at_one_pace_name_nobody() -> None:
    pipeline = Pipeline([3, 12, 6, 1], seed=2)
    assert not any(pipeline.run(600))


def test_a_machine_wide_slowdown_names_nobody() -> None:
    pipeline = Pipeline([8, 8, 8])
    pipeline.run(60)
    pipeline.slowdown = [1.6, 1.6, 1.6]
    assert not any(pipeline.run(60))


def test_a_stage_held_up_for_a_moment_is_not_named() -> None:
    pipeline = Pipeline([8, 8])
    pipeline.run(30)
    pipeline.slowdown[0] = 3.0
    pipeline.run(2)
    pipeline.slowdown[0] = 1.0
    assert not any(pipeline.run(30))


def test_a_named_stage_is_cleared_once_back_in_line() -> None:
    pipeline = Pipeline([8, 8, 8])
    pipeline.slowdown[1] = 2.0
    assert pipeline.run(20)[-1] == [1]
    pipeline.slowdown[1] = 1.0
    after = pipeline.run(30, named=frozenset({1}))
    assert after[-1] == []


def test_stages_that_cannot_be_compared_are_not_judged() -> None:
    pipeline = Pipeline([8, 8])
    pipeline.run(3)
    assert judge_stages(pipeline.histories, [8, 8], pipeline.now, StageLimits()) is None  # 3 s
    pipeline.run(20)
    assert judge_stages(pipeline.histories[:1], [8], pipeline.now, StageLimits()) is None
    assert judge_stages(pipeline.histories, [8, 0], pipeline.now, StageLimits()) is None
    assert judge_stages([pipeline.histories[0], None], [8, 8], pipeline.now, StageLimits()) is None
    assert judge_stages(pipeline.histories, [8, 8], pipeline.now + 60, StageLimits()) is None


def test_a_stage_that_strays_by_nature_is_named_beyond_its_spread_or_far_out_of_line() -> None:
    """Its spread, learnt over its history, slowdowns included, says 2.8x: a stage at 1.5x
    its peers is within it; at 2x the pipeline loses a third of its work to it: named."""
    for slowdown, named in ((1.5, []), (2.0, [0])):
        pipeline = Pipeline([8, 8])
        pipeline.slowdown[0] = slowdown
        pipeline.run(20)
        straggle = judge_stages(
            pipeline.histories, [8, 8], pipeline.now, StageLimits(), strays=[2.8, 1.1].__getitem__
        )
        assert straggle is not None
        assert straggle.stragglers == named


def test_a_stage_stopped_in_its_waits_too_is_named_by_the_wait_it_did_not_spin_through() -> None:
    """Stopped in its work (1.25x its peer's, under the naming bar) and as long again in its
    waits: its wait grows as its peer's does, but its peer spins through its wait and it
    does not. Named, as 2x its peer, where ranks say their CPU time and wait spinning; not
    otherwise."""
    for cpu, spin, named in ((True, 0.8, [1]), (False, 0.8, []), (True, 0.05, [])):
        pipeline = Pipeline([8, 8], spin=spin)
        pipeline.cpu = cpu
        pipeline.slowdown[1] = 1.25
        pipeline.stopped[1] = 0.75 * 8 * LAYER_S
        found = pipeline.run(30)
        assert found[-1] == named, (cpu, spin)
        if named:
            assert next(i for i, n in enumerate(found) if n) + 1 <= 10
            straggle = judge_stages(pipeline.histories, [8, 8], pipeline.now, StageLimits())
            assert straggle is not None
            assert abs(straggle.work_vs_peers(1) - 2.0) < 0.25


def test_a_stage_stopped_in_its_waits_mid_run_is_named_from_the_newest_seconds() -> None:
    """Stopped mid-run as above: named once the newest 8 s show it, not once the stop fills
    each half of the 20-s window (15-19 s in)."""
    for seed in (1, 2, 3):
        pipeline = Pipeline([8, 8], seed=seed)
        pipeline.run(40)
        pipeline.slowdown[1] = 1.25
        pipeline.stopped[1] = 0.75 * 8 * LAYER_S
        found = pipeline.run(30)
        assert next(i for i, n in enumerate(found) if n) + 1 <= 10, seed
        assert {tuple(n) for n in found} <= {(), (1,)}, seed


def test_a_stage_spinning_a_little_slower_than_its_peers_is_not_named_by_its_waits() -> None:
    """Healthy on a busy machine: 1.3x its peer's work per layer (its node's services on
    its core), under the naming bar, and spinning at 0.94x its peer's rate in its waits,
    within the spread healthy stages stray apart. Its wait is not counted as work: named
    by nobody; spinning at half its peer's rate (starved, as a stopped stage is), named."""
    for spins, named in ((0.94, []), (0.5, [1])):
        pipeline = Pipeline([8, 8])
        pipeline.slowdown[1] = 1.2
        pipeline.spins[1] = spins
        found = pipeline.run(40)
        assert found[-1] == named, spins
        assert all(n in ([], named) for n in found), spins
