"""`rankscope agent`: one per node."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import uuid
from pathlib import Path

from setproctitle import setproctitle

from rankscope.services.agent.agent import Agent
from rankscope.services.agent.runner.config import Timeouts
from rankscope.services.lifecycle import connected, run_until_signalled
from rankscope.shared.heartbeat import Heartbeat
from rankscope.shared.host import hostname, memory_bytes
from rankscope.shared.replay import follow
from rankscope.shared.settings import Settings
from rankscope.shared.telemetry import TelemetryPublisher
from rankscope.shared.timestamps import now
from rankscope.shared.wire import NodeInfo

__all__ = ["node_id", "run", "serve_until"]

log = logging.getLogger("rankscope.agent")

AGENT_VERSION = "0.1.0"


def node_id(settings: Settings) -> str:
    """The configured node id, else one generated once and kept in the data dir."""
    if settings.node_id:
        return settings.node_id
    path = Path(settings.data_dir) / "node-id"
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    generated = f"{hostname()}-{uuid.uuid4().hex[:6]}"
    path.write_text(generated + "\n")
    return generated


async def serve_until(settings: Settings, stop: asyncio.Event) -> None:
    """Run the agent until `stop` is set, then release every runner and leave the inventory."""
    identity = node_id(settings)
    setproctitle(f"rankscope agent {identity}")

    def describe() -> NodeInfo:
        total, available = memory_bytes()
        return NodeInfo(
            nodeId=identity,
            friendlyName=settings.friendly_name or hostname(),
            address=settings.node_address,
            memoryTotalBytes=total,
            memoryAvailableBytes=available,
            labels=list(settings.node_labels),
            nodepool=settings.nodepool,
            agentVersion=AGENT_VERSION,
            lastHeartbeat=now(),
        )

    async with contextlib.AsyncExitStack() as stack:
        # an agent reads no stream's state: the names of other nodes' tasks are in it
        bus = await connected(stack, settings, f"rankscope-agent-{identity}", stop, owner=False)
        nc, js, layout = bus.nc, bus.js, bus.layout
        publisher = TelemetryPublisher(nc=nc)
        publishing_stop = asyncio.Event()
        publishing = asyncio.create_task(publisher.run(publishing_stop))
        agent = Agent(
            nc=nc,
            js=js,
            layout=layout,
            node=describe,
            publisher=publisher,
            timeouts=Timeouts(
                connect=settings.connect_timeout, collective=settings.collective_timeout
            ),
        )
        kv = await js.key_value(layout.nodes_bucket.bucket)
        beat_stop = asyncio.Event()
        beating = asyncio.create_task(
            Heartbeat(
                kv=kv,
                describe=describe,
                interval=settings.heartbeat_ttl / 3,
                connected=lambda: nc.is_connected,
            ).run(beat_stop)
        )
        diagnostics = await nc.subscribe(
            layout.subjects.node_diagnostics(identity), cb=agent.answer
        )
        evidence = await nc.subscribe(layout.subjects.node_evidence(identity), cb=agent.evidence)
        models = await nc.subscribe(layout.subjects.node_model(identity), cb=agent.model)
        placements = await follow(
            js, layout.subjects.placement_all(), agent.on_placement, deletes=False
        )
        await placements.caught_up.wait()
        await agent.catch_up()
        log.info("agent up", extra={"nodeId": identity})
        await stop.wait()
        await placements.stop()
        await diagnostics.unsubscribe()
        await evidence.unsubscribe()
        await models.unsubscribe()
        await agent.shutdown()
        _reap_runners()
        beat_stop.set()
        await beating
        publishing_stop.set()
        await publishing
        if publisher.dropped_entries:
            log.warning("telemetry dropped: %d entries", publisher.dropped_entries)


def _reap_runners() -> None:
    """No runner outlives its agent: one wedged in a collective ignores SIGTERM, and the
    interpreter would wait for it at exit forever."""
    for child in multiprocessing.active_children():
        log.warning("runner pid %s still alive after release: killed", child.pid)
        child.kill()
        child.join(5)


def run(settings: Settings) -> int:
    """Run in the foreground until SIGINT or SIGTERM; returns the exit code."""
    return run_until_signalled(serve_until, settings)
