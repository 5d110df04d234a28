"""A rank working slower than it usually does while its peers do not is named `slow_rank`;
its peers, waiting longer on it, never are; a healthy job, a machine-wide slowdown and
ranks that differ by design name nobody."""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

import msgspec
import pytest

from rankscope.services.aggregator.answers import history
from rankscope.services.aggregator.diagnosis import Incident, Thresholds
from rankscope.services.aggregator.pace import PaceHistory, PaceLimits, judge_pace
from rankscope.services.aggregator.snapshot import capture, restore
from rankscope.services.aggregator.store import EntryStore
from rankscope.services.aggregator.views import ClusterState
from rankscope.shared.wire import (
    Finding,
    FindingKind,
    MemorySampled,
    MlxMemorySnapshot,
    Phase,
    StepPace,
    WireError,
    decode,
    encode,
)
from tests.aggregator.builders import at, entries, judged, metric_families, placed, rank

STEPS_A_SECOND = 40
LAYER_S = 0.0001
"""A layer's work a step: ranks differ by design in the layers they hold."""
FIXTURES = Path(__file__).parent.parent / "fixtures" / "pace"


def _layers(usual: list[float]) -> list[int]:
    return [round(work / LAYER_S) for work in usual]


class Job:
    """A placed instance whose ranks decode steadily, each sampling its pace every second:
    rank r's step takes `usual[r]` seconds of work times its slowdown, with noise."""

    def __init__(
        self,
        usual: list[float],
        seed: int = 7,
        wobbly: frozenset[int] = frozenset(),
        sampled: int = STEPS_A_SECOND,
        preempted: float = 0.0,
    ) -> None:
        self.now = 1000.0
        self.state = ClusterState(store=EntryStore())
        self.state.apply_placement(placed(split=_layers(usual)), stored_ns=self._ns())
        self.usual, self.slowdown = usual, [1.0] * len(usual)
        self.ranks = [rank(r, world=len(usual)) for r in range(len(usual))]
        self.seqs = [0] * len(usual)
        self.noise = random.Random(seed)
        self.wobbly = wobbly
        """Ranks sharing their core: their work strays for seconds at a time, up to 1.5x (a
        stage 1.6x its peers for a whole window is named whatever it strays)."""
        self.strays = [1.0] * len(usual)
        self.sampled = sampled
        """Steps each rank samples a second."""
        self.preempted = preempted
        """The chance that one of a second's sampled steps of a rank is preempted (a busy
        core): it works ten times as long."""
        self.thresholds = Thresholds()
        self.step_every = 1
        """Seconds between steps: past 1, each rank samples one step, then none until the
        next."""
        self.incidents: dict[str, Incident] = {}
        self.unsettled: dict[str, float] = {}
        """As the aggregator keeps it: when an incident other than slow_rank was open."""
        for r, ref in enumerate(self.ranks):
            self.state.arrive(self.now, time.time())
            self.state.apply_telemetry(
                entries(ref, (self._seq(r), 0, Phase.DECODE_STREAM, 1)), stored_ns=self._ns()
            )

    def _ns(self) -> int:
        return int(self.now * 1e9)

    def _seq(self, r: int) -> int:
        self.seqs[r] += 1
        return self.seqs[r]

    def second(self) -> None:
        """A second of decoding: every rank samples; a rank waits for the slowest peer."""
        self.now += 1.0
        for r in self.wobbly:
            if int(self.now) % 5 == 0:
                self.strays[r] = self.noise.uniform(0.7, 1.5)
        works = [
            u * s * w * self.noise.uniform(0.85, 1.2)
            for u, s, w in zip(self.usual, self.slowdown, self.strays, strict=False)
        ]
        step = max(works)
        steps = self.sampled if self.step_every == 1 else int(self.now % self.step_every == 0)
        for r, work in enumerate(works):
            preempted = self.preempted and steps and self.noise.random() < self.preempted
            late = 9 * work if preempted else 0.0
            pace = StepPace(
                steps=steps,
                workSeconds=work * steps + late,
                waitSeconds=(step - work + 0.0002) * steps,
            )
            self._sample(r, pace, self.now)

    def _sample(self, r: int, pace: StepPace, stored: float) -> None:
        """Rank `r`'s memory sample carrying `pace` and a decode entry, as NATS stored them
        at `stored` (seconds)."""
        snapshot = MlxMemorySnapshot(generatedAt=at(self.now - 1000), source="mlx.core")
        sample = MemorySampled(runner=self.ranks[r], seq=self._seq(r), snapshot=snapshot, pace=pace)
        self.state.arrive(self.now, time.time())
        self.state.apply_telemetry(sample, stored_ns=int(stored * 1e9))
        self.state.arrive(self.now, time.time())
        self.state.apply_telemetry(
            entries(self.ranks[r], (self._seq(r), self.now - 1000, Phase.DECODE_STREAM, 2)),
            stored_ns=int(stored * 1e9),
        )

    def replay(self, samples: list[list[float]]) -> list[list[Finding]]:
        """Recorded samples, each [seconds after the first, rank, steps, work and wait
        seconds], applied as NATS stored them; judged each second."""
        start, found, left = self.now, [], list(samples)
        while left:
            self.now += 1.0
            while left and start + left[0][0] <= self.now:
                when, r, steps, work, wait = left.pop(0)
                pace = StepPace(steps=int(steps), workSeconds=work, waitSeconds=wait)
                self._sample(int(r), pace, start + when)
            found.append(self.judge())
        return found

    def freeze(self, frozen: int, seconds: int) -> None:
        """Rank `frozen` stops altogether for `seconds`: only its peers are heard, taking no
        step (they wait for it)."""
        for _ in range(seconds):
            self.now += 1.0
            for r, ref in enumerate(self.ranks):
                if r == frozen:
                    continue
                self.state.arrive(self.now, time.time())
                self.state.apply_telemetry(
                    entries(ref, (self._seq(r), self.now - 1000, Phase.DECODE_STREAM, 3)),
                    stored_ns=self._ns(),
                )
                snapshot = MlxMemorySnapshot(generatedAt=at(self.now - 1000), source="mlx.core")
                self.state.arrive(self.now, time.time())
                self.state.apply_telemetry(
                    MemorySampled(runner=ref, seq=self._seq(r), snapshot=snapshot),
                    stored_ns=self._ns(),
                )

    def judge(self) -> list[Finding]:
        self.incidents = judged(
            self.state, self.now, self.incidents, self.thresholds, unsettled=self.unsettled
        )
        for key, incident in self.incidents.items():
            if incident.finding.kind is not FindingKind.SLOW_RANK:
                self.unsettled[key] = self.now
        return [i.finding for i in self.incidents.values()]

    def run(self, seconds: int) -> list[list[Finding]]:
        """`seconds` of decoding, judged each second."""
        found = []
        for _ in range(seconds):
            self.second()
            found.append(self.judge())
        return found


