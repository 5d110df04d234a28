"""A full JetStream store is told apart from a NATS outage and from silent ranks: the
aggregator is not ready, says why in one finding and one log line, and recovers once
there is room again; `up` on a store too small for its streams says so in one line."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.js.errors import APIError

from rankscope.shared.connection import close, connect
from rankscope.shared.jetstream import Layout
from rankscope.shared.nats_server import CONFIG, EmbeddedNats
from rankscope.shared.provision import ensure
from rankscope.shared.settings import Settings
from rankscope.shared.storage import Storage
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


@contextlib.contextmanager
def _small_disk(where: Path, size: str) -> Iterator[Path]:
    """A file system of `size` mounted at `where` (a tmpfs: root only)."""
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)])
    if mounted.returncode != 0:
        pytest.skip("a real full disk needs a tmpfs mounted, which needs root")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def _fill_disk(disk: Path) -> None:
    room = os.statvfs(disk)
    with (disk / "filler").open("wb") as filler:
        os.posix_fallocate(filler.fileno(), 0, room.f_bavail * room.f_frsize)
    assert os.statvfs(disk).f_bavail == 0


async def test_a_disk_that_just_filled_fails_the_very_next_check(tmp_path: Path) -> None:
    """On a real disk the store's files keep slack at their ends: a tiny canary went on
    being stored for ~45 s after every other stream failed, and `/readyz` said ready."""
    config = CONFIG.read_text() + "\njetstream { max_file_store: 2GB }\n"  # the disk is less
    with (
        _small_disk(tmp_path / "disk", "24m") as disk,
        EmbeddedNats(store_dir=disk / "nats", config=config) as server,
    ):
        nc = await connect(Settings(nats_url=server.url), "test")
        try:
            js = nc.jetstream(timeout=2)
            await ensure(js, LAYOUT)
            storage = Storage(js, LAYOUT.subjects.canary("test"), timeout=1.0)
            assert await storage.check()
            _fill_disk(disk)
            with pytest.raises((APIError, TimeoutError)):  # no rank table is stored now
                await js.publish(LAYOUT.subjects.ranktable("job"), os.urandom(64 << 10))
            assert not await storage.check()
            assert storage.why().startswith("JetStream not storing since ")
        finally:
            await close(nc)
