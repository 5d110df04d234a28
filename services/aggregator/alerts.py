"""Every open finding as an Alertmanager alert, from its opening to its clearing.

Alertmanager expects a sender to post its firing alerts again and again (each with an
`endsAt` a few periods ahead, so the alerts of a sender that died resolve by themselves)
and to post a resolved alert with its `endsAt` once. An incident is one alert: its labels
hold its `incidentId`, which an aggregator that restarts takes up with the incident.
Nothing is lost while Alertmanager is down: what it did not take is posted again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote

import httpx

from rankscope.shared.signatures import FaultHistory
from rankscope.shared.timestamps import format_ts, parse_ts
from rankscope.shared.wire import Finding, FindingKind, SeenBefore

__all__ = ["RESEND_S", "Alerter", "alert"]

log = logging.getLogger(__name__)

RESEND_S = 15.0
"""How often firing alerts are posted again."""
ENDS_AFTER = 4
"""Resend periods a firing alert stays firing without another post (as Prometheus does)."""
POST_TIMEOUT_S = 5.0
"""The whole of one post, answer included: a server that trickles holds up nobody."""
ANSWER_BYTES = 4096
"""How much of an answer is read (to say why a post was refused); the rest is dropped."""

_SEVERITY = {
    FindingKind.DEAD_RANK: "critical",
    FindingKind.STALLED_RANK: "critical",
    FindingKind.NATS_UNREACHABLE: "critical",
    FindingKind.JETSTREAM_STORAGE: "critical",
    FindingKind.RANK_DISAGREEMENT: "warning",
    FindingKind.MISSING_DATA: "warning",
}


def _ranks(finding: Finding, culprits: bool) -> str:
    named = set(finding.culpritRunnerIds)
    return "; ".join(
        f"rank {e.deviceRank} on {e.nodeId}"
        + (f" ({e.phase.value})" if e.phase else "")
        + (f", waiting in {e.waitingIn}" if e.waitingIn and not culprits else "")
        for e in finding.evidence
        if (e.runnerId in named) == culprits
    )


def alert(
    finding: Finding, link: str, now: datetime, seen: SeenBefore | None = None
) -> dict[str, Any]:
    """The Alertmanager v2 alert of `finding` at `now`: firing while it is open (ending
    a few resend periods ahead unless posted again), resolved once it cleared; `seen`, the
    incidents of the same fault before it."""
    culprits = [e for e in finding.evidence if e.runnerId in finding.culpritRunnerIds]
    ends = (
        parse_ts(finding.clearedAt)
        if not finding.open and finding.clearedAt
        else now + timedelta(seconds=RESEND_S * ENDS_AFTER)
    )
    if not finding.open and ends > now:
        ends = now
    labels = {
        "alertname": "Rankscope" + "".join(w.title() for w in finding.kind.value.split("_")),
        "kind": finding.kind.value,
        "severity": _SEVERITY.get(finding.kind, "warning"),
        "instance": finding.instanceId or "(installation)",
        "culprit_rank": ",".join(map(str, finding.culpritRanks)),
        "culprit_node": ",".join(sorted({e.nodeId for e in culprits})),
        "incident_id": finding.key,
    }
    return {
        "labels": {k: v for k, v in labels.items() if v},
        "annotations": {
            "summary": finding.summary[:1000],
            "culprits": _ranks(finding, culprits=True),
            "victims": _ranks(finding, culprits=False),
            "url": link,
            **(
                {
                    "seen_before": f"seen {seen.count} times before, first at {seen.first}, "
                    f"last at {seen.last}"
                }
                if seen
                else {}
            ),
        },
        "startsAt": finding.since,
        "endsAt": format_ts(ends),
        "generatorURL": link,
    }


class Alerter:
    """The findings one aggregator alerts for, posted to every Alertmanager of `urls`.

    Args:
        urls: Alertmanager base URLs (`http://host:9093`), with user and password in them
            for basic auth.
        token: a bearer token sent with every post, if set.
        link: where an operator reads an incident (`{instance}` and `{incident}` in it
            replaced by their ids, each made safe for a URL; nothing else is read in it).
        history: the incidents seen before (how often an alert's fault was).
        wall: seconds since the epoch (`time.time`, or a virtual clock).
    """

    def __init__(
        self,
        urls: Sequence[str],
        token: str | None,
        link: str,
        history: FaultHistory | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._wall = wall
        """Seconds since the epoch, read as each round of posts is made."""
        self._history = history or FaultHistory()
        """Every incident seen: how often an alert's fault was seen before."""
        self._urls = [u.rstrip("/") for u in urls]
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._link = link
        self._firing: dict[str, Finding] = {}
        """Open findings by incident, posted every period."""
        self._resolving: dict[tuple[str, str], Finding] = {}
        """Cleared findings not yet taken, by (Alertmanager, incident)."""
        self._wake = asyncio.Event()

    def remember(self, findings: Sequence[Finding]) -> None:
        """Note incidents of the past (their last words), for how often a fault was seen."""
        for finding in findings:
            self._history.add(finding)

    def update(self, changed: Sequence[Finding], cleared: Sequence[Finding]) -> None:
        """Note what the diagnosis said this turn; what changed is posted at once."""
        self.remember([*changed, *cleared])
        for finding in changed:
            self._firing[_key(finding)] = finding
        for finding in cleared:
            self._firing.pop(_key(finding), None)
            for url in self._urls:
                self._resolving[(url, _key(finding))] = finding
        if changed or cleared:
            self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Post every period, and at once when something changed, until `stop`; no error
        ends it."""
        async with httpx.AsyncClient(timeout=POST_TIMEOUT_S, headers=self._headers) as client:
            while not stop.is_set():
                self._wake.clear()
                try:
                    await self._post_all(client)
                except Exception:  # the next period tries again; alerts never stop for good
                    log.exception("posting alerts failed")
                waiting = asyncio.ensure_future(self._wake.wait())
                stopping = asyncio.ensure_future(stop.wait())
                await asyncio.wait(
                    {waiting, stopping}, timeout=RESEND_S, return_when=asyncio.FIRST_COMPLETED
                )
                waiting.cancel()
                stopping.cancel()

    async def _post_all(self, client: httpx.AsyncClient) -> None:
        now = datetime.fromtimestamp(self._wall(), UTC)
        await asyncio.gather(*(self._post(client, url, now) for url in self._urls))

    async def _post(self, client: httpx.AsyncClient, url: str, now: datetime) -> None:
        """Post to one Alertmanager within `POST_TIMEOUT_S`, whatever the others do."""
        resolved = [(k, f) for (u, k), f in self._resolving.items() if u == url]
        body = [self._alert(f, now) for f in self._firing.values()]
        body += [self._alert(f, now) for _, f in resolved]
        if not body:
            return
        try:
            async with asyncio.timeout(POST_TIMEOUT_S):
                refused = await _refusal(client, f"{url}/api/v2/alerts", body)
        except (httpx.HTTPError, TimeoutError) as exc:
            refused = f"{type(exc).__name__} {exc}".strip()
        if refused is not None:  # posted again next period, the resolved ones too
            log.warning(
                "Alertmanager %s did not take %d alerts: %s",
                _shown(url),
                len(body),
                _hidden(refused, url),
            )
            return
        for key, _ in resolved:
            self._resolving.pop((url, key), None)

    def _alert(self, finding: Finding, now: datetime) -> dict[str, Any]:
        link = self._link.replace("{instance}", quote(finding.instanceId, safe="")).replace(
            "{incident}", quote(_key(finding), safe="")
        )
        return alert(finding, link, now, self._history.before(finding))


async def _refusal(client: httpx.AsyncClient, url: str, body: list[dict[str, Any]]) -> str | None:
    """Why `url` did not take `body` (None: it did), reading no more of its answer than
    `ANSWER_BYTES`."""
    async with client.stream("POST", url, json=body) as answer:
        if answer.is_success:
            return None
        said = b""
        async for chunk in answer.aiter_raw():
            said += chunk
            if len(said) >= ANSWER_BYTES:
                break
        return f"{answer.status_code} {said[:200].decode(errors='replace').strip()}"


def _shown(url: str) -> str:
    """`url` without the user and password in it."""
    parsed = httpx.URL(url)
    return str(parsed.copy_with(username=None, password=None)) if parsed.userinfo else url


def _hidden(text: str, url: str) -> str:
    """`text` with `url`'s password, if any, put out of sight."""
    password = httpx.URL(url).password
    return text.replace(password, "***") if password else text


def _key(finding: Finding) -> str:
    return finding.key
