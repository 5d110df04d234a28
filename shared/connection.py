"""Connect to NATS with the settings' servers, credentials and TLS."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import nats
from nats.aio.client import Client

from rankscope.shared.nats_auth import inbox_prefix
from rankscope.shared.settings import Settings
from rankscope.shared.timestamps import now

__all__ = [
    "REACH_CHECK_S",
    "ConnectionLostError",
    "Lifeline",
    "Reachability",
    "close",
    "connect",
    "keep_checking",
    "slow_consumer_drops",
    "unless_stopped",
]

log = logging.getLogger(__name__)

DRAIN_S = 5.0
"""How long closing waits for the server to take what the client still holds."""
_LOST_POLL_S = 0.05
"""How often a drain looks whether its server is still there."""

_drops = [0]


def slow_consumer_drops() -> int:
    """Messages this process's NATS clients dropped because a subscription's queue was
    full. Always 0 unless something is wrong: followers pull only what they can hold."""
    return _drops[0]


def _tls(settings: Settings) -> ssl.SSLContext | None:
    if settings.nats_tls_ca is None and settings.nats_tls_cert is None:
        return None
    context = ssl.create_default_context(
        cafile=str(settings.nats_tls_ca) if settings.nats_tls_ca else None
    )
    if settings.nats_tls_cert is not None:
        context.load_cert_chain(
            str(settings.nats_tls_cert),
            str(settings.nats_tls_key) if settings.nats_tls_key else None,
        )
    return context


async def _error(error: Exception) -> None:
    if isinstance(error, nats.errors.SlowConsumerError):
        _drops[0] += 1
        if _drops[0] & (_drops[0] - 1):
            return  # logged at the 1st, 2nd, 4th, 8th ... drop, not once per message
        log.error("NATS dropped a message for a slow subscription (%d so far)", _drops[0])
        return
    log.warning("NATS: %s", error or type(error).__name__)


async def _reconnected() -> None:
    log.info("NATS reconnected")


MAX_OUTSTANDING_PINGS = 3
"""Pings without an answer after which a link counts as dead and is reconnected: a link
that vanished without a FIN is noticed in about this many ping intervals."""


class ConnectionLostError(RuntimeError):
    """The NATS client closed for good while the service still needed it."""


class Lifeline:
    """Ends a service whose NATS client closed for good.

    nats-py reconnects after a lost link, but closes for good when the server drops it
    with a protocol error (a control line over 4 KiB, revoked credentials). A service left
    so would answer nothing until restarted by hand; instead `stop` is set, and leaving the
    `with` block (once the service has stopped) raises, so it exits non-zero and its
    supervisor starts it afresh.

    Example:
        with Lifeline(stop) as lifeline:
            nc = await connect(settings, "rankscope-aggregator", on_lost=lifeline)
    """

    def __init__(self, stop: asyncio.Event) -> None:
        self._stop = stop
        self.reason: str | None = None
        """Why the connection closed, once it has."""

    def __call__(self, reason: str) -> None:
        self.reason = reason
        self._stop.set()

    def __enter__(self) -> Lifeline:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        """Raises:
        ConnectionLostError: the connection closed for good, also when a call on the
            closed client raised before nats-py's closed callback ran.
        """
        if self.reason is None and isinstance(exc, nats.errors.ConnectionClosedError):
            self.reason = "the NATS connection closed for good"
            log.error("%s; stopping so that this service is restarted", self.reason)
        if self.reason is not None:
            raise ConnectionLostError(self.reason) from exc

    async def close(self, nc: Client) -> None:
        """Close `nc` as the service stops. A client closed already, not by `close`, was
        lost (whatever a call on it raised before nats-py's closed callback ran)."""
        if self.reason is None and nc.is_closed and nc not in _closing:
            self.reason = _lost(nc)
            log.error("%s; stopping so that this service is restarted", self.reason)
        await close(nc)


def _lost(nc: Client) -> str:
    return f"the NATS connection closed for good: {nc.last_error or 'by the server'}"


_closing: weakref.WeakSet[Client] = weakref.WeakSet()
"""Clients being closed by `close`, whose closing is no loss."""


async def connect(
    settings: Settings,
    name: str,
    *,
    on_lost: Callable[[str], None] | None = None,
    **options: Any,
) -> Client:
    """Connect as client `name`, reconnecting forever once connected; connection trouble
    is logged in one line each, not as tracebacks. `on_lost(reason)` is called if the
    client closes for good other than through `close` (e.g. a `Lifeline`).

    Raises:
        nats.errors.NoServersError: no server answered the first connect.
    """
    nc = Client()
    connected = False

    async def disconnected() -> None:
        if nc not in _closing:
            log.warning("NATS disconnected; reconnecting")

    async def closed() -> None:
        if on_lost is None or not connected or nc in _closing:
            return  # a first connect that failed raises instead
        reason = _lost(nc)
        log.error("%s; stopping so that this service is restarted", reason)
        on_lost(reason)

    options.setdefault("error_cb", _error)
    options.setdefault("disconnected_cb", disconnected)
    options.setdefault("reconnected_cb", _reconnected)
    options.setdefault("closed_cb", closed)
    if settings.nats_user:
        options.setdefault("inbox_prefix", inbox_prefix(settings.nats_user))
    # seconds, annotated `int` by nats-py but used as floats
    options.update(reconnect_time_wait=0.5, ping_interval=settings.nats_ping_interval)
    await nc.connect(
        servers=settings.nats_servers,
        name=name,
        user=settings.nats_user,
        password=settings.nats_password,
        token=settings.nats_token,
        user_credentials=str(settings.nats_creds) if settings.nats_creds else None,
        tls=_tls(settings),
        max_reconnect_attempts=-1,
        max_outstanding_pings=MAX_OUTSTANDING_PINGS,
        connect_timeout=options.pop("connect_timeout", 5),
        allow_reconnect=True,
        **options,
    )
    connected = True
    return nc


def _settled(ping: asyncio.Future[None]) -> None:
    if not ping.cancelled():
        ping.exception()  # retrieved: a ping that failed is an answer too


_PING_ABANDON_S = 600
"""A ping still unanswered this long is given up (one forgotten by a reconnect)."""

REACH_CHECK_S = 1.0
"""Seconds between pings of a service watching NATS, and each ping's deadline."""


class Reachability:
    """Whether the NATS server answers a ping, as of the last `check`.

    A connection nats-py still counts as up may lead to a paused or wedged server; only an
    answer shows the bus works. Services use this to tell an outage of NATS itself from
    silence of the nodes behind it.

    Args:
        nc: the connection.
        timeout: seconds to wait for the answer.
        clock: monotonic seconds.
    """

    def __init__(
        self, nc: Client, *, timeout: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._nc = nc
        self._timeout = timeout
        self._clock = clock
        self.down_since: float | None = None
        """Monotonic time of the first failed check of the current outage."""
        self.down_since_wall: str | None = None
        self.answered_at: float | None = None
        """Monotonic time of the last check that got its answer."""
        self.outages = 0
        self._ping: asyncio.Future[None] | None = None
        self._ping_epoch = 0
        self._ping_started = 0.0

    @property
    def reachable(self) -> bool:
        """Whether the last check got an answer."""
        return self.down_since is None

    async def check(self) -> bool:
        """Ping the server now; returns whether it answered in time."""
        if await self._answered():
            self.answered_at = self._clock()
            if self.down_since is not None:
                log.info("NATS reachable again after %.1fs", self._clock() - self.down_since)
                self.down_since = self.down_since_wall = None
            return True
        if self.down_since is None:
            self.down_since, self.down_since_wall = self._clock(), now()
            self.outages += 1
            log.error("NATS unreachable: no answer to a ping within %gs", self._timeout)
        return False

    async def _answered(self) -> bool:
        # One ping in flight at a time, never cancelled: nats-py fails its reader when the
        # answer to a cancelled ping arrives. A reconnect forgets pings in flight, so one
        # from before it is abandoned (it ends by its own long timeout).
        if not self._nc.is_connected:
            return False  # reconnecting: nats-py's flush would return at once, unanswered
        ping, epoch = self._ping, self._nc.stats["reconnects"]
        if ping is None or ping.done() or self._ping_epoch != epoch:
            ping = self._ping = asyncio.ensure_future(self._nc.flush(timeout=_PING_ABANDON_S))
            ping.add_done_callback(_settled)
            self._ping_epoch, self._ping_started = epoch, self._clock()
        left = self._ping_started + self._timeout - self._clock()
        if left > 0:
            await asyncio.wait({ping}, timeout=left)
        return ping.done() and not ping.cancelled() and ping.exception() is None

    def why(self) -> str:
        """The outage in words (empty when reachable)."""
        if self.down_since is None:
            return ""
        return (
            f"NATS unreachable since {self.down_since_wall}: the server has not answered a "
            f"ping within {self._timeout:g}s for {self._clock() - self.down_since:.0f}s"
        )


async def unless_stopped(work: Awaitable[object], stop: asyncio.Event) -> bool:
    """Await `work` unless `stop` is set first, then cancel it; whether it ran to its end.
    For what waits on NATS and must not hold up a stop: with NATS gone, each request
    waits out its timeout."""
    working = asyncio.ensure_future(work)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({working, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when the caller is cancelled: neither outlives it
        stopping.cancel()
        ran = working.done()
        if not ran:
            working.cancel()
    if ran:
        working.result()
        return True
    await asyncio.wait({working})  # its cancellation, not the caller's, is not raised
    return False


async def keep_checking(
    check: Callable[[], Awaitable[object]], stop: asyncio.Event, every: float
) -> None:
    """Call `check` every `every` seconds until `stop` is set (a check under way then is
    left unfinished)."""
    while not stop.is_set():
        if not await unless_stopped(check(), stop):
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(every):
                await stop.wait()


async def close(nc: Client) -> None:
    """Drain the connection (flush what is pending) while the server is there, else just
    close it: shutting down must neither fail nor wait because NATS went first."""
    _closing.add(nc)
    if nc.is_connected and await _drained(nc):
        return
    try:
        await nc.close()
    except RuntimeError as exc:  # uvloop refuses the last flush to a transport now closed
        log.debug("NATS connection closed already: %s", exc)


async def _drained(nc: Client) -> bool:
    """Whether `nc` drained within `DRAIN_S`; false as soon as its server is lost (a drain
    waits for answers that a server gone never sends)."""
    draining = asyncio.ensure_future(nc.drain())
    deadline = time.monotonic() + DRAIN_S
    while not draining.done() and nc.is_connected and time.monotonic() < deadline:
        await asyncio.wait({draining}, timeout=_LOST_POLL_S)
    if not draining.done():
        draining.cancel()
        why = "timed out" if nc.is_connected else "the server was lost"
        log.warning("NATS drain incomplete: %s", why)
        return False
    if (exc := draining.exception()) is not None:
        log.warning("NATS drain incomplete: %s", exc)
        return False
    return True
