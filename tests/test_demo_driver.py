"""The demo's driver: it waits for and counts its own instance, whatever else is placed (a
recorded job that never gets ready does not hold `demo ready` back), and its status line
says each open finding in words every second, while a chat hangs too."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

from rankscope.services.stack.demo import DEMO_INSTANCE, drive
from rankscope.services.stack.terminal import Terminal


def _rank(instance: str, rank: int, status: str | None) -> dict[str, Any]:
    return {"instanceId": instance, "deviceRank": rank, "statusKind": status}


PLACED = [
    _rank(DEMO_INSTANCE, 0, "RunnerReady"),
    _rank(DEMO_INSTANCE, 1, "RunnerReady"),
    *(_rank(f"job-{n}", 0, None) for n in range(500)),  # registered, never reporting
]
STALLED = {"findings": [{"instanceId": DEMO_INSTANCE, "kind": "stalled_rank", "culpritRanks": [1]}]}


class _Gateway:
    """A gateway stand-in on loopback: the demo placed, a finding open, chats that hang."""

    def __init__(self) -> None:
        self.chats = 0
        self._released = asyncio.Event()
        self._serving: set[asyncio.Task[Any]] = set()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if (serving := asyncio.current_task()) is not None:
            self._serving.add(serving)
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
            path = head.split()[1]
            if path.startswith("/v1/chat/completions"):
                self.chats += 1
                await self._released.wait()  # a rank is stopped: the chat waits on it
                return
            body = json.dumps(
                PLACED
                if path.startswith("/v1/placement")
                else STALLED
                if "diagnosis" in path
                else {}
            ).encode()
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                + f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def close(self) -> None:
        """End the chats still waiting and wait for every connection to close: one left
        open when the test's loop closes is a leaked socket another test trips over."""
        self._released.set()
        await asyncio.gather(*self._serving, return_exceptions=True)


class _Shown(Terminal):
    def __init__(self) -> None:
        super().__init__()
        self.said: list[str] = []

    def status(self, text: str) -> None:
        self.said.append(text)

    def say(self, text: str) -> None:
        self.said.append(text)


async def test_the_demo_is_ready_once_its_own_ranks_are_and_tells_findings_while_a_chat_hangs(
    tmp_path: Path,
) -> None:
    gateway = _Gateway()
    server = await asyncio.start_server(gateway.serve, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    terminal, stop = _Shown(), asyncio.Event()
    async with server:
        driving = asyncio.create_task(drive(base, tmp_path, stop, terminal, every=60))
        for _ in range(100):
            if gateway.chats and any("open findings" in s for s in terminal.said):
                break
            await asyncio.sleep(0.1)
        stop.set()
        driving.cancel()
        await gateway.close()
    assert "demo instance: rank 0 RunnerReady, rank 1 RunnerReady" in terminal.said
    assert any(s.startswith("demo ready") for s in terminal.said)
    told = [s for s in terminal.said if "open findings" in s]
    assert told[-1].startswith("demo: 2/2 ranks ready · 0 chats served, 0 failed")
    assert told[-1].endswith("open findings: stalled_rank in demo-0 (rank 1)")
