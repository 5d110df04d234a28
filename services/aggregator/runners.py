"""What the aggregator knows of each runner and each task, as the reducers of `views`
keep it."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from rankscope.services.aggregator.pace import PaceHistory
from rankscope.services.aggregator.seqs import SeqTracker
from rankscope.shared.synopsis import Synopsis
from rankscope.shared.wire import (
    FlightRecord,
    RunnerRef,
    RunnerStatusChanged,
    RunnerStatusKind,
    TaskCreated,
    TaskStatus,
)

__all__ = ["UNLISTED", "RunnerView", "Runners", "TaskView"]

UNLISTED = 2
"""Probes in a row a runner's node answers without it before it counts as not alive (one
is not enough: an agent lists a runner only once it has started it)."""
_READY = frozenset({RunnerStatusKind.READY, RunnerStatusKind.RUNNING})


@dataclass(slots=True)
class RunnerView:
    """Everything known about one runner."""

    ref: RunnerRef
    seqs: SeqTracker = field(default_factory=SeqTracker)
    status: RunnerStatusChanged | None = None
    synopsis: Synopsis = field(default_factory=Synopsis)
    """Where its entries say it is (phase, task, step, memory)."""
    memory_seq: int = -1
    """The seq of the memory sample its synopsis shows (samples may overtake each other)."""
    progressed: float | None = None
    heard: float | None = None
    acknowledged: int | None = None
    """The newest seq its agent had acknowledged by JetStream, as of the last probe."""
    waiting_in: str | None = None
    """The collective its last entry says it is waiting in (its site)."""
    gave_up: FlightRecord | None = None
    """The last time it gave up on a peer since it was last ready (its collective timed
    out, or the ring lost the peer): a victim's breadcrumb, kept across its restarts."""
    failure: RunnerStatusChanged | None = None
    """Its last failure since it was last ready (how its process ended)."""
    unlisted: int = 0
    """Probes in a row its node answered without listing it: no agent supervises it."""
    stored_ns: int | None = None
    """When NATS stored its last message (ns since the epoch), if known."""
    placed_ns: int | None = None
    """When NATS stored the placement that created it (ns since the epoch), if known:
    nothing of it can have been stored before."""
    pace: PaceHistory | None = None
    """Its work and wait per step, once a sample carried them."""

    @property
    def alive(self) -> bool:
        """Whether the supervisor last reported the process alive (unknown counts as yes),
        and its node's agent still lists it (one restarted without it did not keep it)."""
        return (self.status is None or self.status.processAlive) and self.unlisted < UNLISTED

    @property
    def ready(self) -> bool:
        """Whether the runner last reported itself ready or serving."""
        return self.status is not None and self.alive and self.status.statusKind in _READY


class Runners(dict[str, RunnerView]):
    """Every runner by id, also found by its instance and by its node (a query for one
    instance looks at its ranks, not at every runner). Runners join by `add` only; a
    runner's ref never changes."""

    def __init__(self) -> None:
        super().__init__()
        self._of_instance: dict[str, list[RunnerView]] = {}
        self._on_node: dict[str, list[RunnerView]] = {}

    def add(self, view: RunnerView) -> RunnerView:
        """Hold `view`, whose runner id is new here."""
        self[view.ref.runnerId] = view
        self._of_instance.setdefault(view.ref.instanceId, []).append(view)
        self._on_node.setdefault(view.ref.nodeId, []).append(view)
        return view

    def of_instance(self, instance_id: str) -> Collection[RunnerView]:
        """The runners of one instance."""
        return self._of_instance.get(instance_id, ())

    def on_node(self, node_id: str) -> Collection[RunnerView]:
        """The runners on one node."""
        return self._on_node.get(node_id, ())


@dataclass(slots=True)
class TaskView:
    """A task of an instance and each rank's status of it."""

    created: TaskCreated
    statuses: dict[str, TaskStatus] = field(default_factory=dict)
