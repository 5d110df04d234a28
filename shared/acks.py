"""JetStream publishes awaited on one inbox subscription, each forgotten however it ends.

nats-py's `publish_async` takes a slot of a bounded semaphore per publish and frees it only
when that publish's ack future completes. A publish that raises (the client's outbound
buffer full while it reconnects) leaves its future pending for good, so after a few
thousand such failures every later publish waits forever: an agent whose NATS was away for
seconds with telemetry queued never published again. Here nothing outlives its publish.
"""

from __future__ import annotations

import asyncio
import itertools

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import APIError, NoStreamResponseError

from rankscope.shared.subjects import replies, reply

__all__ = ["AckInbox"]

_NO_RESPONDERS = "503"


class _Refusal(msgspec.Struct):
    code: int | None = None
    err_code: int | None = None
    description: str | None = None


class _Answer(msgspec.Struct):
    """JetStream's answer to a publish: the ack's other fields are not needed here."""

    error: _Refusal | None = None


class AckInbox:
    """Publishes to JetStream and waits for each one's ack, many at once.

    Args:
        nc: the connection; the inbox is subscribed at the first publish and survives
            reconnects (nats-py subscribes again).
        patience: seconds a publish waits for its ack.
    """

    def __init__(self, nc: Client, *, patience: float) -> None:
        self._nc = nc
        self._patience = patience
        self._inbox: str | None = None
        self._tokens = itertools.count()
        self._waiting: dict[str, asyncio.Future[None]] = {}

    async def publish(self, subject: str, payload: bytes, headers: dict[str, str]) -> None:
        """Publish, and return once JetStream has stored it (or found it a duplicate).

        Raises:
            TimeoutError: no ack within `patience` seconds.
            nats.errors.Error: the client could not send it, or JetStream refused it.
        """
        if self._inbox is None:
            inbox = self._nc.new_inbox()
            await self._nc.subscribe(replies(inbox), cb=self._answered)
            self._inbox = inbox
        token = str(next(self._tokens))
        acked = self._waiting[token] = asyncio.get_running_loop().create_future()
        try:
            await self._nc.publish(
                subject, payload, reply=reply(self._inbox, token), headers=headers
            )
            await asyncio.wait_for(acked, self._patience)
        finally:
            del self._waiting[token]

    @property
    def waiting(self) -> int:
        """Publishes awaiting their ack."""
        return len(self._waiting)

    async def _answered(self, msg: Msg) -> None:
        acked = self._waiting.get(msg.subject.rpartition(".")[2])
        if acked is None or acked.done():
            return  # answered after its publish gave up
        if msg.headers and msg.headers.get("Status") == _NO_RESPONDERS:
            acked.set_exception(NoStreamResponseError())
            return
        try:
            refusal = msgspec.json.decode(msg.data, type=_Answer).error
        except msgspec.DecodeError:
            refusal = _Refusal(description=f"not a JetStream ack: {msg.data[:80]!r}")
        if refusal is None:
            acked.set_result(None)
        else:
            acked.set_exception(APIError(refusal.code, refusal.description, refusal.err_code))
