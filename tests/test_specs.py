"""Runner specs are validated into placement needs, or refused with a reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rankscope.services.ranktable.placement import runner_id
from rankscope.shared.model_shape import ModelShape, UnreadableModelError, read_shape
from rankscope.shared.specs import RUNNER_BYTES, SpecError, validate
from rankscope.shared.subjects import token
from rankscope.shared.tiny_model import TinyModelSpec, write_tiny_model
from rankscope.shared.wire import ComputeInfo, Nodepool, Worker
from tests.ranktable.builders import GiB, runner


def test_valid_spec_from_metadata() -> None:
    spec = validate(runner(labels=["ultra"]), revision=3)
    assert (spec.ranks, spec.replicas, spec.revision) == (2, 1, 3)
    assert (spec.shape.n_layers, spec.shape.model_bytes) == (32, 8 * GiB)
    assert spec.labels == frozenset({"ultra"})
    assert spec.instance_id(0) == "llm-0"


def test_a_spec_naming_a_model_path_waits_for_its_shape_from_the_nodes(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "m", TinyModelSpec(layers=6, hidden=32))
    spec = validate(runner(metadata={"modelPath": "/on/the/nodes/only"}))
    assert spec.model is None  # the rank-table service does not read it
    with pytest.raises(SpecError, match="not known yet"):
        _ = spec.digest
    shape = read_shape(model)
    assert shape == ModelShape(6, (model / "model.safetensors").stat().st_size)
    assert spec.shaped(shape).model == shape
    with pytest.raises(SpecError, match="the model has 1 layers, fewer than the 2 ranks"):
        spec.shaped(ModelShape(1, 10))


@pytest.mark.parametrize(
    ("files", "reason"),
    [
        ({}, "no readable config.json"),
        ({"config.json": "[1]"}, "config.json is not an object"),
        ({"config.json": '{"num_hidden_layers": true}'}, "config.json has no layer count"),
        ({"config.json": '{"num_hidden_layers": 4}'}, "no \\*.safetensors weights"),
    ],
)
def test_an_unreadable_model_says_what_is_missing(
    tmp_path: Path, files: dict[str, str], reason: str
) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(UnreadableModelError, match=reason):
        read_shape(tmp_path)


def test_accelerator_memory_is_the_per_rank_demand() -> None:
    spec = validate(runner(compute_info=ComputeInfo(num_accelerators=2, accelerator_memory="3Gi")))
    assert spec.rank_demand(layers=1) == spec.rank_demand(layers=20) == 3 * GiB


def test_model_share_and_a_process_are_the_per_rank_demand_without_accelerator_memory() -> None:
    assert validate(runner()).rank_demand(layers=8) == 2 * GiB + RUNNER_BYTES


def test_unknown_nodepool_is_accepted() -> None:
    assert validate(runner(nodepool=Nodepool(id="elsewhere"))).nodepool == "elsewhere"


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"id": ""}, "id is required"),
        ({"id": "a/b"}, "holds '/' or a control character"),
        ({"id": "a\tb"}, "holds '/' or a control character"),
        ({"id": ".."}, "is '.' or '..'"),
        ({"id": "x" * 481}, "must leave 32 of 512 characters for the ids of its instances"),
        ({"id": "é" * 81}, "must leave 32 of 512"),  # 6 escaped characters each
        ({"worker": Worker()}, "worker.model.id is required"),
        ({"compute_info": ComputeInfo(num_accelerators=0)}, "num_accelerators must be at least 1"),
        ({"num_replicas": 1, "min_replicas": 2}, r"min_replicas \(2\) exceeds num_replicas \(1\)"),
        (
            {"compute_info": ComputeInfo(num_accelerators=2, accelerator_memory="lots")},
            "compute_info.accelerator_memory: 'lots' is not a quantity",
        ),
        (
            {"compute_info": ComputeInfo(num_accelerators=2, cpu_limit="4 cores")},
            "compute_info.cpu_limit",
        ),
        (
            {"compute_info": ComputeInfo(num_accelerators=2, cpu_memory="8GB")},
            "compute_info.cpu_memory",
        ),
        ({"metadata": {}}, "the model's size is unknown: set metadata.modelPath"),
        ({"metadata": {"nLayers": 32}}, "metadata.modelBytes must be a positive size"),
        (
            {"metadata": {"nLayers": "32", "modelBytes": 1}},
            "metadata.nLayers must be a positive integer",
        ),
        (
            {"metadata": {"nLayers": 1, "modelBytes": 1}},
            "the model has 1 layers, fewer than the 2 ranks",
        ),
        ({"metadata": {"modelPath": 7}}, "metadata.modelPath must be a path"),
        ({"metadata": {"nLayers": 32, "modelBytes": 9, "maxRanksPerNode": 0}}, "maxRanksPerNode"),
    ],
)
def test_bad_specs_are_refused_with_a_reason(changes: dict[str, Any], reason: str) -> None:
    with pytest.raises(SpecError, match=reason):
        validate(runner(**changes))


def test_the_longest_id_accepted_makes_runner_ids_that_name_subjects() -> None:
    spec = validate(runner(id="x" * 480))
    token(runner_id(spec.instance_id(99), attempt=123456, rank=255))  # no IdTooLongError


def test_digest_changes_with_shape_not_with_count() -> None:
    base = validate(runner())
    assert validate(runner(num_replicas=3, priority=5)).digest == base.digest
    assert validate(runner(ranks=3)).digest != base.digest
