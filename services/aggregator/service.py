"""The aggregator put together: ingest folds the streams into the views, liveness judges
the nodes, findings judge the instances and publish what they find, queries answer, and
snapshots keep the views between restarts."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Callable

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.micro.service import Service

from rankscope.services.aggregator.alerts import Alerter
from rankscope.services.aggregator.core import Core
from rankscope.services.aggregator.diagnosis import Thresholds
from rankscope.services.aggregator.findings import Findings
from rankscope.services.aggregator.ingest import Ingest
from rankscope.services.aggregator.liveness import Liveness
from rankscope.services.aggregator.queries import Queries
from rankscope.services.aggregator.resume import Snapshots
from rankscope.services.aggregator.silence import Silence
from rankscope.services.aggregator.snapshot_file import SnapshotFile
from rankscope.services.aggregator.views import ClusterState
from rankscope.shared.buckets import follow_bucket
from rankscope.shared.connection import Reachability, slow_consumer_drops, unless_stopped
from rankscope.shared.deadletter import DeadLetters
from rankscope.shared.jetstream import Layout
from rankscope.shared.partitions import Partition
from rankscope.shared.replay import Follower
from rankscope.shared.storage import Storage
from rankscope.shared.wire import AggregatorHealth

__all__ = ["AggregatorService"]

log = logging.getLogger(__name__)

HEAP_FREEZE_S = 30.0
"""How often what the views hold is moved out of the cycle collector's reach (`gc.freeze`):
with a million stored entries a full collection otherwise stalls queries for 50-70 ms."""
CATCH_UP_FREEZE_S = 1.0
"""The same while it rebuilds from the streams: the views grow fastest then, and every full
collection would scan all of them again (5% of a cold replay)."""


class AggregatorService:
    """Keeps `state` current and answers `rankscope.query.<view>`.

    Args:
        nc: NATS connection.
        js: JetStream context.
        layout: streams, buckets and subjects.
        state: the views to fold events into.
        node_id: this aggregator's node id (`localNodeId` of the timeline).
        thresholds: when a rank counts as stuck.
        probe_interval: seconds between live diagnostics requests to every node.
        probe_timeout: overall deadline of one round of those requests.
        snapshots: where the folded state is kept between restarts (None: replay in full).
        snapshot_interval: seconds between snapshots, taken when something changed.
        partition: the instances it folds and answers for (all by default).
        alerter: where findings go as alerts, if anywhere.
        clock: monotonic seconds.
        wall: seconds since the epoch.
    """

    def __init__(
        self,
        *,
        nc: Client,
        js: JetStreamContext,
        layout: Layout,
        state: ClusterState,
        node_id: str,
        thresholds: Thresholds | None = None,
        probe_interval: float = 2.0,
        probe_timeout: float = 1.0,
        snapshots: SnapshotFile | None = None,
        snapshot_interval: float = 30.0,
        partition: Partition | None = None,
        alerter: Alerter | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._js = js
        self._layout = layout
        self._alerter = alerter
        self.partition = partition = partition or Partition()
        self.state = state
        self.ready = asyncio.Event()
        self.dead_letters = DeadLetters(
            js=js, subject=layout.subjects.deadletter("aggregator"), service="aggregator"
        )
        self.reach = Reachability(nc, timeout=probe_timeout, clock=clock)
        self.storage = Storage(
            js,
            layout.subjects.canary("aggregator"),
            timeout=probe_timeout,
            streams=layout.stream_names,
            clock=clock,
        )
        self.ingest = Ingest(
            js=js,
            layout=layout,
            state=state,
            partition=partition,
            dead_letters=self.dead_letters,
            clock=clock,
            wall=wall,
        )
        self.core = Core(
            state,
            thresholds or Thresholds(),
            placed_at=self.ingest.placed_at,
            partition=partition,
            silence=Silence(
                ttl_s=layout.node_ttl_s, probe_interval=probe_interval, probe_timeout=probe_timeout
            ),
            placed_elsewhere=self.ingest.placed_elsewhere,
        )
        self.findings = Findings(
            nc=nc,
            js=js,
            layout=layout,
            core=self.core,
            reach=self.reach,
            storage=self.storage,
            alerter=alerter,
            loaded=self.ingest.loaded,
            clock=clock,
            wall=wall,
        )
        self.liveness = Liveness(
            nc=nc,
            layout=layout,
            core=self.core,
            reach=self.reach,
            storage=self.storage,
            dead_letters=self.dead_letters,
            probe_timeout=probe_timeout,
            clock=clock,
            wall=wall,
        )
        self.queries = Queries(
            nc=nc,
            subjects=layout.subjects,
            state=state,
            partition=partition,
            node_id=node_id,
            findings=lambda: [i.finding for i in self.findings.incidents.values()],
            health=self.health,
            thresholds=self.core.thresholds,
            clock=clock,
            wall=wall,
        )
        self._snapshots = Snapshots(
            js=js, layout=layout, state=state, file=snapshots, interval=snapshot_interval,
            clock=clock,
        )  # fmt: skip
        self._nodes: Follower | None = None
        """The nodes bucket's follower, once started."""

    @property
    def _followers(self) -> list[Follower]:
        """Every follower started so far: the streams folded, then the nodes bucket."""
        return [*self.ingest.folding.values(), *([self._nodes] if self._nodes else [])]

    async def run(self, stop: asyncio.Event) -> None:
        """Rebuild from the streams, then follow them until `stop` is set. A stop while it
        rebuilds ends it there, without a snapshot (the last one still stands)."""
        freezing = asyncio.create_task(_freeze_heap_forever(stop, self.ready))
        catching_up = asyncio.ensure_future(self._catch_up(stop))
        try:
            caught_up = await unless_stopped(catching_up, stop)
        except BaseException:
            freezing.cancel()
            raise
        if not caught_up:
            freezing.cancel()
            log.info("stopped while catching up: %d entries read", self.state.store.size)
            await self._stop_following()
            return
        queries = catching_up.result()
        self.ready.set()
        log.info(
            "aggregator of partition %s caught up: %d entries from %d runners",
            self.partition,
            self.state.store.size,
            len(self.state.runners),
        )
        loops = [
            asyncio.create_task(loop)
            for loop in (
                *([] if self.partition.whole else [self.ingest.follow_more_forever(stop)]),
                self.ingest.unpark_forever(stop),
                self.findings.publish_forever(stop),
                self.liveness.probe_forever(stop),
                self._snapshots.keep_forever(stop, self.ingest.folding),
                *([self._alerter.run(stop)] if self._alerter else []),
            )
        ]
        await stop.wait()
        busy = [freezing, *loops, *self.queries.heavy, *self.findings.capturing]
        for task in busy:
            task.cancel()
        await asyncio.gather(*busy, return_exceptions=True)
        await self.findings.stop_watching()
        await self.snapshot()  # a restart right after this replays nothing
        await queries.stop()
        await self._stop_following()

    async def _stop_following(self) -> None:
        for follower in self._followers:
            await follower.stop()

    async def _catch_up(self, stop: asyncio.Event) -> Service:
        """Rebuild the views from the snapshot and the streams, take up the open incidents
        and answer queries: all it takes to be ready."""
        await self.ingest.follow(await self._snapshots.restore())
        bucket = self._layout.nodes_bucket.bucket
        self._nodes = await follow_bucket(self._js, bucket, self.liveness.on_node)
        for follower in self._followers:
            await follower.caught_up.wait()
        await self.findings.restore(stop)
        return await self.queries.serve()

    async def snapshot(self) -> None:
        """Keep the folded state, once ready, when it changed since the last snapshot."""
        if self.ready.is_set():
            await self._snapshots.keep(self.ingest.folding)

    def health(self) -> AggregatorHealth:
        """Readiness and counters, for /readyz and /metrics."""
        return AggregatorHealth(
            ready=self.ready.is_set() and self.reach.reachable and self.storage.storing,
            partition=str(self.partition),
            storageProblem=self.storage.why(),
            natsReachable=self.reach.reachable,
            natsOutages=self.reach.outages,
            entries=self.state.store.size,
            heldBytes=self.state.store.bytes,
            evictedEntries=self.state.store.evicted,
            trimmedBytes=dict(self.state.store.trimmed),
            runners=len(self.state.runners),
            duplicates=self.state.duplicates,
            badMessages=dict(self.dead_letters.counts),
            missingSeqs={
                r: v.seqs.missing for r, v in self.state.runners.items() if v.seqs.missing
            },
            openFindings=len(self.findings.incidents),
            queuedTasks=self.state.queued(),
            slowConsumerDrops=slow_consumer_drops(),
            followerRestarts=sum(f.restarts for f in self._followers),
            clockOffsets={n: round(o, 3) for n, o in self.liveness.clock_offsets.items()},
        )


async def _freeze_heap_forever(stop: asyncio.Event, ready: asyncio.Event) -> None:
    """Views are long-lived and acyclic: scanning them in every full collection only adds
    pauses, so survivors are frozen every `CATCH_UP_FREEZE_S` while the views are rebuilt
    and every `HEAP_FREEZE_S` once they are (reference counting still frees them when they
    are evicted)."""
    while not stop.is_set():
        gc.freeze()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                stop.wait(), HEAP_FREEZE_S if ready.is_set() else CATCH_UP_FREEZE_S
            )
