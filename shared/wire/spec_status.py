"""What the rank-table service observed of one Runner spec (bucket `rankscope_runner_status`).

Specs are desired state, written by operators; this is observed state, written only by
the rank-table service, so neither writer ever overwrites the other.
"""

from __future__ import annotations

from rankscope.shared.wire.base import SnakeStruct
from rankscope.shared.wire.runner_spec import RunnerMetrics

__all__ = ["RunnerSpecStatus"]


class RunnerSpecStatus(SnakeStruct, kw_only=True, frozen=True):
    """Whether a spec is accepted, why not, its instances and its pods' metrics."""

    runner_id: str
    revision: int
    accepted: bool
    reason: str | None = None
    instances: list[str] = []
    runner_metrics: RunnerMetrics
    updated_at: str
