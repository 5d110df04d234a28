"""The rank a job waits on, read by comparing ranks on the same sampled step: named from
its first step or once it slows, with the share of the job's time lost to it; a noisy
machine, neighbours taking turns on a core and a machine-wide slowdown name nobody."""

from __future__ import annotations

import json
import re
import statistics

import msgspec
import pytest

from rankscope.services.aggregator.arrivals import ArrivalLimits, Arrivals, judge_arrivals
from rankscope.services.aggregator.diagnosis import Thresholds
from rankscope.services.aggregator.snapshot import Snapshot, capture, restore
from rankscope.services.aggregator.store import EntryStore
from rankscope.services.aggregator.views import ClusterState
from rankscope.shared.wire import (
    MAX_SAMPLED_STEPS,
    Finding,
    RunnerStatusKind,
    SampledStep,
    StepPace,
    WireError,
    decode,
)
from tests.aggregator.builders import judged, metric_families, status
from tests.aggregator.lockstep import Lockstep


def _named(found: list[list[Finding]]) -> list[tuple[str, tuple[int, ...]]]:
    return [(f.kind.value, tuple(f.culpritRanks)) for findings in found for f in findings]


@pytest.mark.parametrize("seed", range(5))
def test_a_rank_slow_from_its_first_step_is_named_with_the_share_lost_to_it(seed: int) -> None:
    job = Lockstep(seed=seed)
    job.slowdown[2] = 1.3
    found = job.run(30)
    first = next(i for i, findings in enumerate(found) if findings) + 1
    assert first <= 15  # half the 30 s asked: no history to learn
    assert set(_named(found)) == {("slow_rank", (2,))}
    (finding,) = found[-1]
    pace = next(e.pace for e in finding.evidence if e.deviceRank == 2)
    assert pace is not None
    assert pace.waitedOn is not None
    assert pace.lastArrival is not None
    assert abs(pace.waitedOn - job.lost[2] / job.total) < 0.10  # within 10 points
    assert pace.lastArrival > 2 / 4  # twice chance at least
    assert pace.workVsPeers is not None
    assert pace.workVsPeers > 1.15
    assert re.match(
        r"rank 2 \(node-2\) is the straggler: the job loses \d+% of its time waiting for it, "
        r"last to arrive on \d+% of \d+ steps; its work per step is 1\.\dx its peers' "
        r"median; rank 0 \(node-0\) waits [\d.]+ ms a step",
        finding.summary,
    ), finding.summary


def test_a_rank_that_slows_mid_run_is_named_within_30s_and_cleared_after() -> None:
    job = Lockstep(seed=11)
    assert not any(job.run(60))
    job.slowdown[1] = 1.3
    during = job.run(60)
    named = next(i for i, findings in enumerate(during) if findings) + 1
    assert named <= 30
    assert set(_named(during)) == {("slow_rank", (1,))}
    assert all(findings for findings in during[named:])  # every sample after names it
    job.slowdown[1] = 1.0
    after = job.run(60)
    cleared = next(i for i, findings in enumerate(after) if not findings) + 1
    assert cleared <= 30
    assert not any(after[cleared:])


def test_a_rank_back_in_line_is_cleared_once_its_newest_steps_say_so() -> None:
    """Not once its slow steps have left the whole window: cleared after the newest
    `glance` of steps and the hold, while the window still holds its slow ones."""
    job = Lockstep(seed=12)
    job.run(60)
    job.slowdown[1] = 2.0
    assert all(job.run(60)[10:])
    job.slowdown[1] = 1.0
    after = job.run(60)
    cleared = next(i for i, findings in enumerate(after) if not findings) + 1
    limits, hold = ArrivalLimits(), Thresholds().slow.hold
    assert cleared <= limits.glance + hold + 2 < limits.window + hold
    assert not any(after[cleared:])


def test_a_healthy_noisy_job_names_nobody_for_half_an_hour() -> None:
    job = Lockstep(seed=5)
    assert not any(job.run(1800))


def test_a_machine_wide_slowdown_names_nobody() -> None:
    job = Lockstep(seed=8)
    job.run(30)
    job.slowdown = [1.6] * 4
    assert not any(job.run(60))


def test_two_ranks_of_a_pair_take_turns_and_a_straggler_among_eight_is_named() -> None:
    job = Lockstep(world=8, seed=2)
    job.slowdown[5] = 1.5
    assert set(_named(job.run(40))) == {("slow_rank", (5,))}


