"""The aggregator's views, each named once with the request it takes and the answer it
gives: the gateway asks, and the aggregator answers, to these descriptors (on
`rankscope.query.<name>`), never to a bare string."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from rankscope.shared.wire import (
    AggregatorHealth,
    ClusterTimeline,
    Diagnosis,
    DiagnosisQuery,
    InstanceState,
    PlacementQuery,
    PlacementRunnerDiagnostics,
    RunnerHistory,
    TimelineQuery,
)
from rankscope.shared.wire.base import CamelStruct

__all__ = [
    "DIAGNOSIS",
    "HEALTH",
    "HISTORY",
    "INSTANCES",
    "PLACEMENT",
    "TIMELINE",
    "VIEWS",
    "InstancesQuery",
    "NoQuery",
    "View",
]


class NoQuery(CamelStruct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The request of a view that takes none."""


class InstancesQuery(CamelStruct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Asked of the partition that holds `instanceId` alone (of every one when unset)."""

    instanceId: str | None = None


Request = TypeVar("Request", bound=CamelStruct)


@dataclass(frozen=True, slots=True)
class View(Generic[Request]):
    """One view: its name on the bus, its request, and the type its answer decodes as."""

    name: str
    request: type[Request]
    answer: Any
    """`ClusterTimeline`, `list[RunnerHistory]`, ...: what `decode` reads the answer as."""


TIMELINE = View("timeline", TimelineQuery, ClusterTimeline)
PLACEMENT = View("placement", PlacementQuery, list[PlacementRunnerDiagnostics])
"""Every placed runner's; with `runnerId`, that runner's alone (one item, not a list)."""
DIAGNOSIS = View("diagnosis", DiagnosisQuery, Diagnosis)
INSTANCES = View("instances", InstancesQuery, list[InstanceState])
HISTORY = View("history", NoQuery, list[RunnerHistory])
HEALTH = View("health", NoQuery, AggregatorHealth)
VIEWS = (TIMELINE, PLACEMENT, DIAGNOSIS, INSTANCES, HISTORY, HEALTH)
