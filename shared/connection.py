"""Connect to NATS with the settings' servers, credentials and TLS."""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import Any

import nats
from nats.aio.client import Client

from shared.nats_auth import inbox_prefix
from shared.settings import Settings

__all__ = ["close", "connect", "slow_consumer_drops"]

log = logging.getLogger(__name__)

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


async def _disconnected() -> None:
    log.warning("NATS disconnected; reconnecting")


async def _reconnected() -> None:
    log.info("NATS reconnected")


MAX_OUTSTANDING_PINGS = 3
"""Pings without an answer after which a link counts as dead and is reconnected: a link
that vanished without a FIN is noticed in about this many ping intervals."""


async def connect(settings: Settings, name: str, **options: Any) -> Client:
    """Connect as client `name`, reconnecting forever once connected; connection trouble
    is logged in one line each, not as tracebacks.

    Raises:
        nats.errors.NoServersError: no server answered the first connect.
    """
    options.setdefault("error_cb", _error)
    options.setdefault("disconnected_cb", _disconnected)
    options.setdefault("reconnected_cb", _reconnected)
    if settings.nats_user:
        options.setdefault("inbox_prefix", inbox_prefix(settings.nats_user))
    return await nats.connect(
        servers=settings.nats_servers,
        name=name,
        user=settings.nats_user,
        password=settings.nats_password,
        token=settings.nats_token,
        user_credentials=str(settings.nats_creds) if settings.nats_creds else None,
        tls=_tls(settings),
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        ping_interval=settings.nats_ping_interval,
        max_outstanding_pings=MAX_OUTSTANDING_PINGS,
        connect_timeout=options.pop("connect_timeout", 5),
        allow_reconnect=True,
        **options,
    )


async def close(nc: Client) -> None:
    """Drain the connection (flush what is pending) when the server is there, else just
    close it: shutting down must not fail because NATS went first."""
    if nc.is_connected:
        try:
            await asyncio.wait_for(nc.drain(), 5)
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("NATS drain incomplete: %s", exc)
        else:
            return
    await nc.close()