def test_ranks_are_compared_only_on_steps_every_one_sampled_in_the_window() -> None:
    ranks = [Arrivals(), Arrivals()]
    limits = ArrivalLimits(steps=3, window=10.0, span=0.0, certainty=1.0)
    ranks[0].add(100.0, [SampledStep(n, 0.001, 0.004) for n in range(1, 6)])
    ranks[1].add(100.0, [SampledStep(n, 0.005, 0.0) for n in range(3, 9)])
    straggle = judge_arrivals(ranks, now=100.5, limits=limits)
    assert straggle is not None
    assert straggle.steps == 3  # steps 3, 4 and 5
    assert straggle.stragglers == [1]
    assert straggle.last == [0.0, 1.0]
    assert straggle.waited_on[1] == pytest.approx(0.004 / 0.005)
    assert judge_arrivals(ranks, now=111.0, limits=limits) is None  # all out of the window
    assert judge_arrivals(ranks, now=99.0, limits=limits) is None  # stored after "now"
    assert judge_arrivals([ranks[0], None], now=100.5, limits=limits) is None
    assert judge_arrivals([ranks[0]], now=100.5, limits=limits) is None


def _pair(late: float) -> list[Arrivals]:
    """Two ranks, rank 1 last on every other step, by `late` seconds of 10 ms."""
    ranks = [Arrivals(), Arrivals()]
    for n in range(1, 11):
        behind = late if n % 2 else 0.0
        ranks[0].add(100.0, [SampledStep(n, 0.009, 0.001 + behind)])
        ranks[1].add(100.0, [SampledStep(n, 0.009 + behind, 0.001)])
    return ranks


def test_a_named_rank_stays_named_down_to_the_clearing_share() -> None:
    ranks = _pair(0.0007)
    limits = ArrivalLimits(steps=3, window=10.0, span=0.0, certainty=1.0, still=0.03)
    fresh = judge_arrivals(ranks, now=100.0, limits=limits)
    held = judge_arrivals(ranks, now=100.0, limits=limits, named=frozenset({1}))
    assert fresh is not None
    assert held is not None
    assert statistics.mean(fresh.waited_on) < limits.share
    assert fresh.stragglers == []
    assert held.stragglers == []  # 3.5% < the 5% that keeps it named
    assert judge_arrivals(
        ranks,
        now=100.0,
        limits=ArrivalLimits(steps=3, window=10.0, span=0.0, certainty=1.0, clear=0.03, still=0.03),
        named=frozenset({1}),
    ).stragglers == [1]  # type: ignore[union-attr]


def test_a_named_rank_whose_newest_steps_are_below_the_still_bar_is_cleared() -> None:
    """Back at a share its core mate gives it by nature (6.5%: above the 5% that holds a
    name over the window, below the naming bar), it is not named on."""
    ranks = _pair(0.0013)
    limits = ArrivalLimits(steps=3, window=10.0, span=0.0, certainty=1.0)
    held = judge_arrivals(ranks, now=100.0, limits=limits, named=frozenset({1}))
    assert held is not None
    assert limits.clear < held.waited_on[1] < limits.still
    assert held.stragglers == []
    lenient = ArrivalLimits(steps=3, window=10.0, span=0.0, certainty=1.0, still=limits.clear)
    assert judge_arrivals(ranks, now=100.0, limits=lenient, named=frozenset({1})).stragglers == [1]  # type: ignore[union-attr]


def _job(last_of: list[int], world: int = 4) -> list[Arrivals]:
    """`world` ranks over 10 ms steps: on step n the rank `last_of[n]` arrives last and
    its peers wait 3 ms for it."""
    ranks = [Arrivals() for _ in range(world)]
    for n, late in enumerate(last_of, start=1):
        for r, arrivals in enumerate(ranks):
            wait = 0.0 if r == late else 0.003
            arrivals.add(100.0 + n / 10, [SampledStep(n, 0.010 - wait, wait)])
    return ranks


def test_two_ranks_splitting_the_blame_on_one_node_name_nobody_a_node_of_two_is_named() -> None:
    ranks = _job([0, 2] * 30)  # two ranks on a core a neighbour keeps busy, by turns
    limits = ArrivalLimits(span=0.0)
    one_node = judge_arrivals(ranks, now=106.0, limits=limits, nodes=["vm"] * 4)
    assert one_node is not None
    assert one_node.waited_on[0] == one_node.waited_on[2] >= limits.share
    assert one_node.stragglers == []  # neither dominates: their core, not one of them
    two_nodes = judge_arrivals(ranks, now=106.0, limits=limits, nodes=["a", "b", "a", "b"])
    assert two_nodes is not None
    assert sorted(two_nodes.stragglers) == [0, 2]  # node a's ranks, together
    held = judge_arrivals(
        ranks, now=106.0, limits=limits, named=frozenset({0, 2}), nodes=["vm"] * 4
    )
    assert held is not None
    assert sorted(held.stragglers) == [0, 2]  # named before: kept while the job loses enough


