"""The Runner specs the rank-table service holds, one record each: the revision placement
works from, a newer one waiting for its model's shape (asked of the nodes), or why it
was refused; and each spec's status as it is published."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import msgspec
from nats.js.kv import KeyValue

from rankscope.services.ranktable.models import ModelShapes
from rankscope.shared.model_shape import Unsupported
from rankscope.shared.specs import PlacementSpec, SpecError, validate
from rankscope.shared.subjects import untoken
from rankscope.shared.wire import Runner, RunnerMetrics, RunnerSpecStatus, WireError, decode

__all__ = ["SHAPE_RETRY_S", "Catalog", "SpecRecord"]

log = logging.getLogger(__name__)

SHAPE_RETRY_S = 5.0
"""Seconds between asking the nodes again for a model's shape none could tell."""
WAITING = "waiting for its model's shape"


@dataclass(slots=True)
class SpecRecord:
    """What the service holds of one Runner spec."""

    placed: PlacementSpec | None = None
    """The revision placement works from."""
    waiting: PlacementSpec | None = None
    """A newer revision whose model's shape no node has told yet (`placed` runs on)."""
    why_waiting: str = WAITING
    asked: float = -math.inf
    """When the nodes were last asked for `waiting`'s shape."""
    refused: tuple[int, str] | None = None
    """The revision refused and why."""


class Catalog:
    """Specs by id.

    Args:
        max_replicas: the most instances one spec may ask for.
        shapes: where the shapes of models given by path are asked (the nodes); without
            it, such specs wait.
        clock: monotonic seconds.
    """

    def __init__(
        self, *, max_replicas: int, shapes: ModelShapes | None, clock: Callable[[], float]
    ) -> None:
        self._max_replicas = max_replicas
        self._shapes = shapes
        self._clock = clock
        self.records: dict[str, SpecRecord] = {}

    def placeable(self) -> list[PlacementSpec]:
        """The revisions placement works from."""
        return [r.placed for r in self.records.values() if r.placed is not None]

    def on_spec(self, entry: KeyValue.Entry) -> None:
        """Take in a spec written, changed or deleted."""
        spec_id = untoken(entry.key)
        if entry.operation is not None:  # deleted or purged
            self.records.pop(spec_id, None)
            return
        record = self.records.setdefault(spec_id, SpecRecord())
        record.waiting, record.why_waiting, record.asked, record.refused = (
            None, WAITING, -math.inf, None,
        )  # fmt: skip
        revision = entry.revision or 0
        try:
            runner = decode(entry.value or b"", Runner)
            if runner.id and runner.id != spec_id:
                raise SpecError(f"id {runner.id!r} does not match its key {spec_id!r}")
            spec = validate(
                msgspec.structs.replace(runner, id=spec_id), revision, self._max_replicas
            )
            known = self._shapes.known(spec.model_path or "") if self._shapes else None
            if spec.model is None and known is not None:
                spec = spec.shaped(known)
        except (WireError, SpecError) as exc:
            self._refuse(spec_id, record, revision, str(exc))
            record.placed = None
            return
        if spec.model is None:
            record.waiting = spec
        else:
            record.placed = spec

    @staticmethod
    def _refuse(spec_id: str, record: SpecRecord, revision: int, why: str) -> None:
        record.refused = (revision, f"rejected: {why}")
        log.warning("Runner spec rejected: %s", why, extra={"runnerId": spec_id})

    async def shape_waiting(self, nodes: list[str]) -> bool:
        """Ask the live `nodes` for the shapes of the waiting revisions' models, each at
        most every `SHAPE_RETRY_S`; a revision whose shape is told is placed from then on.
        Whether some still wait."""
        moment = self._clock()
        due = {
            spec_id: record.waiting
            for spec_id, record in self.records.items()
            if record.waiting is not None and record.asked + SHAPE_RETRY_S <= moment
        }
        asked = [
            self._shapes.ask(spec.model_path or "", nodes) if self._shapes else _no_shapes()
            for spec in due.values()
        ]
        for (spec_id, spec), found in zip(due.items(), await asyncio.gather(*asked), strict=True):
            record = self.records.get(spec_id)
            if record is None or record.waiting is not spec:
                continue  # changed while the nodes were asked
            record.asked = moment
            if isinstance(found, str):
                record.why_waiting = (
                    f"waiting for its model's shape: no node could read metadata.modelPath "
                    f"{spec.model_path!r} ({found})"
                )
                continue
            record.waiting = None
            if isinstance(found, Unsupported):
                self._refuse(spec_id, record, spec.revision, found.reason)
                continue
            try:
                record.placed = spec.shaped(found)
            except SpecError as exc:
                record.placed = None
                self._refuse(spec_id, record, spec.revision, str(exc))
        return any(r.waiting is not None for r in self.records.values())

    def statuses(
        self,
        refusals: Mapping[str, str],
        instances: Callable[[str], list[str]],
        metrics: Callable[[str], RunnerMetrics],
        judged: Mapping[str, int],
    ) -> dict[str, RunnerSpecStatus]:
        """Each spec's status, unstamped: a waiting revision's, else the placed one's
        (with why placement refused it, in `refusals`) once placement has judged that
        revision (`judged`: the revision of each spec the plan had; one written while it
        ran waits for the next), else why it was refused."""
        found = {}
        for spec_id, record in self.records.items():
            spec = record.waiting or record.placed
            if spec is not None and not record.waiting and judged.get(spec_id) != spec.revision:
                continue  # not judged yet: a status now would say nothing of it
            if spec is not None:
                reason = record.why_waiting if record.waiting else refusals.get(spec_id)
                status = RunnerSpecStatus(
                    runner_id=spec_id,
                    revision=spec.revision,
                    accepted=True,
                    reason=reason,
                    instances=instances(spec_id),
                    runner_metrics=metrics(spec_id),
                    updated_at="",
                )
            elif record.refused is not None:
                revision, reason = record.refused
                status = RunnerSpecStatus(
                    runner_id=spec_id,
                    revision=revision,
                    accepted=False,
                    reason=reason,
                    runner_metrics=metrics(spec_id),
                    updated_at="",
                )
            else:
                continue
            found[spec_id] = status
        return found


async def _no_shapes() -> str:
    return "this rank-table service asks no node"
