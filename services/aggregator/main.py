"""`rankscope aggregator`: the views and the diagnosis, served on `rankscope.query.*`."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from rankscope.services.aggregator.alerts import Alerter
from rankscope.services.aggregator.arrivals import ArrivalLimits
from rankscope.services.aggregator.diagnosis import Thresholds
from rankscope.services.aggregator.pace import PaceLimits
from rankscope.services.aggregator.service import AggregatorService
from rankscope.services.aggregator.snapshot_file import SnapshotFile
from rankscope.services.aggregator.stages import StageLimits
from rankscope.services.aggregator.store import EntryStore
from rankscope.services.aggregator.views import ClusterState
from rankscope.services.lifecycle import connected, run_until_signalled
from rankscope.shared.settings import Settings

__all__ = ["run", "serve_until"]


async def serve_until(settings: Settings, stop: asyncio.Event) -> None:
    """Run the aggregator until `stop` is set."""
    async with contextlib.AsyncExitStack() as stack:
        bus = await connected(stack, settings, "rankscope-aggregator", stop)
        nc, js, layout = bus.nc, bus.js, bus.layout
        part = settings.partition
        kept = f"aggregator-{layout.subjects.prefix}" + ("" if part.whole else f"-{part.name}")
        public = settings.public_url or f"http://{settings.gateway_host}:{settings.gateway_port}"
        store = EntryStore(
            per_runner=settings.retention_per_runner,
            total=settings.retention_total,
            max_bytes=settings.retention_bytes,
        )
        service = AggregatorService(
            nc=nc,
            js=js,
            layout=layout,
            state=ClusterState(store=store),
            node_id=settings.node_id or "aggregator",
            thresholds=Thresholds(
                working=settings.stall_threshold,
                loading=settings.load_threshold,
                slow=PaceLimits(
                    ratio=settings.slow_ratio,
                    clear=min(settings.slow_clear, settings.slow_ratio),
                    window=settings.slow_window,
                    hold=settings.slow_hold,
                    noise=settings.slow_noise,
                    learn=settings.slow_learn,
                ),
                arrivals=ArrivalLimits(
                    share=settings.straggler_share, window=settings.straggler_window
                ),
                stages=StageLimits(window=settings.stage_window),
            ),
            # a silent node is reported well before the rank-table service, one TTL after
            # its last heartbeat, releases what ran on it
            probe_interval=min(2.0, settings.heartbeat_ttl / 4),
            probe_timeout=min(1.0, settings.heartbeat_ttl / 4),
            snapshots=SnapshotFile(Path(settings.data_dir) / f"{kept}.snapshot")
            if settings.snapshots
            else None,
            snapshot_interval=settings.snapshot_interval,
            partition=part,
            alerter=Alerter(
                settings.alertmanager_url,
                settings.alertmanager_token,
                f"{public}/v1/cluster/diagnosis/history/{{incident}}/bundle",
            )
            if settings.alertmanager_url
            else None,
        )
        await service.run(stop)


def run(settings: Settings) -> int:
    """Run in the foreground until SIGINT or SIGTERM; returns the exit code."""
    return run_until_signalled(serve_until, settings)
