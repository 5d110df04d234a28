"""The demo cluster's driver: create a 2-rank Runner spec for the tiny model, wait until
its instance is ready (showing progress), then send a chat completion now and then."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

__all__ = ["DEMO_RUNNER", "drive"]

log = logging.getLogger("rankscope.demo")

DEMO_RUNNER = "demo"
_PROMPTS = ["Which rank is stuck?", "Which node holds layer seven?", "How much memory?"]


async def _http(
    url: str, method: str = "GET", body: Any = None, *, token: str | None = None
) -> tuple[int, Any]:
    """Status and JSON of a request (status 0 and the reason when nothing answered)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        async with httpx.AsyncClient(headers=headers, timeout=120) as client:
            reply = await client.request(method, url, json=body)
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


async def _progress(
    base: str, stop: asyncio.Event, token: str | None, unsteady: Callable[[], list[str]]
) -> bool:
    """Show each rank's state (a live line on a terminal) until the instance is ready and
    no service is restarting; False if stopped first."""
    with Console().status("demo instance: placing") as shown:
        while not stop.is_set():
            status, placement = await _http(f"{base}/v1/placement/runners", token=token)
            ranks = placement if status == 200 and isinstance(placement, list) else []
            ready = [r for r in ranks if r.get("statusKind") in ("RunnerReady", "RunnerRunning")]
            states = ", ".join(
                f"rank {r['deviceRank']} {r.get('statusKind') or 'starting'}" for r in ranks
            )
            restarting = unsteady()
            if restarting:
                states += f"; restarting: {', '.join(restarting)}"
            shown.update(f"demo instance: {states or 'placing'}")
            if ranks and len(ready) == len(ranks) and not restarting:
                return True
            await asyncio.sleep(0.25)
    return False


async def drive(
    base: str,
    model: Path,
    stop: asyncio.Event,
    every: float = 5.0,
    token: str | None = None,
    unsteady: Callable[[], list[str]] = list,
) -> None:
    """Create the spec (if missing), wait for readiness (and for `unsteady`, the services
    restarting, to be none), then keep completions flowing; with the gateway's API `token`
    when it has one."""
    while not stop.is_set():
        status, _ = await _http(f"{base}/readyz")
        if status == 200:
            break
        await asyncio.sleep(0.2)
    status, _ = await _http(f"{base}/v1/runners/{DEMO_RUNNER}", token=token)
    if status == 404:
        body = {"runners": [spec(model)]}
        status, reply = await _http(f"{base}/v1/runners", "POST", body, token=token)
        if status not in (200, 409):  # 409: created meanwhile, which is as good
            log.error("could not create the demo runner: %s", reply)
            return
    if not await _progress(base, stop, token, unsteady):
        return
    print(
        f"demo ready: chat completions every {every:g}s; watch them in the timeline at {base}/",
        flush=True,
    )
    count = 0
    while not stop.is_set():
        prompt = _PROMPTS[count % len(_PROMPTS)]
        status, reply = await _http(
            f"{base}/v1/chat/completions",
            "POST",
            {
                "model": DEMO_RUNNER,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 24,
            },
            token=token,
        )
        if status == 200:
            log.info("completion %s: %d tokens", reply["id"], reply["usage"]["completion_tokens"])
        else:
            log.warning("completion failed (%s): %s", status, (reply or {}).get("detail"))
        count += 1
        try:
            await asyncio.wait_for(stop.wait(), every)
        except TimeoutError:
            continue
