"""The demo cluster's driver: create a 2-rank Runner spec for the tiny model, wait until
its instance is ready (showing progress), then send a chat completion now and then."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from rankscope.services.stack.terminal import Terminal

__all__ = ["DEMO_RUNNER", "drive"]

log = logging.getLogger("rankscope.demo")

DEMO_RUNNER = "demo"
STATUS_S = 1.0
"""How often the status line is told anew."""
_PROMPTS = ["Which rank is stuck?", "Which node holds layer seven?", "How much memory?"]


async def _http(
    client: httpx.AsyncClient,
    path: str,
    method: str = "GET",
    body: Any = None,
    *,
    patience: float = 120.0,
) -> tuple[int, Any]:
    """Status and JSON of a request to the gateway `client` holds (status 0 and the
    reason when nothing answered)."""
    try:
        reply = await client.request(method, path, json=body, timeout=patience)
    except httpx.HTTPError as error:
        return 0, {"detail": str(error) or type(error).__name__}
    try:
        return reply.status_code, reply.json() if reply.content else None
    except ValueError:
        return reply.status_code, {"detail": reply.text[:200]}


def spec(model: Path) -> dict[str, Any]:
    """The demo's Runner spec: one instance of the tiny model over two ranks."""
    return {
        "id": DEMO_RUNNER,
        "description": "rankscope demo: tiny qwen2 over two ranks",
        "worker": {"model": {"id": "tiny-qwen2"}},
        "nodepool": {"id": "default"},
        "compute_info": {"num_accelerators": 2},
        "num_replicas": 1,
        "min_replicas": 1,
        "metadata": {"modelPath": str(model.resolve())},
    }


DEMO_INSTANCE = f"{DEMO_RUNNER}-0"
"""The demo spec's one instance: what the demo waits for and counts, not recorded jobs or
other specs' instances placed beside it."""


async def _ranks(client: httpx.AsyncClient) -> list[dict[str, Any]]:
    status, placement = await _http(client, "/v1/placement/runners", patience=STATUS_S * 4)
    if status != 200 or not isinstance(placement, list):
        return []
    return [r for r in placement if isinstance(r, dict) and r.get("instanceId") == DEMO_INSTANCE]


def _ready(ranks: list[dict[str, Any]]) -> int:
    return sum(r.get("statusKind") in ("RunnerReady", "RunnerRunning") for r in ranks)


async def _progress(
    client: httpx.AsyncClient,
    stop: asyncio.Event,
    terminal: Terminal,
    unsteady: Callable[[], list[str]],
) -> bool:
    """Show each rank's state (on the status line) until the instance is ready and no
    service is restarting; False if stopped first."""
    while not stop.is_set():
        ranks = await _ranks(client)
        states = ", ".join(
            f"rank {r['deviceRank']} {r.get('statusKind') or 'starting'}" for r in ranks
        )
        restarting = unsteady()
        if restarting:
            states += f"; restarting: {', '.join(restarting)}"
        terminal.status(f"demo instance: {states or 'placing'}")
        if ranks and _ready(ranks) == len(ranks) and not restarting:
            return True
        await asyncio.sleep(0.25)
    return False


@dataclass
class _Tally:
    """What the status line says of the demo's chats."""

    served: int = 0
    failed: int = 0
    last: str = ""

    def line(self, ranks: list[dict[str, Any]], findings: list[dict[str, Any]]) -> str:
        told = "; ".join(_words(f) for f in findings) or "none"
        return (
            f"demo: {_ready(ranks)}/{len(ranks)} ranks ready · {self.served} chats served, "
            f"{self.failed} failed{self.last} · open findings: {told}"
        )


def _words(finding: dict[str, Any]) -> str:
    """One finding in words: `stalled_rank in demo-0 (rank 1)`."""
    where = f"in {finding['instanceId']}" if finding.get("instanceId") else "of the installation"
    ranks = ", ".join(str(r) for r in finding.get("culpritRanks", []))
    return f"{finding['kind']} {where}" + (f" (rank {ranks})" if ranks else "")


async def _findings(client: httpx.AsyncClient) -> list[dict[str, Any]]:
    status, diagnosis = await _http(client, "/v1/cluster/diagnosis", patience=STATUS_S * 4)
    return diagnosis.get("findings", []) if status == 200 and isinstance(diagnosis, dict) else []


async def _keep_status(
    client: httpx.AsyncClient, tally: _Tally, terminal: Terminal, stop: asyncio.Event
) -> None:
    """The status line anew every `STATUS_S`, whatever the chats do (a hung rank holds
    a chat up for as long as it hangs)."""
    while not stop.is_set():
        terminal.status(tally.line(await _ranks(client), await _findings(client)))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), STATUS_S)


async def drive(
    base: str,
    model: Path,
    stop: asyncio.Event,
    terminal: Terminal,
    every: float = 5.0,
    token: str | None = None,
    unsteady: Callable[[], list[str]] = list,
) -> None:
    """Create the spec (if missing), wait for readiness (and for `unsteady`, the services
    restarting, to be none), then keep completions flowing, each told on the status line;
    with the gateway's API `token` when it has one. One client for it all: a client made
    per request took 20 ms of CPU each, most of what `up --demo` spent."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(base_url=base, headers=headers) as client:
        await _serve_chats(client, model, stop, terminal, every, unsteady)


async def _serve_chats(
    client: httpx.AsyncClient,
    model: Path,
    stop: asyncio.Event,
    terminal: Terminal,
    every: float,
    unsteady: Callable[[], list[str]],
) -> None:
    while not stop.is_set():
        status, _ = await _http(client, "/readyz")
        if status == 200:
            break
        await asyncio.sleep(0.2)
    status, _ = await _http(client, f"/v1/runners/{DEMO_RUNNER}")
    if status == 404:
        body = {"runners": [spec(model)]}
        status, reply = await _http(client, "/v1/runners", "POST", body)
        if status not in (200, 409):  # 409: created meanwhile, which is as good
            log.error("could not create the demo runner: %s", reply)
            return
    if not await _progress(client, stop, terminal, unsteady):
        return
    terminal.say(
        f"demo ready: chat completions every {every:g}s; watch them in the timeline at "
        f"{str(client.base_url).rstrip('/')}/"
    )
    count, tally = 0, _Tally()
    telling = asyncio.create_task(_keep_status(client, tally, terminal, stop))
    while not stop.is_set():
        prompt = _PROMPTS[count % len(_PROMPTS)]
        status, reply = await _http(
            client,
            "/v1/chat/completions",
            "POST",
            {
                "model": DEMO_RUNNER,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 24,
            },
        )
        if status == 200:
            tally.served += 1
            tally.last = f" (last: {reply['usage']['completion_tokens']} tokens)"
            log.debug("completion %s: %d tokens", reply["id"], reply["usage"]["completion_tokens"])
            if tally.served == 1:
                terminal.say(
                    f"first reply: {reply['choices'][0]['message']['content'][:60]!r}... "
                    "(gibberish: the demo model has random weights; README: serve a real model)"
                )
        else:
            tally.failed += 1
            log.warning("completion failed (%s): %s", status, (reply or {}).get("detail"))
        count += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every)
    await telling
