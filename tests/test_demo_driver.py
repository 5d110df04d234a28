"""The demo's driver waits for and counts its own instance, whatever else is placed: a
recorded job that never gets ready does not hold `demo ready` back."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from rankscope.services.stack.demo import DEMO_INSTANCE, _progress
from rankscope.services.stack.terminal import Terminal


def _rank(instance: str, rank: int, status: str | None) -> dict[str, Any]:
    return {"instanceId": instance, "deviceRank": rank, "statusKind": status}


PLACED = [
    _rank(DEMO_INSTANCE, 0, "RunnerReady"),
    _rank(DEMO_INSTANCE, 1, "RunnerReady"),
    *(_rank(f"job-{n}", 0, None) for n in range(500)),  # registered, never reporting
]


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\r\n\r\n")
    body = json.dumps(PLACED).encode()
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    writer.close()


class _Shown(Terminal):
    def __init__(self) -> None:
        super().__init__()
        self.said: list[str] = []

    def status(self, text: str) -> None:
        self.said.append(text)


async def test_the_demo_is_ready_once_its_own_ranks_are() -> None:
    server = await asyncio.start_server(_serve, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    terminal = _Shown()
    async with server:
        ready = await asyncio.wait_for(
            _progress(base, asyncio.Event(), terminal, None, list), timeout=10
        )
    assert ready
    assert terminal.said[-1].endswith("demo instance: rank 0 RunnerReady, rank 1 RunnerReady")
