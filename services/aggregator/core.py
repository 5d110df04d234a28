"""The aggregator's judgement as a machine: events in, effects out.

A `Tick` carries the moment to judge at (the aggregator's monotonic clock, the wall clock,
and whether NATS or JetStream is out); judging it yields the findings to publish and the
evidence to ask for. Evidence arriving and incidents taken up from a previous aggregator
are events too. Liveness is: a node's `Heartbeat`, a `Wake` of the probe clock (yielding
the nodes to `Probe`), their `Answered`, NATS back after an outage (`OutageOver`). The
views it judges (`ClusterState`) are folded by ingest beside it.

Pure: no clock read, no I/O; `findings.py` and `liveness.py` turn its effects into NATS
requests, publications and logs, and their turns between slices of judging into `Resume`
events.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from rankscope.services.aggregator.diagnosis import Incident, Thresholds, diagnose
from rankscope.services.aggregator.floods import Floods
from rankscope.services.aggregator.incidents import Incidents
from rankscope.services.aggregator.silence import Answer, Ask, ClockNote, Silence
from rankscope.services.aggregator.views import ClusterState
from rankscope.shared.partitions import Partition
from rankscope.shared.wire import Finding, FindingKind, InstanceCreated, NodeInfo, RunnerEvidence

__all__ = [
    "JUDGE_SLICE",
    "SWEEP_S",
    "Answered",
    "Capture",
    "ClockDrift",
    "Core",
    "Effect",
    "Event",
    "EvidenceArrived",
    "Heartbeat",
    "Outage",
    "OutageOver",
    "Pause",
    "Probe",
    "Publish",
    "Resume",
    "TakeUp",
    "Tick",
    "Wake",
]

SWEEP_S = 1.0
"""How often every instance is judged (thresholds are crossed with time alone); in
between, the ones that changed."""
JUDGE_SLICE = 100
"""Instances judged before the core pauses for other work (about a millisecond of it)."""

Outage = tuple[FindingKind, str, str]
"""An outage of NATS or JetStream: its kind, since when, why."""


@dataclass(frozen=True, slots=True)
class Tick:
    """Judge the instances at this moment."""

    at: float
    """The aggregator's monotonic clock (seconds)."""
    wall: str
    """The same moment on the wall clock, a wire timestamp."""
    outage: Outage | None = None
    """NATS or JetStream out: what is held is stale, so nothing opens or clears."""


@dataclass(frozen=True, slots=True)
class Resume:
    """Go on judging the round a `Pause` left off."""


@dataclass(frozen=True, slots=True)
class EvidenceArrived:
    """An agent's (or a watcher's) answer for the ranks of `finding` it was asked about."""

    finding: Finding
    asked: list[str]
    answered: list[RunnerEvidence]


@dataclass(frozen=True, slots=True)
class TakeUp:
    """The incidents the last aggregator left open, as it published them last."""

    found: Mapping[str, Finding]
    at: float
    wall: str


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """A node's heartbeat read at `at` (monotonic), stored by NATS at `stored_ns` (ns since
    the epoch); `info` None: its entry expired or was deleted."""

    node_id: str
    info: NodeInfo | None
    stored_ns: int | None
    at: float


@dataclass(frozen=True, slots=True)
class Wake:
    """The probe clock at `at` (monotonic): ask what is due (`full`: a full round now)."""

    at: float
    full: bool = False


@dataclass(frozen=True, slots=True)
class Answered:
    """What the nodes of `ask` answered (in its order) by `at` (monotonic); the round was
    asked at `asked_ns` on the wall clock (ns since the epoch)."""

    ask: Ask
    answers: list[Answer]
    at: float
    asked_ns: int


@dataclass(frozen=True, slots=True)
class OutageOver:
    """NATS answers again at `at` (monotonic): silence meanwhile said nothing of anyone."""

    at: float


Event = Tick | Resume | EvidenceArrived | TakeUp | Heartbeat | Wake | Answered | OutageOver


@dataclass(frozen=True, slots=True)
class Pause:
    """The round is not over: feed `Resume` once other work has had a turn."""


@dataclass(frozen=True, slots=True)
class Publish:
    """A finding opened, changed or cleared, to publish (and alert, and log), in order."""

    finding: Finding


@dataclass(frozen=True, slots=True)
class Capture:
    """A finding just opened: ask the agents of its ranks for their stacks and memory."""

    finding: Finding


@dataclass(frozen=True, slots=True)
class Probe:
    """Ask the nodes of `ask` for the runners they supervise, under one deadline."""

    ask: Ask


@dataclass(frozen=True, slots=True)
class ClockDrift:
    """A node's clock crossed the tolerance from the NATS server's, either way: to log."""

    note: ClockNote


Effect = Pause | Publish | Capture | Probe | ClockDrift


@dataclass(slots=True)
class _Round:
    """A judgement under way: its moment, the instances left to judge, what it found."""

    tick: Tick
    left: list[InstanceCreated]
    found: dict[str, Incident] = field(default_factory=dict)


