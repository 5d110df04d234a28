"""Nodes that answer the aggregator's probes as their agents would, for tests that run no
agent: each lists the runners an instance placed on it, and writes its heartbeat."""

from __future__ import annotations

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from rankscope.shared.jetstream import Layout
from rankscope.shared.subjects import token
from rankscope.shared.timestamps import now
from rankscope.shared.wire import (
    InstanceCreated,
    NodeDiagnostics,
    RunnerSupervisorDiagnostics,
    encode,
)
from tests.ranktable.builders import node_info

__all__ = ["answer_probes"]


async def answer_probes(
    nc: Client, layout: Layout, instance: InstanceCreated
) -> list[Subscription]:
    """Every node of `instance`: its heartbeat written, its probes answered listing its
    runners as alive; the subscriptions (unsubscribe to make the nodes go silent)."""
    nodes = await nc.jetstream().key_value(layout.nodes_bucket.bucket)
    answering = []
    for node_id in sorted({a.nodeId for a in instance.assignments}):
        await nodes.put(token(node_id), encode(node_info(node_id, 24)))
        here = NodeDiagnostics(
            nodeId=node_id,
            friendlyName=node_id,
            address="",
            generatedAt=now(),
            runners=[
                RunnerSupervisorDiagnostics(
                    runnerId=a.runnerId,
                    nodeId=node_id,
                    instanceId=instance.instanceId,
                    modelId=instance.modelId,
                    deviceRank=a.deviceRank,
                    worldSize=a.worldSize,
                    startLayer=a.startLayer,
                    endLayer=a.endLayer,
                    nLayers=a.nLayers,
                    processAlive=True,
                    statusKind="RunnerReady",
                )
                for a in instance.assignments
                if a.nodeId == node_id
            ],
        )

        async def answer(msg: Msg, here: NodeDiagnostics = here) -> None:
            await msg.respond(encode(here))

        subject = layout.subjects.node_diagnostics(node_id)
        answering.append(await nc.subscribe(subject, cb=answer))
    return answering