def _first(found: list[list[Finding]]) -> int:
    return next(i for i, findings in enumerate(found) if findings) + 1


@pytest.mark.parametrize(("factor", "within"), [(2.0, 15), (1.3, 30)])
def test_a_slowed_rank_is_named_within_its_bound_its_peers_never(
    factor: float, within: int
) -> None:
    job = Job([0.001, 0.0012, 0.001, 0.0011])
    assert not any(job.run(120))
    job.slowdown[2] = factor
    slowed = job.run(90)
    assert _first(slowed) <= within
    named = [f for findings in slowed for f in findings]
    assert {(f.kind, tuple(f.culpritRanks), tuple(f.waitingRanks)) for f in named} == {
        (FindingKind.SLOW_RANK, (2,), (0, 1, 3))
    }
    assert len({f.incidentId for f in named}) == 1  # one incident while it lasts
    shown = [next(e.pace for e in f.evidence if e.deviceRank == 2) for f in named]
    against = [p.workVsPeers or p.ratio or 0.0 for p in shown if p is not None]
    assert min(against) >= 1 + (factor - 1) / 2  # per layer against its peers', or its usual
    finding = named[-1]
    assert re.search(  # out of line with its peers per layer (2x), or with its usual (1.3x)
        r"rank 2 \(node-2\) (is the straggler: its work per layer is [\d.]+x its peers' "
        r"median, the most of any stage in \d+% of the span; the pipeline loses \d+% of its "
        r"work a step to it|works [\d.]+x slower than usual: [\d.]+ ms a step)",
        finding.summary,
    ), finding.summary
    assert "rank 0 (node-0) waits" in finding.summary
    culprit = next(e for e in finding.evidence if e.deviceRank == 2)
    assert culprit.pace is not None
    assert culprit.pace.ratio is not None
    assert culprit.pace.ratio == pytest.approx(factor, rel=0.15)
    victim = next(e for e in finding.evidence if e.deviceRank == 0)
    assert victim.pace is not None
    assert victim.pace.waitMs > culprit.pace.waitMs
    job.slowdown[2] = 1.0
    after = job.run(60)
    assert not after[-1]
    assert _first([[] if f else ["back"] for f in after]) <= 60  # type: ignore[list-item]


