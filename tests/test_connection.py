"""A NATS link that dies without a word (no FIN, no RST: a cable pulled, a NAT entry gone)
is noticed by the services' pings and reconnected once the path is back; a server that
stops answering for a while (paused) is told from a working one, and the link survives;
a connection the server closes for good ends the service that holds it."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import nats
import pytest
from nats.js.api import StorageType

from rankscope.services.aggregator.findings import bus_outage
from rankscope.services.aggregator.liveness import Liveness
from rankscope.services.aggregator.rules import Thresholds
from rankscope.services.aggregator.store import EntryStore
from rankscope.services.aggregator.views import ClusterState
from rankscope.shared.connection import ConnectionLostError, Lifeline, Reachability, close, connect
from rankscope.shared.deadletter import DeadLetters
from rankscope.shared.jetstream import Layout
from rankscope.shared.settings import Settings
from rankscope.shared.storage import Storage
from rankscope.shared.wire import FindingKind
from tests.aggregator.builders import core_of

pytestmark = pytest.mark.nats

WAIT = 20.0


class SilentLink:
    """A TCP relay to NATS that can go silent: while silent it swallows every byte both
    ways and keeps the sockets open, as a dead path looks to both ends. While `flowing` is
    clear it holds every byte instead, and delivers them once it is set: a paused server."""

    def __init__(self, upstream: str) -> None:
        address = urlsplit(upstream)
        self._host, self._port = address.hostname or "127.0.0.1", address.port or 4222
        self.silent = False
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.url = ""
        self._pipes: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        while data := await source.read(65536):
            await self.flowing.wait()
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


async def test_a_server_that_stops_answering_is_unreachable_until_it_answers_again(
    nats_url: str,
) -> None:
    async with SilentLink(nats_url).running() as link:
        settings = Settings(nats_url=link.url, nats_ping_interval=60)  # no reconnect here
        nc = await connect(settings, "paused")
        reach = Reachability(nc, timeout=0.3)
        assert await reach.check()
        assert reach.why() == ""
        link.flowing.clear()
        assert not await reach.check()
        assert not await reach.check()  # the ping in flight is awaited, not sent again
        assert reach.why().startswith("NATS unreachable since ")
        assert nc.is_connected, "nats-py alone sees nothing wrong"
        link.flowing.set()  # the late answers arrive: the link must survive them
        for _ in range(50):
            if await reach.check():
                break
            await asyncio.sleep(0.1)
        assert reach.reachable
        assert reach.outages == 1
        reply = await nc.request("$JS.API.INFO", b"", timeout=2)
        assert b"memory" in reply.data
        await close(nc)


async def test_a_server_paused_between_a_ping_and_a_write_is_an_outage_of_nats_alone(
    nats_url: str,
) -> None:
    """Paused just after a ping answered, the server fails the JetStream write first: that
    is NATS out, not JetStream, and once NATS is back the write that failed meanwhile says
    nothing of JetStream (an outage named twice, the second falsely, before)."""
    async with SilentLink(nats_url).running() as link:
        nc = await connect(Settings(nats_url=link.url, nats_ping_interval=60), "paused-write")
        js, canary = nc.jetstream(), f"canary.{uuid.uuid4().hex}"
        stream = canary.replace(".", "-")
        await js.add_stream(name=stream, subjects=[canary], storage=StorageType.MEMORY)
        reach, storage = Reachability(nc, timeout=0.3), Storage(js, canary, timeout=0.3)
        liveness = Liveness(
            nc=nc,
            layout=Layout(),
            core=core_of(ClusterState(store=EntryStore()), Thresholds()),
            reach=reach,
            storage=storage,
            dead_letters=DeadLetters(js=js, subject=f"{canary}.dead", service="test"),
            probe_timeout=0.3,
            clock=time.monotonic,
            wall=time.time,
        )
        await liveness.probe()
        assert bus_outage(reach, storage) is None
        link.flowing.clear()
        assert not await storage.check()
        assert bus_outage(reach, storage) is None, "no ping has said whose outage it is yet"
        await liveness.probe()
        outage = bus_outage(reach, storage)
        assert outage is not None
        assert outage[0] is FindingKind.NATS_UNREACHABLE, outage
        link.flowing.set()
        for _ in range(50):
            if await reach.check():
                break
            await asyncio.sleep(0.1)
        assert bus_outage(reach, storage) is None
        await liveness.probe()
        assert bus_outage(reach, storage) is None
        assert storage.storing
        await close(nc)


async def test_a_jetstream_that_stops_storing_while_nats_answers_is_its_outage(
    nats_url: str,
) -> None:
    nc = await connect(Settings(nats_url=nats_url), "unstored")
    js, canary = nc.jetstream(), f"canary.{uuid.uuid4().hex}"
    reach, storage = Reachability(nc, timeout=0.3), Storage(js, canary, timeout=0.3)
    assert await reach.check()
    assert not await storage.check()  # no stream takes the canary's subject
    assert bus_outage(reach, storage) is None
    assert await reach.check()
    outage = bus_outage(reach, storage)
    assert outage is not None
    assert outage[0] is FindingKind.JETSTREAM_STORAGE, outage
    assert outage[2].startswith("JetStream not storing since "), outage
    await close(nc)


async def test_a_connection_the_server_drops_for_good_stops_the_service(nats_url: str) -> None:
    stop = asyncio.Event()
    lifeline = Lifeline(stop)
    nc = await connect(Settings(nats_url=nats_url), "dropped", on_lost=lifeline)
    await nc.publish("x" * 5000, b"")  # the server drops a client for this line
    await asyncio.wait_for(stop.wait(), WAIT)
    assert nc.is_closed, "nats-py does not reconnect after a protocol error"
    with pytest.raises(ConnectionLostError, match=r"(?i)maximum control line"), lifeline:
        pass  # the service has stopped: leaving its lifeline fails it


async def test_a_call_that_finds_the_client_closed_fails_the_lifeline_before_its_callback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stop = asyncio.Event()
    lifeline = Lifeline(stop)
    # a publish on a client the server closed can raise before nats-py's closed callback ran
    with pytest.raises(ConnectionLostError, match="closed for good"), lifeline:
        raise nats.errors.ConnectionClosedError
    assert "closed for good" in caplog.text


async def test_an_error_on_a_client_the_server_closed_fails_the_lifeline_as_it_stops(
    nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    lifeline = Lifeline(asyncio.Event())
    nc = await connect(Settings(nats_url=nats_url), "dropped")  # no callback tells the lifeline
    await nc.publish("x" * 5000, b"")
    deadline = time.monotonic() + WAIT
    while not nc.is_closed:
        assert time.monotonic() < deadline, "the server did not drop the client"
        await asyncio.sleep(0.05)

    async def serve() -> None:
        async with contextlib.AsyncExitStack() as stack:  # as `lifecycle.connected` stacks them
            stack.enter_context(lifeline)
            stack.push_async_callback(lifeline.close, nc)
            raise RuntimeError("unable to perform operation on <TCPTransport closed=True>")

    with pytest.raises(ConnectionLostError, match=r"(?i)maximum control line"):
        await serve()
    assert "closed for good" in caplog.text


async def test_closing_a_connection_on_purpose_is_no_loss(nats_url: str) -> None:
    stop = asyncio.Event()
    with Lifeline(stop) as lifeline:
        nc = await connect(Settings(nats_url=nats_url), "closed", on_lost=lifeline)
        await close(nc)
        other = await connect(Settings(nats_url=nats_url), "stopping", on_lost=lifeline)
        await lifeline.close(other)
        await asyncio.sleep(0.2)
    assert not stop.is_set()
    assert lifeline.reason is None
