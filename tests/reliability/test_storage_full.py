"""A full JetStream store is told apart from a NATS outage and from silent ranks: the
aggregator is not ready, says why in one finding and one log line, and recovers once
there is room again; `up` on a store too small for its streams says so in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.js.errors import APIError

from rankscope.shared.connection import close, connect
from rankscope.shared.jetstream import Layout, ensure
from rankscope.shared.nats_server import CONFIG, EmbeddedNats
from rankscope.shared.settings import Settings
from rankscope.shared.wire import Diagnosis, FindingKind, decode
from tests.aggregator.running import aggregator, query, until

pytestmark = [pytest.mark.nats, pytest.mark.timeout(120)]

LAYOUT = Layout()
ROOM = 1 << 20
"""The store's size: a full disk, scaled down."""
REPO = Path(__file__).parent.parent.parent


@pytest.fixture
async def tight(tmp_path: Path) -> AsyncIterator[Client]:
    """A server whose store holds 1 MiB: its streams were made while it had room."""
    with EmbeddedNats(store_dir=tmp_path / "nats") as roomy:
        nc = await connect(Settings(nats_url=roomy.url), "setup")
        await ensure(nc.jetstream(), LAYOUT)
        await close(nc)
    config = CONFIG.read_text() + f"\njetstream {{ max_file_store: {ROOM} }}\n"
    with EmbeddedNats(store_dir=tmp_path / "nats", config=config) as server:
        nc = await connect(Settings(nats_url=server.url), "test")
        yield nc
        await close(nc)


async def _fill(nc: Client) -> int:
    """Write rank tables (an unreserved stream) until the store refuses; how many fit."""
    js = nc.jetstream(timeout=2)
    for job in range(1000):
        try:
            await js.publish(LAYOUT.subjects.ranktable(f"job-{job}"), b"x" * (64 << 10))
        except APIError:
            return job
    raise AssertionError("the store never filled")


async def test_a_full_store_is_one_finding_and_not_ready_until_there_is_room(
    tight: Client, caplog: pytest.LogCaptureFixture
) -> None:
    async with aggregator(tight, LAYOUT, probe_interval=0.1, probe_timeout=1.0) as running:
        service = running.service
        await until(lambda: service.storage.storing)
        assert 0 < await _fill(tight) <= ROOM // (64 << 10)
        await until(lambda: not service.storage.storing)
        health = json.loads((await query(tight, LAYOUT, "health")).data)
        assert health["ready"] is False
        assert "insufficient" in health["storageProblem"]
        await until(lambda: "" in service.findings.incidents)
        diagnosis = decode((await query(tight, LAYOUT, "diagnosis")).data, Diagnosis)
        (finding,) = diagnosis.findings
        assert finding.kind is FindingKind.JETSTREAM_STORAGE
        assert finding.summary.startswith("JetStream not storing since ")
        await tight.jetstream().purge_stream(LAYOUT.ranktable_stream.name)
        await until(lambda: service.storage.storing)
        await until(lambda: "" not in service.findings.incidents)
        assert json.loads((await query(tight, LAYOUT, "health")).data)["ready"] is True
    assert caplog.text.count("JetStream is not storing") == 1


def test_up_on_a_store_too_small_for_its_streams_says_so_in_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable, "-m", "rankscope.services.cli", "up", "--nats-port", "0",
            "--gateway-port", "0", "--grpc-port", "0", "--data-dir", str(tmp_path),
            "--telemetry-max-bytes", str(10**18),
        ],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "rankscope up: JetStream refused stream RANKSCOPE_RUNNER (reserving "
        "1,000,000,000,000,000,000 bytes): insufficient storage resources available; free "
        "space in the server's store, or lower --telemetry-max-bytes"
    ]