def test_a_rank_back_in_line_is_cleared_only_after_the_hold_and_a_relapse_is_one_incident() -> None:
    def job(hold: float) -> Job:
        made = Job([0.001, 0.0012, 0.001])
        made.thresholds = Thresholds(slow=PaceLimits(hold=hold))
        made.run(120)
        made.slowdown[1] = 2.0
        assert any(made.run(30)[-1])
        made.slowdown[1] = 1.0
        return made

    unheld, held = job(0.0), job(10.0)
    named = _first([[] if found else ["cleared"] for found in unheld.run(60)]) - 1  # type: ignore[list-item]
    assert all(held.run(named + 9))  # the same pace: held until 10 s after it was last slow
    assert held.run(1) == [[]]
    relapsing = job(10.0)
    back = relapsing.run(named + 5)
    relapsing.slowdown[1] = 2.0
    incidents = {f.incidentId for found in back + relapsing.run(30) for f in found}
    assert len(incidents) == 1


def test_the_wait_a_much_slower_rank_leaks_into_its_peers_work_names_only_it() -> None:
    job = Job([0.001, 0.0012, 0.001, 0.0011])
    job.run(120)
    job.slowdown[2], job.slowdown[3] = 2.0, 1.25
    named = {tuple(f.culpritRanks) for found in job.run(60) for f in found}
    assert named == {(2,)}


def test_a_healthy_job_names_nobody_for_half_an_hour() -> None:
    job = Job([0.001, 0.003], seed=11)  # ranks differ by design: layers, the head
    assert not any(job.run(1800))


def test_a_rank_whose_work_strays_by_nature_is_named_only_beyond_its_own_spread() -> None:
    job = Job([0.001, 0.001, 0.001, 0.001], seed=3, wobbly=frozenset({1, 3}))
    learning = job.run(120)  # its spread unknown yet: a stretch out of line may name it
    assert {tuple(f.culpritRanks) for fs in learning for f in fs} <= {(1,), (3,)}
    assert not any(job.run(780)[30:])
    job.slowdown[1] = 2.0
    named = {tuple(f.culpritRanks) for found in job.run(30) for f in found}
    assert named == {(1,)}


def test_a_step_preempted_now_and_then_names_nobody_a_slowdown_still_named() -> None:
    """Three sampled steps a second, and one second's in fifty with a step ten times as
    long (a busy core preempted it): a mean over 8 s of them doubles now and then."""
    job = Job([0.005, 0.005, 0.005, 0.005], seed=5, sampled=3, preempted=0.02)
    assert not any(job.run(1800))
    job.slowdown[2] = 2.0
    slowed = job.run(30)
    assert _first(slowed) <= 15
    assert {tuple(f.culpritRanks) for found in slowed for f in found} == {(2,)}


def test_a_rank_back_in_line_whose_pace_wobbles_after_is_cleared() -> None:
    """Recorded: a 4-rank data-parallel job two ranks to a core, rank 2 given three times
    its work from about 100 s to 116.5 s. After it, its work per step over 8 s wobbled
    1.1-1.5x its usual while its peers' stayed nearer theirs; over 25 s it was back."""
    recorded = json.loads((FIXTURES / "data_parallel_aftermath.json").read_text())
    job = Job([0.005] * 4)
    found = job.replay(recorded["samples"])
    named = [f for findings in found for f in findings]
    assert {(f.kind, tuple(f.culpritRanks)) for f in named} == {(FindingKind.SLOW_RANK, (2,))}
    assert len({f.incidentId for f in named}) == 1
    assert any(found[110])  # named while slowed
    assert not any(findings for findings in found[116 + 40 :])  # cleared within 40 s after


