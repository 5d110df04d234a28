"""Findings page an operator through a real Alertmanager: one alert per incident from its
opening to its clearing, across a restart of the aggregator and an Alertmanager that was
down."""

from __future__ import annotations

import asyncio
import logging
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from nats.aio.client import Client

from rankscope.services.aggregator import alerts
from rankscope.services.aggregator.alerts import Alerter
from rankscope.services.aggregator.diagnosis import Thresholds
from rankscope.shared.jetstream import Layout
from rankscope.shared.settings import SettingsError, load
from rankscope.shared.timestamps import now
from rankscope.shared.wire import Finding, FindingKind, Phase
from tests.agents_stand_in import answer_probes
from tests.aggregator.builders import entries, placed, rank
from tests.aggregator.running import aggregator, publish

pytestmark = [pytest.mark.nats, pytest.mark.timeout(120)]

BINARY = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
CONFIG = """
route:
  receiver: nobody
  group_wait: 0s
receivers:
  - name: nobody
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Manager:
    """One Alertmanager process on loopback, stopped and started again at will."""

    def __init__(self, root: Path) -> None:
        assert BINARY is not None
        self.root, self.port = root, _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        (root / "alertmanager.yml").write_text(CONFIG)
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        assert BINARY is not None
        self.process = subprocess.Popen(
            [
                BINARY,
                f"--config.file={self.root / 'alertmanager.yml'}",
                f"--storage.path={self.root / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--cluster.listen-address=",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
            self.process = None

    async def alerts(self) -> list[dict[str, Any]]:
        """The active alerts (none while it does not answer yet)."""
        try:
            async with httpx.AsyncClient(timeout=2) as client:
                reply = await client.get(f"{self.url}/api/v2/alerts", params={"active": "true"})
        except httpx.HTTPError:
            return []
        return [a for a in reply.json() if a["status"]["state"] == "active"]


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[Manager]:
    if BINARY is None:
        pytest.skip("Alertmanager is not installed here (Debian's prometheus-alertmanager)")
    running = Manager(tmp_path)
    running.start()
    yield running
    running.stop()


async def _until(check: Any, seconds: float = 30.0) -> Any:
    for _ in range(int(seconds / 0.1)):
        if found := await check():
            return found
        await asyncio.sleep(0.1)
    raise AssertionError("not reached in time")


@pytest.fixture(autouse=True)
def _short_periods(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(alerts, "RESEND_S", 0.5)  # a resend period, scaled down


@pytest.fixture
async def disagreeing(nc: Client, js_ready: Layout) -> None:
    """Two live ranks of instance i, rank 0 held a step behind rank 1."""
    await answer_probes(nc, js_ready, placed())
    await publish(nc, js_ready, placed())
    await publish(nc, js_ready, entries(rank(0), (0, 1, Phase.PREFILL_PIPELINE, 7)))
    await publish(nc, js_ready, entries(rank(1), (0, 1, Phase.DECODE_BARRIER, 8)))


@pytest.mark.usefixtures("disagreeing")
async def test_an_incident_is_one_alert_across_a_restart_resolved_once(
    nc: Client, js_ready: Layout, manager: Manager
) -> None:
    limits = Thresholds(working=1.0)

    def alerter() -> Alerter:
        return Alerter([manager.url], None, "http://gateway:8000/incidents?of={instance}")

    async def disagreements() -> list[dict[str, Any]]:
        """The incident's alerts (NATS slow to answer a ping on a loaded machine is an
        outage of its own, alerted apart)."""
        found = await manager.alerts()
        return [a for a in found if a["labels"]["alertname"] == "RankscopeRankDisagreement"]

    async with aggregator(nc, js_ready, thresholds=limits, alerter=alerter()):
        (firing,) = await _until(disagreements)
    labels = firing["labels"]
    assert labels["alertname"] == "RankscopeRankDisagreement"
    assert (labels["instance"], labels["culprit_rank"], labels["culprit_node"]) == (
        "i",
        "0",
        "node-0",
    )
    assert (labels["kind"], labels["severity"]) == ("rank_disagreement", "warning")
    assert labels["incident_id"]
    assert "rank 0 (node-0) held in prefill_pipeline" in firing["annotations"]["summary"]
    assert firing["annotations"]["url"] == "http://gateway:8000/incidents?of=i"
    async with aggregator(nc, js_ready, thresholds=limits, alerter=alerter()):
        await asyncio.sleep(2.0)  # posted again and again by the restarted aggregator
        assert [a["fingerprint"] for a in await disagreements()] == [firing["fingerprint"]]
        await publish(nc, js_ready, entries(rank(0), (1, 2, Phase.DECODE_BARRIER, 8)))

        async def resolved() -> bool:
            return not await disagreements()

        await _until(resolved)


@pytest.mark.usefixtures("disagreeing")
async def test_an_alert_raised_while_alertmanager_is_down_is_posted_once_it_is_back(
    nc: Client, js_ready: Layout, manager: Manager
) -> None:
    manager.stop()
    limits = Thresholds(working=1.0)
    alerter = Alerter([manager.url], None, "http://gateway:8000/{instance}")
    async with aggregator(nc, js_ready, thresholds=limits, alerter=alerter) as running:
        await _until(lambda: asyncio.sleep(0, running.service.findings.incidents))
        manager.start()
        (firing,) = await _until(manager.alerts)
        assert firing["labels"]["instance"] == "i"


@pytest.mark.usefixtures("disagreeing")
async def test_an_alert_says_how_often_its_fault_was_seen_before(
    nc: Client, js_ready: Layout, manager: Manager
) -> None:
    alerter = Alerter([manager.url], None, "http://gateway:8000/{incident}")
    async with aggregator(nc, js_ready, thresholds=Thresholds(working=1.0), alerter=alerter):
        (first,) = await _until(manager.alerts)
        assert "seen_before" not in first["annotations"]
        await publish(nc, js_ready, entries(rank(0), (1, 2, Phase.DECODE_BARRIER, 8)))

        async def resolved() -> bool:
            return not await manager.alerts()

        await _until(resolved)
        # the same hang again, a few steps on
        await publish(nc, js_ready, entries(rank(0), (2, 3, Phase.PREFILL_PIPELINE, 9)))
        await publish(nc, js_ready, entries(rank(1), (1, 3, Phase.DECODE_BARRIER, 10)))
        (again,) = await _until(manager.alerts)
    assert again["labels"]["incident_id"] != first["labels"]["incident_id"]
    assert again["annotations"]["seen_before"].startswith("seen 1 times before, first at ")


class Hostile:
    """An HTTP server on loopback that answers every post by trickling a byte every
    `pause` seconds (`huge` false), or with a 500 and an endless body (`huge`)."""

    def __init__(self, *, huge: bool, pause: float = 0.2) -> None:
        self.huge, self.pause = huge, pause
        self.sent = 0
        self.posts = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://admin:s3cret-pw@127.0.0.1:{port}"

    async def __aexit__(self, *_: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            self.posts += 1
            if self.huge:
                writer.write(b"HTTP/1.1 500 Oops\r\ncontent-length: 300000000\r\n\r\n")
                chunk = b"x" * 65536
                while self.sent < 300_000_000:
                    writer.write(chunk)
                    await writer.drain()
                    self.sent += len(chunk)
            for byte in b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}":
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(self.pause)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


def _finding() -> Finding:
    return Finding(
        instanceId="i",
        kind=FindingKind.STALLED_RANK,
        culpritRanks=[0],
        culpritRunnerIds=["i-r0"],
        summary="rank 0 is stuck",
        since=now(),
        incidentId="inc-1",
    )


async def test_a_slow_or_huge_answering_alertmanager_holds_up_no_other_and_leaks_no_password(
    manager: Manager, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(alerts, "POST_TIMEOUT_S", 1.0)
    caplog.set_level(logging.WARNING, logger=alerts.__name__)
    async with Hostile(huge=False) as slow, (huge := Hostile(huge=True)) as flood:
        alerter = Alerter([slow, flood, manager.url], None, "http://gw/{x}/{incident}")
        alerter.update([_finding()], [])
        stop = asyncio.Event()
        running = asyncio.create_task(alerter.run(stop))
        (firing,) = await _until(manager.alerts, seconds=20)
        await _until(lambda: asyncio.sleep(0, "500 xxxx" in caplog.text), seconds=10)
        await _until(lambda: asyncio.sleep(0, "TimeoutError" in caplog.text), seconds=10)
        stop.set()
        await running
    assert firing["annotations"]["url"] == "http://gw/{x}/inc-1"  # braces of its own stay
    assert huge.sent < 64 << 20  # what socket buffers took, not the 300 MB offered
    assert "s3cret-pw" not in caplog.text
    assert "admin:***@127.0.0.1" not in caplog.text


async def test_an_error_in_one_round_of_posts_ends_no_alerting(
    manager: Manager, monkeypatch: pytest.MonkeyPatch
) -> None:
    failing = iter([RuntimeError("a bug in one round")])
    real = alerts.alert

    def alert_once_broken(*args: Any, **kwargs: Any) -> dict[str, Any]:
        if (error := next(failing, None)) is not None:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(alerts, "alert", alert_once_broken)
    alerter = Alerter([manager.url], None, "http://gw/{incident}")
    alerter.update([_finding()], [])
    stop = asyncio.Event()
    running = asyncio.create_task(alerter.run(stop))
    (firing,) = await _until(manager.alerts, seconds=20)
    stop.set()
    await running
    assert firing["labels"]["incident_id"] == "inc-1"


@pytest.mark.parametrize(
    "given", ["http://host:1:2", "http://[::1", "ftp://am:9093", "http://admin:pw@am:1:2"]
)
def test_an_alertmanager_url_the_client_cannot_read_stops_start_up_in_one_line(
    given: str,
) -> None:
    with pytest.raises(SettingsError) as refused:
        load({}, {"RANKSCOPE_ALERTMANAGER_URL": f"http://ok:9093,{given}"})
    said = str(refused.value)
    assert said.startswith("RANKSCOPE_ALERTMANAGER_URL: expected an http(s)://host:port URL")
    assert "\n" not in said
    assert ":pw@" not in said
