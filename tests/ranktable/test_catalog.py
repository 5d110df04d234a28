"""A spec's status says what placement made of that very revision, never of an earlier
plan that had not seen it."""

from __future__ import annotations

from nats.js.kv import KeyValue

from rankscope.services.ranktable.catalog import Catalog
from rankscope.shared.wire import RunnerMetrics, RunnerSpecStatus, encode
from tests.ranktable.builders import runner


def _written(spec_id: str, revision: int) -> KeyValue.Entry:
    value = encode(runner(spec_id, metadata={"nLayers": 8, "modelBytes": "900Gi"}))
    return KeyValue.Entry(
        bucket="b",
        key=spec_id,
        value=value,
        revision=revision,
        delta=None,
        created=None,
        operation=None,
    )


def _statuses(
    catalog: Catalog, refusals: dict[str, str], judged: dict[str, int]
) -> dict[str, RunnerSpecStatus]:
    return catalog.statuses(refusals, lambda _: [], lambda _: RunnerMetrics(), judged)


def test_a_spec_written_while_a_plan_ran_gets_no_status_from_that_plan() -> None:
    catalog = Catalog(max_replicas=8, shapes=None, clock=lambda: 0.0)
    catalog.on_spec(_written("llm", 1))
    judged = {s.runner_id: s.revision for s in catalog.placeable()}
    catalog.on_spec(_written("huge", 2))  # while placement worked on what it had
    assert set(_statuses(catalog, {}, judged)) == {"llm"}
    judged = {s.runner_id: s.revision for s in catalog.placeable()}
    status = _statuses(catalog, {"huge": "replica 0: 10 GiB short"}, judged)["huge"]
    assert (status.revision, status.reason) == (2, "replica 0: 10 GiB short")