def test_a_rank_named_slow_stays_named_while_steps_are_too_sparse_to_judge() -> None:
    job = Job([0.001, 0.001, 0.001])
    job.run(120)
    job.slowdown[1] = 2.0
    (finding,) = job.run(15)[-1]
    job.step_every = 10  # a step every 10 s: too few in a span to judge by
    sparse = job.run(150)  # past `reach`: no span holds enough steps
    assert {f.incidentId for found in sparse for f in found} == {finding.incidentId}
    assert all(sparse)


def test_a_machine_wide_slowdown_names_nobody() -> None:
    job = Job([0.001, 0.001, 0.001])
    job.run(120)
    job.slowdown = [1.6, 1.6, 1.6]
    assert not any(job.run(90))


@pytest.mark.parametrize("factor", [1.3, 2.0])
def test_a_stage_slow_from_its_first_step_is_named_by_its_work_per_layer(factor: float) -> None:
    job = Job([0.001, 0.002, 0.0015])  # stages of 10, 20 and 15 layers
    job.slowdown[1] = factor
    found = job.run(60)
    assert _first(found) <= 15  # no usual to learn: its peers' pace per layer is the line
    assert {(f.kind, tuple(f.culpritRanks)) for fs in found for f in fs} == {
        (FindingKind.SLOW_RANK, (1,))
    }
    evidence = next(e.pace for e in found[-1][0].evidence if e.deviceRank == 1)
    assert evidence is not None
    assert evidence.workVsPeers == pytest.approx(factor, rel=0.1)
    assert evidence.ratio is None  # its own history has no usual yet: nothing to corroborate


def test_a_stage_slowed_less_than_stages_stray_apart_is_named_against_its_usual() -> None:
    job = Job([0.001, 0.001])
    job.run(120)
    job.slowdown[1] = 1.25
    found = [f for fs in job.run(60) for f in fs]
    assert {(f.kind, tuple(f.culpritRanks)) for f in found} == {(FindingKind.SLOW_RANK, (1,))}
    assert re.match(
        r"rank 1 \(node-1\) works 1\.\dx slower than usual: .* \(its work per layer: 1\.\dx its "
        r"peers'\)",
        found[0].summary,
    )


def test_a_stage_off_its_usual_but_in_line_with_its_peers_per_layer_is_not_named() -> None:
    """Recorded: the demo's two stages under back-to-back chats, healthy, its first 200 s.
    Two minutes in, just after its usual was learnt, stage 1's own work read 1.2-1.3x its
    usual for half a minute (stage 0's 1.1-1.2x: the machine's load) while per layer the
    stages stayed within 1.1x of each other: its own usual alone names it."""
    recorded = json.loads((FIXTURES / "pipeline_healthy_under_load.json").read_text())
    job = Job([0.001, 0.001])
    assert not any(job.replay(recorded["samples"]))
    alone = Job([0.001, 0.001])
    alone.replay(recorded["samples"])
    histories = [alone.state.runners[r.runnerId].pace for r in alone.ranks]
    own = [judge_pace(histories, 1000 + t, PaceLimits()) for t in range(130, 150)]
    assert [1] in [verdict.slow for verdict in own if verdict is not None]


def test_a_frozen_rank_is_stalled_not_slow() -> None:
    job = Job([0.001, 0.001])
    job.run(120)
    job.slowdown[1] = 3.0
    job.run(20)
    job.freeze(1, 8)
    (finding,) = job.judge()
    assert (finding.kind, finding.culpritRanks) == (FindingKind.STALLED_RANK, [1])


@pytest.mark.parametrize("seed", range(5))
def test_a_rank_that_stops_is_not_named_slow_while_its_peers_wait(seed: int) -> None:
    """Its last steps were slower (it was being stopped); the span judged, losing its
    oldest samples while nobody steps, would show them ever larger."""
    job = Job([0.001, 0.001], seed=seed)
    job.run(120)
    job.slowdown[1] = 1.7
    assert not any(job.run(4))
    for _ in range(4):
        job.freeze(1, 1)
        assert job.judge() == []


