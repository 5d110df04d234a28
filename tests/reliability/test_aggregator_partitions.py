"""Two partitions of aggregators behind a gateway, each its own process. SIGKILL one (or
SIGSTOP it, so it holds its subscriptions but answers nothing) while telemetry streams in:
the gateway keeps answering with the other partition's instances and names the missing one
(header and field); started again (or continued), the partition catches up on everything
published meanwhile, each entry once."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from rankscope.shared.connection import close, connect
from rankscope.shared.headers import MISSING_PARTITIONS_HEADER as MISSING_HEADER
from rankscope.shared.jetstream import Layout
from rankscope.shared.nats_server import EmbeddedNats
from rankscope.shared.provision import ensure
from rankscope.shared.settings import Settings, to_environ
from rankscope.shared.wire import ClusterTimeline, Phase, decode, encode
from tests.aggregator.builders import entries, placed, rank
from tests.aggregator.builders import instances_by_partition as by_partition
from tests.stack_up import free_port

pytestmark = [pytest.mark.nats, pytest.mark.timeout(180)]

REPO = Path(__file__).parent.parent.parent
PARTITIONS, RANKS, BATCHES, PER_BATCH = 2, 2, 20, 16


class Cluster:
    """The NATS server, the aggregator processes by partition and the gateway."""

    def __init__(self, root: Path, server: EmbeddedNats) -> None:
        self.root = root
        self.settings = Settings(
            nats_url=server.url,
            aggregator_partitions=PARTITIONS,
            gateway_port=free_port(),
            request_timeout=1.0,
            log_level="error",
        )
        self.aggregators: dict[int, subprocess.Popen[bytes]] = {}
        self.gateway: subprocess.Popen[bytes] | None = None

    def _start(self, *args: str, **env: str) -> subprocess.Popen[bytes]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE_")}
        return subprocess.Popen(
            [sys.executable, "-m", "rankscope.services.cli", *args],
            cwd=REPO,
            env={**base, **to_environ(self.settings), **env},
        )

    def start_aggregator(self, partition: int) -> None:
        self.aggregators[partition] = self._start(
            "aggregator",
            RANKSCOPE_AGGREGATOR_PARTITION=str(partition),
            RANKSCOPE_DATA_DIR=str(self.root / f"aggregator-{partition}"),
        )

    def start_gateway(self) -> None:
        self.gateway = self._start("gateway", RANKSCOPE_DATA_DIR=str(self.root / "gateway"))

    def stop(self) -> None:
        for process in [*self.aggregators.values(), self.gateway]:
            if process is not None and process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)
                process.kill()
                process.wait()


@pytest_asyncio.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    with EmbeddedNats(store_dir=tmp_path / "nats") as server:
        built = Cluster(tmp_path, server)
        try:
            for partition in range(PARTITIONS):
                built.start_aggregator(partition)
            built.start_gateway()
            yield built
        finally:
            built.stop()


async def _timeline(http: httpx.AsyncClient) -> httpx.Response:
    return await http.get("/v1/cluster/timeline", params={"limit": 100_000})


async def _until(http: httpx.AsyncClient, count: int, missing: str | None) -> httpx.Response:
    """The timeline once it holds `count` entries with `missing` partitions (60 s at most)."""
    answer = None
    for _ in range(600):
        try:
            answer = await _timeline(http)
        except httpx.TransportError:  # the gateway is still starting
            await asyncio.sleep(0.1)
            continue
        if (
            answer.status_code == 200
            and answer.headers.get(MISSING_HEADER) == missing
            and len(answer.json()["timeline"]) == count
        ):
            return answer
        await asyncio.sleep(0.1)
    shown = answer.text[:300] if answer is not None else "no answer"
    raise AssertionError(f"never {count} entries with {missing} missing: {shown}")


@pytest.mark.parametrize("fault", ["sigkill", "sigstop"])
async def test_a_lost_partition_is_named_and_catches_up(cluster: Cluster, fault: str) -> None:
    owned = by_partition(PARTITIONS, 2)
    names = [name for partition in sorted(owned) for name in owned[partition]]
    nc = await connect(cluster.settings, "partition-test")
    js = nc.jetstream()
    layout = Layout()
    await ensure(js, layout)
    seq = dict.fromkeys(names, 0)

    async def publish(batches: int) -> None:
        for _ in range(batches):
            for name in names:
                for r in range(RANKS):
                    first = seq[name] + 1
                    items = [
                        (first + i, first + i, Phase.DECODE_STREAM, i) for i in range(PER_BATCH)
                    ]
                    subject = layout.subjects.runner(f"node-{r}", name, r, "phase")
                    await js.publish(subject, encode(entries(rank(r, name), *items)))
                seq[name] += PER_BATCH

    for name in names:
        await js.publish(layout.subjects.placement(name), encode(placed(name)))
    await publish(BATCHES)
    per_instance = RANKS * BATCHES * PER_BATCH
    url = f"http://127.0.0.1:{cluster.settings.gateway_port}"
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        whole = await _until(http, len(names) * per_instance, None)
        assert "missingPartitions" not in whole.json()

        victim = cluster.aggregators[1]
        os.kill(victim.pid, signal.SIGKILL if fault == "sigkill" else signal.SIGSTOP)
        await publish(BATCHES)  # ingest goes on into the streams meanwhile
        partial = await _until(http, 2 * len(owned[0]) * per_instance, "1")
        (missing,) = partial.json()["missingPartitions"]
        assert missing["partition"] == 1
        why = "did not answer within 1s" if fault == "sigstop" else "is not running"
        assert why in missing["reason"]
        assert {r["instanceId"] for r in partial.json()["runners"]} == set(owned[0])
        ready = await http.get("/readyz")
        assert ready.status_code == 503
        assert "partition 1" in ready.json()["reason"]

        if fault == "sigkill":
            victim.wait()
            cluster.start_aggregator(1)
        else:
            os.kill(victim.pid, signal.SIGCONT)
        caught_up = await _until(http, 2 * len(names) * per_instance, None)
        timeline = decode(caught_up.content, ClusterTimeline).timeline
        held = {(e.runnerId, e.attrs["step"], e.at) for e in timeline}
        assert len(held) == len(timeline)  # each entry once
        assert (await http.get("/readyz")).status_code == 200
    await close(nc)