def test_a_rank_a_hair_behind_its_slow_core_mate_is_not_the_straggler() -> None:
    ranks = [Arrivals() for _ in range(4)]
    for n in range(1, 61):  # ranks 0 and 2 on a busy core: 0 last, 2 in 0.3 ms before it
        waits = [0.0, 0.003, 0.0003, 0.003]
        for arrivals, wait in zip(ranks, waits, strict=True):
            arrivals.add(100.0 + n / 10, [SampledStep(n, 0.010 - wait, wait)])
    straggle = judge_arrivals(ranks, now=106.0, limits=ArrivalLimits(span=0.0), nodes=["vm"] * 4)
    assert straggle is not None
    assert straggle.waited_on[0] >= 0.25  # past the bar by its peers' median wait...
    assert straggle.last[0] == 1.0
    assert straggle.stragglers == []  # ...but quick, it gives the job back 3%: rank 2 is next


def test_a_straggler_whose_core_mate_is_now_and_then_last_is_named_alone() -> None:
    ranks = _job([2, 2, 2, 2, 0] * 12)
    straggle = judge_arrivals(ranks, now=106.0, limits=ArrivalLimits(span=0.0), nodes=["vm"] * 4)
    assert straggle is not None
    assert straggle.waited_on[2] > 2.5 * straggle.waited_on[0] > 0
    assert straggle.stragglers == [2]


def test_the_sampled_steps_survive_a_restart_from_a_snapshot() -> None:
    job = Lockstep(seed=4)
    job.slowdown[3] = 1.4
    job.run(15)
    kept = msgspec.json.decode(msgspec.json.encode(capture(job.state, {})), type=Snapshot)
    state = ClusterState(store=EntryStore())
    restore(state, kept, moment=job.now)
    before = job.state.runners["i-r3"].pace
    after = state.runners["i-r3"].pace
    assert before is not None
    assert after is not None
    assert after.arrivals.steps == before.arrivals.steps
    job.state = state
    assert set(_named(job.run(2))) == {("slow_rank", (3,))}


def test_prometheus_has_each_ranks_waited_on_share_and_last_arrival_rate() -> None:
    job = Lockstep(seed=6)
    job.slowdown[0] = 1.5
    job.run(10)
    families = metric_families(job.state)
    by_name = {f.name: {s.labels.get("rank"): s.value for s in f.samples} for f in families}
    waited = by_name["rankscope_rank_waited_on_ratio"]
    last = by_name["rankscope_rank_last_arrival_ratio"]
    assert set(waited) == set(last) == {"0", "1", "2", "3"}
    assert max(waited, key=waited.__getitem__) == "0"
    assert waited["0"] > 0.15
    assert last["0"] > 0.5
    assert sum(last.values()) == pytest.approx(1.0)


def test_a_pace_listing_more_steps_than_a_rank_samples_is_refused_whole() -> None:
    steps = [[n, 0.001, 0.001] for n in range(MAX_SAMPLED_STEPS + 1)]
    raw = json.dumps({"steps": 1, "workSeconds": 0.1, "waitSeconds": 0.1, "sampled": steps})
    with pytest.raises(WireError, match=r"\$\.sampled"):
        decode(raw.encode(), StepPace)
    with pytest.raises(WireError, match=r"\$\.sampled\[0\]"):
        decode(b'{"steps":1,"workSeconds":0,"waitSeconds":0,"sampled":[[-1,0,0]]}', StepPace)


def test_a_straggler_named_is_cleared_at_once_when_the_job_is_stopped_on_purpose() -> None:
    job = Lockstep(seed=7)
    job.slowdown[1] = 1.5
    assert job.run(20)[-1]
    for r, ref in enumerate(job.ranks):
        stopped = status(ref, job.seqs[r] + 1, RunnerStatusKind.SHUTDOWN, alive=False)
        job.state.apply_telemetry(stopped, stored_ns=int(job.now * 1e9))
    job.now += 1
    assert judged(job.state, job.now, job.incidents, Thresholds()) == {}
