"""A data-parallel job simulated on virtual time for the aggregator's rules: every rank
samples the same steps, and what each second applied is kept as an event log."""

from __future__ import annotations

import random
import time

from rankscope.services.aggregator.diagnosis import Incident, Thresholds
from rankscope.services.aggregator.store import EntryStore
from rankscope.services.aggregator.views import ClusterState
from rankscope.shared.wire import (
    Finding,
    MemorySampled,
    MlxMemorySnapshot,
    Phase,
    RunnerTelemetry,
    SampledStep,
    StepPace,
)
from tests.aggregator.builders import at, entries, judged, placed, rank

__all__ = ["GAP_S", "Lockstep"]

SAMPLED_A_SECOND = 8
TRANSFER_S = 0.0004
GAP_S = 0.001
"""What each rank does between two steps (its data, its logging)."""


class Lockstep:
    """A data-parallel job of `world` ranks on a busy machine, every rank sampling the
    same steps: rank r arrives at its collective after its work (`work` seconds times its
    slowdown, with noise, now and then a turn lost to a neighbour on its core), and every
    rank leaves once the last arrived."""

    def __init__(self, world: int = 4, work: float = 0.004, seed: int = 3) -> None:
        self.now = 1000.0
        self.state = ClusterState(store=EntryStore())
        self.placed = placed(world=world)
        self.state.apply_placement(self.placed, stored_ns=int(self.now * 1e9))
        self.ranks = [rank(r, world=world) for r in range(world)]
        self.work, self.slowdown = work, [1.0] * world
        self.noise = random.Random(seed)
        self.seqs = [0] * world
        self.step = 0
        self.incidents: dict[str, Incident] = {}
        self.seconds: list[tuple[float, list[tuple[RunnerTelemetry, int]]]] = []
        """Each second's time and the telemetry applied in it, as NATS stored it: the
        event log a replay reads."""
        self.lost = [0.0] * world
        """Per rank, the seconds of the job's steps its own slowdown cost (the truth the
        finding's share is held to), of `total`."""
        self.total = 0.0

    def _seq(self, r: int) -> int:
        self.seqs[r] += 1
        return self.seqs[r]

    def second(self) -> None:
        """A second of steps, each rank's sampled ones said in one pace sample."""
        self.now += 1.0
        self.seconds.append((self.now, []))
        said: list[list[SampledStep]] = [[] for _ in self.ranks]
        for _ in range(SAMPLED_A_SECOND):
            self.step += 1 + self.noise.randrange(16)
            base = [self.work * self.noise.uniform(0.85, 1.2) for _ in self.ranks]
            own = [b * (s - 1) for b, s in zip(base, self.slowdown, strict=True)]
            turns = [  # a neighbour on the core took a turn: as long as a step's work
                self.work * self.noise.uniform(0.2, 1.0) if self.noise.random() < 0.2 else 0.0
                for _ in self.ranks
            ]
            arrived = [b + o + t for b, o, t in zip(base, own, turns, strict=True)]
            leave = max(arrived) + TRANSFER_S
            for r, at_collective in enumerate(arrived):
                work = at_collective + 0.0005
                said[r].append(SampledStep(self.step, work, leave - at_collective, GAP_S))
            self.total += leave + 0.0005 + GAP_S
            for r, extra in enumerate(own):  # what its slowdown adds to the step
                self.lost[r] += extra
        for r, ref in enumerate(self.ranks):
            steps = said[r]
            pace = StepPace(
                steps=len(steps),
                workSeconds=sum(s.workSeconds for s in steps),
                waitSeconds=sum(s.waitSeconds for s in steps),
                sampled=steps,
            )
            snapshot = MlxMemorySnapshot(generatedAt=at(self.now - 1000), source="mlx.core")
            stored = int((self.now - self.noise.uniform(0, 0.3)) * 1e9)
            sample = MemorySampled(runner=ref, seq=self._seq(r), snapshot=snapshot, pace=pace)
            decoding = entries(ref, (self._seq(r), self.now - 1000, Phase.DECODE_STREAM, 2))
            for event in (sample, decoding):
                self.state.arrive(self.now, time.time())
                self.state.apply_telemetry(event, stored_ns=stored)
                self.seconds[-1][1].append((event, stored))

    def run(self, seconds: int) -> list[list[Finding]]:
        """`seconds` of steps, judged each second."""
        found = []
        for _ in range(seconds):
            self.second()
            self.incidents = judged(self.state, self.now, self.incidents, Thresholds())
            found.append([i.finding for i in self.incidents.values()])
        return found
