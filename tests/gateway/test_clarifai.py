"""Clarifai's own client is the judge of the Runner API: every Runner served parses
strictly as `clarifai_grpc` `resources_pb2.Runner`, and a Runner built with the proto goes
through create, get, patch and delete as Clarifai's request shapes write it."""

from __future__ import annotations

from typing import Any

import pytest
from clarifai_grpc.grpc.api import resources_pb2, service_pb2
from clarifai_grpc.grpc.api.status import status_code_pb2
from google.protobuf.json_format import MessageToDict, ParseDict
from google.protobuf.struct_pb2 import Struct

from tests.gateway.conftest import Stack

pytestmark = pytest.mark.nats

SEED_STYLE: dict[str, Any] = {  # as the seed writes a Runner, where it differs from the proto
    "id": "seed-llm",
    "worker": {"model": {"id": "tiny", "user_id": "me", "app_id": "main"}},
    "nodepool": {"id": "default", "user_id": "me"},
    "compute_info": {"num_accelerators": 2, "accelerator_topology": ""},
    "special_handling": [{"id": "support", "reason": "", "done": False}],
    "num_replicas": 1,
    "metadata": {"nLayers": 8, "modelBytes": "4Gi"},
}


def _runner(served: dict[str, Any]) -> resources_pb2.Runner:
    """`served` parsed strictly: an unknown field or a bad value fails the test."""
    return ParseDict(served, resources_pb2.Runner(), ignore_unknown_fields=False)


def _ok(answer: dict[str, Any], shape: Any) -> Any:
    parsed = ParseDict(answer, shape(), ignore_unknown_fields=True)  # and our `placement`
    assert parsed.status.code == status_code_pb2.SUCCESS
    return parsed


async def test_every_runner_served_parses_as_clarifai_s_proto(stack_for: Any) -> None:
    stack: Stack = await stack_for()
    http = stack.http
    created = (await http.post("/v1/runners", json={"runners": [SEED_STYLE]})).json()
    _ok(created, service_pb2.MultiRunnerResponse)
    runner = _runner(created["runners"][0])
    assert runner.nodepool.compute_cluster.user_id == "me"  # where the proto carries it
    assert list(runner.compute_info.accelerator_topology) == []
    assert not runner.special_handling[0].reason  # unset, not ""
    got = (await http.get("/v1/runners/seed-llm")).json()
    _runner(got["runner"])
    _ok(got, service_pb2.SingleRunnerResponse)
    patched = await http.patch(
        "/v1/runners/seed-llm", json={"runner": {"priority": 3}, "action": "merge"}
    )
    _runner(patched.json()["runner"])
    listed = (await http.get("/v1/runners")).json()
    for served in listed["runners"]:
        _runner(served)
    _ok(listed, service_pb2.MultiRunnerResponse)


async def test_a_runner_built_with_the_proto_goes_through_create_get_patch_delete(
    stack_for: Any,
) -> None:
    stack: Stack = await stack_for()
    http = stack.http
    metadata = Struct()
    metadata.update({"nLayers": 8, "modelBytes": "4Gi"})  # a Struct's numbers are doubles
    built = resources_pb2.Runner(
        id="proto-llm",
        worker=resources_pb2.Worker(model=resources_pb2.Model(id="tiny")),
        nodepool=resources_pb2.Nodepool(
            id="default", compute_cluster=resources_pb2.ComputeCluster(user_id="me")
        ),
        compute_info=resources_pb2.ComputeInfo(num_accelerators=2, accelerator_topology=["1x2"]),
        num_replicas=1,
        metadata=metadata,
        special_handling=[
            resources_pb2.SpecialHandling(
                id="sales", reason=resources_pb2.SpecialHandling.CONTACT_SALES
            )
        ],
    )
    post = service_pb2.PostRunnersRequest(runners=[built])
    body = MessageToDict(post, preserving_proto_field_name=True)
    assert body["runners"][0]["metadata"] == {"nLayers": 8.0, "modelBytes": "4Gi"}
    created = await http.post("/v1/runners", json=body)
    assert created.status_code == 200, created.text
    got = _runner((await http.get("/v1/runners/proto-llm")).json()["runner"])
    assert got.nodepool == built.nodepool
    assert got.compute_info == built.compute_info
    assert got.special_handling == built.special_handling
    assert got.metadata == built.metadata
    change = service_pb2.PatchRunnersRequest(
        runners=[resources_pb2.Runner(id="proto-llm", num_replicas=2)], action="merge"
    )
    patched = await http.patch(
        "/v1/runners", json=MessageToDict(change, preserving_proto_field_name=True)
    )
    assert patched.status_code == 200, patched.text
    _ok(patched.json(), service_pb2.MultiRunnerResponse)
    after = _runner(patched.json()["runners"][0])
    assert (after.num_replicas, after.compute_info) == (2, built.compute_info)
    assert (await http.delete("/v1/runners/proto-llm")).status_code == 200
    assert (await http.get("/v1/runners/proto-llm")).status_code == 404


async def test_a_patch_of_runners_names_each_one(stack_for: Any) -> None:
    stack: Stack = await stack_for()
    body = {"runners": [{"num_replicas": 2}], "action": "merge"}
    reply = await stack.http.patch("/v1/runners", json=body)
    assert reply.status_code == 422
    assert reply.json()["detail"] == "invalid body: `$.runners[0].id` names no runner"
    body = {"runners": [{"id": "nope", "num_replicas": 2}], "action": "merge"}
    assert (await stack.http.patch("/v1/runners", json=body)).status_code == 404
