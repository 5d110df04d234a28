"""Skulk's diagnostics routes answer in Skulk's own shapes (judged by
`tests/skulk_shapes.py`, written from Skulk's models with `extra="forbid"`)."""

from __future__ import annotations

from typing import Any

import pytest

from tests import skulk_shapes
from tests.gateway.conftest import Stack
from tests.gateway.test_api import _serving

pytestmark = pytest.mark.nats


async def test_a_node_s_bundle_and_the_cluster_s_parse_as_skulk_s(stack_for: Any) -> None:
    stack: Stack = await stack_for(node_id="node-b")
    await _serving(stack)  # llm-0 on node-a and node-b, whose agents answer
    reply = await stack.http.get("/v1/diagnostics/cluster/node-a")
    assert reply.status_code == 200, reply.text
    node = skulk_shapes.NodeDiagnostics.model_validate(reply.json())
    assert node.runtime.node_id == "node-a"
    assert not node.runtime.is_master
    assert [r.node_id for r in node.supervisor_runners] == ["node-a"]
    (placement,) = node.placements
    assert placement.instance_id == "llm-0"
    assert placement.local_node_is_placement_node
    assert sorted(placement.placement_node_ids) == ["node-a", "node-b"]
    assert {(r.node_id, r.is_local) for r in placement.runners} == {
        ("node-a", True),  # local to the node whose bundle it is
        ("node-b", False),
    }
    cluster = skulk_shapes.ClusterDiagnostics.model_validate(
        (await stack.http.get("/v1/diagnostics/cluster")).json()
    )
    assert (cluster.local_node_id, cluster.master_node_id) == ("node-b", None)
    assert [(n.node_id, n.ok) for n in cluster.nodes] == [("node-a", True), ("node-b", True)]


async def test_a_node_without_an_agent_is_a_404_and_a_failed_entry(stack_for: Any) -> None:
    stack: Stack = await stack_for()  # the nodes have heartbeats but no agent behind them
    reply = await stack.http.get("/v1/diagnostics/cluster/node-a")
    assert reply.status_code == 404
    assert reply.json()["detail"] == "no agent of node 'node-a' is listening"
    cluster = skulk_shapes.ClusterDiagnostics.model_validate(
        (await stack.http.get("/v1/diagnostics/cluster")).json()
    )
    assert [(n.node_id, n.ok, n.error) for n in cluster.nodes] == [
        ("node-a", False, "no agent of node 'node-a' is listening"),
        ("node-b", False, "no agent of node 'node-b' is listening"),
    ]
