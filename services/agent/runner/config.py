"""What a runner process is told when the agent spawns it (pickled across the spawn)."""

from __future__ import annotations

from dataclasses import dataclass

from rankscope.shared.settings import default
from rankscope.shared.wire import RunnerAssignment, RunnerRef

__all__ = ["RunnerConfig", "Timeouts"]


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Deadlines of the runner's blocking steps, in seconds."""

    connect: float = default("connect_timeout")
    warmup: float = 300.0
    collective: float = default("collective_timeout")


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    """One rank: who it is, where its peers listen, which model and layers it holds."""

    runner: RunnerRef
    assignment: RunnerAssignment
    assignments: tuple[RunnerAssignment, ...]
    model_path: str
    timeouts: Timeouts = Timeouts()
    memory_interval: float = 1.0
    idle_tick: float = 1.0
    """Seconds an idle rank waits for work before it meets its peers anyway (to learn of a
    task that never reached it, or of a peer gone); work wakes it at once."""
    stack_path: str | None = None
    """Where the runner writes its threads' stacks on SIGUSR1 (appending: the agent empties
    the file before it asks)."""

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank holds the last layers and so speaks for the instance's output."""
        return self.assignment.deviceRank == self.assignment.worldSize - 1