class Core:
    """The open incidents of the instances of `state`, judged when fed a `Tick`, and the
    liveness of their nodes.

    Args:
        state: the views judged (folded by ingest).
        thresholds: when a rank counts as stuck or slow.
        placed_at: when each instance was placed, on the monotonic clock.
        partition: the instances (and spare nodes) it judges.
        silence: the liveness machine of the nodes (the heartbeat TTL, the probe rounds).
        placed_elsewhere: the nodes of each instance of another partition (not probed).
    """

    def __init__(
        self,
        state: ClusterState,
        thresholds: Thresholds,
        *,
        placed_at: Mapping[str, float],
        partition: Partition,
        silence: Silence,
        placed_elsewhere: Mapping[str, set[str]],
    ) -> None:
        self.state, self.thresholds, self._placed_at = state, thresholds, placed_at
        self.partition, self.silence, self._placed_elsewhere = partition, silence, placed_elsewhere
        self.incidents = Incidents(settling=thresholds.slow.window)
        self.floods = Floods(partition=str(partition))
        self._swept = -math.inf
        """When every instance was last judged."""
        self._round: _Round | None = None

    @property
    def wake(self) -> float:
        """When the probe clock next has something to ask (monotonic)."""
        return self.silence.wake(self.state.unreachable)

    def feed(self, event: Event) -> list[Effect]:
        """What `event` changes, as effects to carry out in order."""
        if isinstance(event, Tick):
            self._round = self._begin(event)
            return self._judge()
        if isinstance(event, Resume):
            return self._judge() if self._round is not None else []
        if isinstance(event, EvidenceArrived):
            if self.incidents.captured(event.finding, event.asked, event.answered):
                self.state.version += 1  # the answers built on it are stale
            return []
        if isinstance(event, TakeUp):
            self.incidents.take_up(event.found, at=event.at, wall=event.wall)
            return []
        return self._live(event)

    def _live(self, event: Heartbeat | Wake | Answered | OutageOver) -> list[Effect]:
        """The liveness events: heartbeats, the probe clock, answers, NATS back."""
        state, silence = self.state, self.silence
        if isinstance(event, Heartbeat):
            state.set_node(event.node_id, event.info)
            note = silence.heard(event.node_id, event.info, event.stored_ns, event.at)
            return [] if note is None else [ClockDrift(note)]
        if isinstance(event, OutageOver):
            silence.outage_over(event.at)
            state.forgive(event.at, keep=self.incidents.culprits())
            return []
        elsewhere = set().union(*self._placed_elsewhere.values())
        if isinstance(event, Wake):
            owns, placed = self.partition.owns, state.placed_nodes
            ask: Ask | None
            if event.full:
                ask = silence.round(event.at, placed(), elsewhere=elsewhere, owns=owns)
            else:
                down = state.unreachable
                ask = silence.due(
                    event.at, placed=placed, elsewhere=elsewhere, owns=owns, unreachable=down
                )
            return [] if ask is None else [Probe(ask)]
        for node_id, listed in zip(event.ask.nodes, event.answers, strict=True):
            if isinstance(listed, set):
                state.note_listed(listed, state.runners.on_node(node_id))
        unreachable = silence.answered(
            event.ask, event.answers, event.at, nodes=state.nodes, unreachable=state.unreachable
        )
        state.set_unreachable(unreachable, event.asked_ns)
        return []

    def _begin(self, tick: Tick) -> _Round:
        """The instances a judgement at `tick` looks at: every one in an outage and once
        per `SWEEP_S`, else those touched since (the others keep what they had)."""
        instances, touched = self.state.instances, self.state.take_touched()
        if tick.outage is not None or tick.at >= self._swept + SWEEP_S:
            if tick.outage is None:
                self._swept = tick.at
            return _Round(tick, list(instances.values()))
        kept = {i: held for i, held in self.incidents.open.items() if i in instances}
        return _Round(tick, [instances[i] for i in touched if i in instances], kept)

    def _judge(self) -> list[Effect]:
        """Judge the next slice of the round (all of it in an outage); once none is left,
        settle it."""
        assert self._round is not None
        tick, round_ = self._round.tick, self._round
        size = len(round_.left) if tick.outage else JUDGE_SLICE
        slice_, round_.left = round_.left[:size], round_.left[size:]
        for instance in slice_:
            round_.found.pop(instance.instanceId, None)
        round_.found |= diagnose(
            self.state,
            now=tick.at,
            wall=tick.wall,
            incidents=self.incidents.open,
            placed_at=lambda i: self._placed_at.get(i, tick.at),
            thresholds=self.thresholds,
            outage=tick.outage,
            instances=slice_,
            unsettled=self.incidents.unsettled,
        )
        if round_.left:
            return [Pause()]
        self._round = None
        if tick.outage is None:
            round_.found |= self.floods.judge(
                self.state.store.trimmed, self.state, self.incidents.open, now=tick.at,
                wall=tick.wall,
            )  # fmt: skip
        settled = self.incidents.settle(round_.found, at=tick.at, wall=tick.wall)
        return [
            *(Publish(f) for f in [*settled.cleared, *settled.changed]),
            *(Capture(f) for f in settled.capture),
        ]
