"""The judging core on virtual time: ticks in, effects out, no clock read. A stall opens
once its threshold has passed by the ticks' time alone, with one capture of evidence; the
evidence fed back joins the finding; an outage judges every instance and opens nothing new;
a round over many instances pauses between slices and says the same as one in one go;
heartbeats, probe rounds and their answers make a silent node unreachable."""

from __future__ import annotations

import time

from rankscope.services.aggregator.core import (
    JUDGE_SLICE,
    Answered,
    Capture,
    ClockDrift,
    Core,
    Effect,
    EvidenceArrived,
    Heartbeat,
    OutageOver,
    Pause,
    Probe,
    Publish,
    Resume,
    Tick,
    Wake,
)
from rankscope.services.aggregator.diagnosis import Thresholds
from rankscope.services.aggregator.silence import Ask
from rankscope.services.aggregator.store import EntryStore
from rankscope.services.aggregator.views import ClusterState
from rankscope.shared.timestamps import micros
from rankscope.shared.wire import FindingKind, Phase, ProcessState, RunnerEvidence
from tests.aggregator.builders import at, core_of, entries, placed, rank
from tests.ranktable.builders import node_info

LIMITS = Thresholds(working=10.0)


def _stuck(instances: list[str]) -> tuple[Core, list[float]]:
    """A core over `instances`, each with rank 0 held a step behind rank 1 from second 1
    (a virtual clock, by the list it returns)."""
    clock = [1000.0]
    state = ClusterState(store=EntryStore())
    state.arrive(clock[0], time.time())
    for instance in instances:
        state.apply_placement(placed(instance))
        state.apply_telemetry(entries(rank(0, instance), (0, 1, Phase.PREFILL_PIPELINE, 7)))
        state.apply_telemetry(entries(rank(1, instance), (0, 1, Phase.DECODE_BARRIER, 8)))
    return core_of(state, LIMITS, dict.fromkeys(instances, 990.0)), clock


def _tick(clock: list[float], seconds: float, outage: bool = False) -> Tick:
    clock[0] += seconds
    down = (FindingKind.NATS_UNREACHABLE, at(clock[0] - 1000), "no answer") if outage else None
    return Tick(at=clock[0], wall=at(clock[0] - 1000), outage=down)


def _round(core: Core, tick: Tick) -> tuple[list[Effect], int]:
    """Every effect of judging at `tick`, resumed after each pause, and how many pauses."""
    effects, pauses = core.feed(tick), 0
    while effects and isinstance(effects[-1], Pause):
        pauses += 1
        effects = effects[:-1] + core.feed(Resume())
    return effects, pauses


def test_a_stall_opens_by_the_ticks_time_alone_with_one_capture() -> None:
    core, clock = _stuck(["i"])
    assert _round(core, _tick(clock, 9)) == ([], 0)  # within the threshold
    effects, _ = _round(core, _tick(clock, 2))
    (published,) = [e.finding for e in effects if isinstance(e, Publish)]
    assert published.kind is FindingKind.RANK_DISAGREEMENT
    assert published.since == at(11)  # the tick's wall time, no clock of its own
    assert [e.finding for e in effects if isinstance(e, Capture)] == [published]
    effects, _ = _round(core, _tick(clock, 1))
    assert effects == []  # the same incident, nothing new to tell


def test_evidence_fed_back_joins_the_open_finding() -> None:
    core, clock = _stuck(["i"])
    effects, _ = _round(core, _tick(clock, 11))
    (opened,) = [e.finding for e in effects if isinstance(e, Capture)]
    version = core.state.version
    answer = RunnerEvidence(
        runnerId="i-r0", process=ProcessState.SLEEPING, stack="frame", capturedAt=at(11)
    )
    assert core.feed(EvidenceArrived(opened, ["i-r0"], [answer])) == []
    assert core.state.version > version  # answers built on the state are stale
    effects, _ = _round(core, _tick(clock, 1))
    (told,) = [e.finding for e in effects if isinstance(e, Publish)]
    held = next(e for e in told.evidence if e.runnerId == "i-r0")
    assert held.stack == "frame"


def test_an_outage_opens_only_itself_and_clears_with_it() -> None:
    core, clock = _stuck(["i"])
    effects, pauses = _round(core, _tick(clock, 11, outage=True))
    assert pauses == 0  # every instance judged at once: nothing else runs meanwhile
    assert [e.finding.kind for e in effects if isinstance(e, Publish)] == [
        FindingKind.NATS_UNREACHABLE
    ]
    effects, _ = _round(core, _tick(clock, 1))
    said = [(e.finding.kind, e.finding.open) for e in effects if isinstance(e, Publish)]
    assert said == [
        (FindingKind.NATS_UNREACHABLE, False),
        (FindingKind.RANK_DISAGREEMENT, True),
    ]


def test_a_round_over_many_instances_pauses_between_slices_and_says_the_same() -> None:
    names = [f"llm-{n}" for n in range(2 * JUDGE_SLICE + 1)]
    sliced, clock = _stuck(names)
    effects, pauses = _round(sliced, _tick(clock, 11))
    assert pauses == 2
    opened = {e.finding.instanceId for e in effects if isinstance(e, Publish)}
    assert opened == set(names)
    again, _ = _stuck(names[:1])
    alone, _ = _round(again, Tick(at=1011.0, wall=at(11)))
    assert [e for e in alone if isinstance(e, Publish)] == [
        e for e in effects if isinstance(e, Publish) and e.finding.instanceId == names[0]
    ]


def _beat(core: Core, node: str, at_s: float, ahead: float = 0.0) -> list[Effect]:
    """`node`'s heartbeat, stored by NATS at `at_s` after T0 and read then, its clock
    `ahead` seconds ahead of NATS's."""
    info = node_info(node, 8, lastHeartbeat=at(at_s + ahead))
    return core.feed(Heartbeat(node, info, micros(at(at_s)) * 1000, at=1000 + at_s))


def test_liveness_through_the_core_probes_the_placed_nodes_and_names_the_silent_one() -> None:
    core, _ = _stuck(["i"])
    assert _beat(core, "node-0", 0) == _beat(core, "node-1", 0) == []
    (drift,) = _beat(core, "node-1", 0.5, ahead=5.0)
    assert isinstance(drift, ClockDrift)
    assert drift.note.node_id == "node-1"
    assert not drift.note.agrees
    for moment in (1000.5, 1002.5):  # two full rounds, node-1 silent in both
        (probe,) = core.feed(Wake(moment))
        assert isinstance(probe, Probe)
        assert probe.ask == Ask(["node-0", "node-1"], full=True)
        assert core.feed(Wake(moment)) == []  # asked already: not due again
        core.feed(Answered(probe.ask, [{"i-r0"}, None], moment + 1, asked_ns=0))
    assert set(core.state.unreachable) == {"node-1"}
    assert "2 rounds in a row" in core.state.unreachable["node-1"].error
    assert core.wake == 1004.5  # the next full round
    core.feed(OutageOver(1004.0))  # NATS back: silence meanwhile said nothing
    (probe,) = core.feed(Wake(1004.5))
    assert isinstance(probe, Probe)
    core.feed(Answered(probe.ask, [{"i-r0"}, None], 1005.5, asked_ns=0))
    assert core.state.unreachable == {}  # one missed round since: not yet