def test_the_uneven_steps_after_a_stall_are_not_slowness_for_a_window() -> None:
    job = Job([0.001, 0.001])
    job.run(120)
    job.freeze(1, 8)
    assert [f.kind for f in job.judge()] == [FindingKind.STALLED_RANK]
    job.slowdown[1] = 2.0  # going again, unevenly at first (or truly slower: seen later)
    settling = job.run(int(Thresholds().slow.window) - 1)
    assert not any(settling)
    later = job.run(15)
    assert {(f.kind, tuple(f.culpritRanks)) for found in later for f in found} == {
        (FindingKind.SLOW_RANK, (1,))
    }


def test_a_restart_from_a_snapshot_keeps_the_pace_and_the_finding() -> None:
    job = Job([0.001, 0.001])
    job.run(120)
    job.slowdown[0] = 2.0
    (named,) = job.run(30)[-1]
    image = msgspec.json.decode(
        msgspec.json.encode(capture(job.state, {})), type=type(capture(job.state, {}))
    )
    fresh = ClusterState(store=EntryStore())
    restore(fresh, image, moment=job.now)
    job.state = fresh
    job.incidents = {}  # the incident history is the diagnosis stream's, not the snapshot's
    (again,) = job.run(1)[-1]
    assert (again.kind, again.culpritRanks) == (FindingKind.SLOW_RANK, named.culpritRanks)


def test_samples_arriving_out_of_order_are_judged_in_time_order() -> None:
    history = PaceHistory()
    for second in (5, 3, 4, 1, 2):
        history.add(1000.0 + second, StepPace(steps=10, workSeconds=0.01 * second, waitSeconds=0))
    assert [s[0] for s in history.samples] == [1001.0, 1002.0, 1003.0, 1004.0, 1005.0]
    assert judge_pace([history], 1005.0, PaceLimits()) is None  # one rank: no peers


def test_a_pace_that_cannot_be_is_refused_at_the_door() -> None:
    snapshot = MlxMemorySnapshot(generatedAt=at(0), source="mlx.core")
    good = MemorySampled(
        runner=rank(0),
        seq=1,
        snapshot=snapshot,
        pace=StepPace(steps=3, workSeconds=0.01, waitSeconds=0.0),
    )
    raw = encode(good).replace(b'"steps":3', b'"steps":-3')
    with pytest.raises(WireError, match="steps"):
        decode(raw, MemorySampled)


def test_prometheus_has_each_ranks_work_and_wait_histograms() -> None:
    job = Job([0.0015, 0.004])
    job.run(5)
    families = metric_families(job.state)
    work = next(f for f in families if f.name == "rankscope_step_work_seconds")
    counts = {
        (s.labels["rank"], s.labels["le"]): s.value
        for s in work.samples
        if s.name.endswith("_bucket")
    }
    assert counts[("0", "0.001")] == 0
    assert counts[("0", "0.0025")] == 5 * STEPS_A_SECOND
    assert counts[("1", "0.0025")] == 0
    assert counts[("1", "0.005")] == 5 * STEPS_A_SECOND
    assert counts[("1", "+Inf")] == 5 * STEPS_A_SECOND


def test_prometheus_has_what_a_pipeline_loses_to_each_stage() -> None:
    job = Job([0.001, 0.002])
    job.slowdown[0] = 1.6
    job.run(10)
    families = metric_families(job.state)
    by_name = {f.name: {s.labels.get("rank"): s.value for s in f.samples} for f in families}
    waited = by_name["rankscope_rank_waited_on_ratio"]
    assert waited["1"] == 0.0
    assert waited["0"] == pytest.approx(0.6 / 3.6, abs=0.05)  # beyond its share of the line
    assert by_name["rankscope_rank_last_arrival_ratio"]["0"] > 0.8
    told = {h.deviceRank: h for h in history(job.state, Thresholds())}
    assert (told[0].layers, told[1].layers) == (10, 20)  # what the web page words it by
    assert told[0].waitedOn == pytest.approx(waited["0"])
