"""Stop the aggregator while 100k entries stream in — SIGKILL and start it again, SIGTERM
and start it again from its snapshot, or SIGSTOP and SIGCONT it — and its views equal,
entry for entry, those of an aggregator that never stopped."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from nats.errors import Error as NatsError

from rankscope.services.aggregator import answers
from rankscope.services.aggregator.service import AggregatorService
from rankscope.services.aggregator.store import EntryStore
from rankscope.services.aggregator.views import ClusterState
from rankscope.shared.connection import connect
from rankscope.shared.headers import ERROR_CODE_HEADER
from rankscope.shared.jetstream import Layout
from rankscope.shared.nats_server import EmbeddedNats
from rankscope.shared.provision import ensure
from rankscope.shared.settings import Settings
from rankscope.shared.wire import ClusterTimeline, Phase, TimelineQuery, decode, encode
from tests.aggregator.builders import entries, placed, rank

pytestmark = [pytest.mark.nats, pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).parent.parent.parent
RUNNERS, PER_RUNNER, BATCH = 8, 12_500, 32


def _start(url: str, data: Path, node_id: str) -> subprocess.Popen[bytes]:
    """A `rankscope aggregator` process keeping its snapshot in `data`, its log in
    `data`/log."""
    data.mkdir(parents=True, exist_ok=True)
    with (data / "log").open("ab") as log:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rankscope.services.cli",
                "aggregator",
                "--data-dir",
                str(data),
                "--node-id",
                node_id,
            ],
            cwd=REPO,
            env={**os.environ, "RANKSCOPE_NATS_URL": url, "RANKSCOPE_LOG_LEVEL": "info"},
            stderr=log,
        )


async def _caught_up(data: Path) -> None:
    """Once the aggregator of `data` has caught up (a stop before then ends its catch-up
    without a snapshot)."""
    for _ in range(1200):
        if "caught up" in (data / "log").read_text():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not caught up: {(data / 'log').read_text()[-2000:]}")


@pytest.mark.parametrize("fault", ["sigkill", "sigterm-then-snapshot", "sigstop"])
async def test_an_aggregator_stopped_mid_stream_serves_identical_views(
    tmp_path: Path, fault: str
) -> None:
    server = EmbeddedNats(store_dir=tmp_path / "nats").start()
    nc = await connect(Settings(nats_url=server.url), "crash-test")
    js = nc.jetstream()
    layout = Layout()
    await ensure(js, layout)
    await js.publish(layout.subjects.placement("i"), encode(placed(world=RUNNERS, layers=16)))
    reference = AggregatorService(
        nc=nc,
        js=js,
        layout=layout,
        state=ClusterState(store=EntryStore()),
        node_id="aggregator",
    )
    stop = asyncio.Event()
    running = asyncio.create_task(reference.run(stop))
    await reference.ready.wait()
    victim = _start(server.url, tmp_path / "a", "victim")
    await _caught_up(tmp_path / "a")  # stopped mid-stream, not mid-start
    try:
        for first in range(0, PER_RUNNER, BATCH):
            acks = []
            for r in range(RUNNERS):
                batch = entries(
                    rank(r, world=RUNNERS),
                    *[
                        (s, s / 100 + r / 1000, Phase.DECODE_STREAM, s)
                        for s in range(first, min(first + BATCH, PER_RUNNER))
                    ],
                )
                subject = layout.subjects.runner(f"node-{r}", "i", r, "phase")
                acks.append(await js.publish_async(subject, encode(batch)))
            await asyncio.gather(*acks)
            if first == PER_RUNNER // 2 // BATCH * BATCH:
                if fault == "sigkill":
                    victim.send_signal(signal.SIGKILL)  # mid-stream, no chance to clean up
                    assert victim.wait() == -signal.SIGKILL
                elif fault == "sigstop":
                    victim.send_signal(signal.SIGSTOP)  # the rest piles up behind it
                else:
                    victim.terminate()
                    assert victim.wait() == 0
                    assert list((tmp_path / "a").glob("aggregator-*.snapshot"))
        if fault == "sigstop":
            victim.send_signal(signal.SIGCONT)
            restarted, served_by = victim, "victim"
        else:  # from the snapshot it left, or from nothing
            data = tmp_path / ("a" if fault == "sigterm-then-snapshot" else "b")
            restarted, served_by = _start(server.url, data, "restarted"), "restarted"
        total = RUNNERS * PER_RUNNER
        for _ in range(600):
            if reference.state.store.size == total:
                break
            await asyncio.sleep(0.05)
        stop.set()  # from here on only the restarted aggregator answers queries
        await running
        served = None
        for _ in range(600):
            try:
                reply = await nc.request(
                    layout.subjects.query("timeline"), encode({"limit": 100_000}), timeout=30
                )
            except NatsError:  # not subscribed yet
                await asyncio.sleep(0.1)
                continue
            if reply.headers and ERROR_CODE_HEADER in reply.headers:  # still rebuilding
                await asyncio.sleep(0.1)
                continue
            candidate = decode(reply.data, ClusterTimeline)
            if len(candidate.timeline) == total:
                served = candidate
                break
            await asyncio.sleep(0.1)
        assert served is not None, "the restarted aggregator never served every entry"
        assert served.localNodeId == served_by
        mine = answers.timeline(
            reference.state,
            TimelineQuery(limit=100_000),
            local_node_id="reference",
            now=time.time(),
        )
        assert served.timeline == mine.timeline  # entry for entry
        assert [r.runnerId for r in served.runners] == [r.runnerId for r in mine.runners]
        restarted.terminate()
        restarted.wait()
    finally:
        if victim.poll() is None:
            victim.kill()
        if not running.done():
            stop.set()
            await running
        await nc.close()
        server.stop()
