"""The diagnosis is a function of what was stored and when it was judged: an event log of a
soak (healthy, a rank slowed, back in line) replayed offline into a fresh aggregator core,
fed the same ticks, says the same, sample for sample."""

from __future__ import annotations

import time

from rankscope.services.aggregator.core import Core, Effect, Publish, Tick
from rankscope.services.aggregator.diagnosis import Thresholds
from rankscope.services.aggregator.store import EntryStore
from rankscope.services.aggregator.views import ClusterState
from rankscope.shared.wire import FindingKind, InstanceCreated, RunnerTelemetry
from tests.aggregator.builders import at, core_of
from tests.aggregator.lockstep import Lockstep

THRESHOLDS = Thresholds()

Log = list[tuple[float, list[tuple[RunnerTelemetry, int]]]]


def _core(state: ClusterState, placed: InstanceCreated) -> Core:
    return core_of(state, THRESHOLDS, {placed.instanceId: 1000.0})


def _tick(moment: float) -> Tick:
    return Tick(at=moment, wall=at(moment - 1000))


def _live(job: Lockstep, seconds: int, core: Core) -> list[list[Effect]]:
    said = []
    for _ in range(seconds):
        job.second()
        said.append(core.feed(_tick(job.now)))
    return said


def _replayed(placed: InstanceCreated, log: Log) -> list[list[Effect]]:
    """`log` applied to a fresh state in order, a tick fed after each second as it was."""
    state = ClusterState(store=EntryStore())
    state.apply_placement(placed, stored_ns=int(1000 * 1e9))
    core, said = _core(state, placed), []
    for second, events in log:
        state.arrive(second, time.time())
        for event, stored_ns in events:
            state.apply_telemetry(event, stored_ns=stored_ns)
        said.append(core.feed(_tick(second)))
    return said


def test_an_event_log_replayed_offline_says_what_was_said_live_sample_for_sample() -> None:
    job = Lockstep(seed=12)
    core = _core(job.state, job.placed)
    live = _live(job, 40, core)
    job.slowdown[3] = 1.4
    live += _live(job, 40, core)
    job.slowdown[3] = 1.0
    live += _live(job, 60, core)
    published = [e.finding for effects in live for e in effects if isinstance(e, Publish)]
    assert FindingKind.SLOW_RANK in {f.kind for f in published}  # worth replaying
    assert any(f.clearedAt for f in published)
    assert _replayed(job.placed, job.seconds) == live
