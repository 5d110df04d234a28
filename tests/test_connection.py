"""A NATS link that dies without a word (no FIN, no RST: a cable pulled, a NAT entry gone)
is noticed by the services' pings and reconnected once the path is back."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import pytest

from shared.connection import close, connect
from shared.settings import Settings

pytestmark = pytest.mark.nats

WAIT = 20.0


class SilentLink:
    """A TCP relay to NATS that can go silent: while silent it swallows every byte both
    ways and keeps the sockets open, as a dead path looks to both ends."""

    def __init__(self, upstream: str) -> None:
        address = urlsplit(upstream)
        self._host, self._port = address.hostname or "127.0.0.1", address.port or 4222
        self.silent = False
        self.url = ""
        self._pipes: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        while data := await source.read(65536):
            if not self.silent:
                sink.write(data)
                await sink.drain()
        sink.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(self._host, self._port)
        self._writers += [writer, up_writer]
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            pipe = asyncio.create_task(self._pipe(source, sink))
            self._pipes.add(pipe)
            pipe.add_done_callback(self._pipes.discard)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[SilentLink]:
        server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.url = f"nats://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with server:
            yield self
            for pipe in list(self._pipes):
                pipe.cancel()
            for writer in self._writers:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()


async def test_a_silently_dead_link_is_dropped_and_reconnected(nats_url: str) -> None:
    async with SilentLink(nats_url).running() as link:
        lost, back = asyncio.Event(), asyncio.Event()

        async def on_lost() -> None:
            lost.set()

        async def on_back() -> None:
            back.set()

        settings = Settings(nats_url=link.url, nats_ping_interval=0.3)
        nc = await connect(settings, "silent", disconnected_cb=on_lost, reconnected_cb=on_back)
        await nc.request("$JS.API.INFO", b"", timeout=2)  # a working link
        link.silent = True
        await asyncio.wait_for(lost.wait(), WAIT)  # noticed, though no byte said so
        link.silent = False
        await asyncio.wait_for(back.wait(), WAIT)
        reply = await nc.request("$JS.API.INFO", b"", timeout=2)
        assert b"memory" in reply.data
        await close(nc)
