"""Where a restarted aggregator resumes: the views of its last snapshot, when it can be
trusted, and snapshots taken as it runs (when something changed, not too often)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping

from nats.js import JetStreamContext

from rankscope.services.aggregator.snapshot import Position, restore
from rankscope.services.aggregator.snapshot_file import SnapshotFile
from rankscope.services.aggregator.views import ClusterState
from rankscope.shared.jetstream import Layout
from rankscope.shared.replay import Follower

__all__ = ["Snapshots"]

log = logging.getLogger(__name__)

SNAPSHOT_WORK_SHARE = 50
"""Snapshots are taken at most once per this many times the CPU seconds the last one took."""


class Snapshots:
    """Restores `state` from `file` at start and keeps it there as it changes.

    Args:
        js: JetStream context (the streams' identities and ends).
        layout: the streams a snapshot covers.
        state: the views.
        file: where snapshots are kept (None: none, every start replays in full).
        interval: seconds between snapshots, taken when something changed.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        *,
        js: JetStreamContext,
        layout: Layout,
        state: ClusterState,
        file: SnapshotFile | None,
        interval: float,
        clock: Callable[[], float],
    ) -> None:
        self._js = js
        self._layout = layout
        self._state = state
        self._file = file
        self._interval = interval
        self._clock = clock
        self._version = -1
        self._cpu_s = 0.0
        self._streams: dict[str, str] = {}

    async def _stream_ids(self) -> dict[str, tuple[str, int]]:
        """(creation time, last sequence) of each stream a snapshot covers."""
        found = {}
        for stream in (
            self._layout.placement_stream,
            self._layout.recorded_stream,
            self._layout.fr_stream,
            self._layout.tasks_stream,
            self._layout.runner_stream,
        ):
            info = await self._js.stream_info(stream.name)
            created = info.created.isoformat() if info.created else ""
            found[stream.name] = (created, info.state.last_seq)
        return found

    async def restore(self) -> dict[str, int]:
        """Fold in the snapshot kept, when it can be trusted; where each stream's replay
        starts after (nothing: from the start)."""
        current = await self._stream_ids()
        self._streams = {name: created for name, (created, _) in current.items()}
        if self._file is None:
            return {}
        snapshot = await asyncio.to_thread(self._file.read)
        if snapshot is None:
            return {}
        for name, (created, last) in current.items():
            position = snapshot.positions.get(name)
            if position is None or position.created != created or position.seq > last:
                log.warning(
                    "snapshot %s is of another incarnation of stream %s; replaying in full",
                    self._file.path,
                    name,
                )
                return {}
        try:
            restore(self._state, snapshot, moment=self._clock())
        except ValueError as exc:
            log.warning("snapshot %s does not hold together (%s); replaying in full",
                        self._file.path, exc)  # fmt: skip
            return {}
        log.info(
            "restored a snapshot of %d entries from %d runners; replaying what came after",
            self._state.store.size,
            len(self._state.runners),
        )
        return {name: position.seq for name, position in snapshot.positions.items()}

    async def keep_forever(self, stop: asyncio.Event, folding: Mapping[str, Follower]) -> None:
        """Snapshot every `interval`, or less often when one takes much CPU: the copies
        that write them use under 2% of a core."""
        while not stop.is_set():
            wait = max(self._interval, SNAPSHOT_WORK_SHARE * self._cpu_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)
            if not stop.is_set():
                await self.keep(folding)

    async def keep(self, folding: Mapping[str, Follower]) -> None:
        """Keep the folded state and how far into each stream (`folding`: the followers
        by stream name) it goes, when it changed."""
        if self._file is None or self._state.version == self._version:
            return
        positions = {
            name: Position(created=self._streams[name], seq=follower.last_seq)
            for name, follower in folding.items()
        }
        started, version, size = time.perf_counter(), self._state.version, self._state.store.size
        try:
            paused, self._cpu_s = await self._file.keep(self._state, positions)
            megabytes = self._file.path.stat().st_size / 1e6
        except OSError as exc:
            log.warning("snapshot not written to %s: %s", self._file.path, exc)
            return
        written = time.perf_counter() - started
        self._version = version
        log.debug("snapshot of %d entries: %.1f MB, written in %.2f s (%.2f s of CPU) by a copy "
                 "of this process; queries paused %.1f ms for the copy", size, megabytes, written,
                 self._cpu_s, paused * 1000)  # fmt: skip
