"""The diagnosis is a function of what was stored and when it was judged: an event log of a
soak (healthy, a rank slowed, back in line) replayed offline into a fresh aggregator core,
judged at the same moments, says the same, sample for sample."""

from __future__ import annotations

import time

from rankscope.services.aggregator.diagnosis import Thresholds, diagnose
from rankscope.services.aggregator.incidents import Incidents, Settled
from rankscope.services.aggregator.store import EntryStore
from rankscope.services.aggregator.views import ClusterState
from rankscope.shared.wire import FindingKind, InstanceCreated, RunnerTelemetry
from tests.aggregator.builders import at
from tests.aggregator.lockstep import Lockstep

THRESHOLDS = Thresholds()

Log = list[tuple[float, list[tuple[RunnerTelemetry, int]]]]


def _judge(state: ClusterState, incidents: Incidents, moment: float) -> Settled:
    """One round of the aggregator's judging at `moment`, as `findings.py` runs it."""
    found = diagnose(
        state,
        now=moment,
        wall=at(moment - 1000),
        incidents=incidents.open,
        placed_at=lambda _: 1000.0,
        thresholds=THRESHOLDS,
        unsettled=incidents.unsettled,
    )
    return incidents.settle(found, at=moment, wall=at(moment - 1000))


def _live(job: Lockstep, seconds: int, incidents: Incidents) -> list[Settled]:
    said = []
    for _ in range(seconds):
        job.second()
        said.append(_judge(job.state, incidents, job.now))
    return said


def _replayed(placed: InstanceCreated, log: Log) -> list[Settled]:
    """`log` applied to a fresh state in order, judged after each second as it was."""
    moment = [1000.0]
    state = ClusterState(store=EntryStore(), clock=lambda: moment[0], wall=time.time)
    state.apply_placement(placed, stored_ns=int(1000 * 1e9))
    incidents, said = Incidents(settling=THRESHOLDS.slow.window), []
    for second, events in log:
        moment[0] = second
        for event, stored_ns in events:
            state.apply_telemetry(event, stored_ns=stored_ns)
        said.append(_judge(state, incidents, second))
    return said


def test_an_event_log_replayed_offline_says_what_was_said_live_sample_for_sample() -> None:
    job = Lockstep(seed=12)
    incidents = Incidents(settling=THRESHOLDS.slow.window)
    live = _live(job, 40, incidents)
    job.slowdown[3] = 1.4
    live += _live(job, 40, incidents)
    job.slowdown[3] = 1.0
    live += _live(job, 60, incidents)
    kinds = [f.kind for s in live for f in s.changed]
    assert FindingKind.SLOW_RANK in kinds  # the soak said something worth replaying
    assert any(f.clearedAt for s in live for f in s.cleared)
    assert _replayed(job.placed, job.seconds) == live
