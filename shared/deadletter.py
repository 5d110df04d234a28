"""Messages a service cannot apply: counted by kind, logged once per kind, and copied to
the dead-letter stream with where they came from and why, so nothing bad is silently
dropped and nothing good is held up by it."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext

from rankscope.shared.wire import WireError, decode

__all__ = ["KEPT_BYTES", "DeadLetters"]

log = logging.getLogger(__name__)

KEPT_BYTES = 16 << 10
"""How much of a bad message a dead letter keeps: enough to see what it was, while a
flood of huge ones cannot fill the dead-letter stream with a few copies."""


class DeadLetters:
    """The bad-input ledger of one service.

    Args:
        js: JetStream context.
        subject: the service's own dead-letter subject (`Subjects.deadletter`).
        service: who rejected the message (`Rankscope-Service` header).
    """

    def __init__(self, *, js: JetStreamContext, subject: str, service: str) -> None:
        self._js = js
        self._subject = subject
        self._service = service
        self.counts: dict[str, int] = {}
        self._copying: set[asyncio.Task[None]] = set()

    @property
    def total(self) -> int:
        """Messages rejected so far."""
        return sum(self.counts.values())

    def decoded(self, msg: Msg, tp: Any, kind: str) -> Any:
        """`msg` decoded as `tp`, or None once it is rejected as bad input of `kind`."""
        try:
            return decode(msg.data, tp)
        except WireError as exc:
            self.reject(msg.subject, msg.data, kind, exc)
            return None

    def reject(self, subject: str, data: bytes | None, kind: str, error: object) -> None:
        """Count `data` (received on `subject`) as bad input of `kind` and dead-letter it."""
        first = kind not in self.counts
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if first:
            log.warning("bad input (%s) on %s: %s", kind, subject, error)
        data = data or b""
        headers = {
            "Rankscope-Size": str(len(data)),
            "Rankscope-Subject": subject,
            "Rankscope-Error": str(error)[:512],
            "Rankscope-Kind": kind,
            "Rankscope-Service": self._service,
        }
        task = asyncio.ensure_future(self._copy(data[:KEPT_BYTES], headers))
        self._copying.add(task)
        task.add_done_callback(self._copying.discard)

    async def _copy(self, data: bytes, headers: dict[str, str]) -> None:
        try:
            await self._js.publish(self._subject, data, headers=headers)
        except (NatsError, TimeoutError) as exc:
            log.warning("dead letter not stored: %s", exc)

    async def settled(self) -> None:
        """Wait until every dead letter so far is stored (or failed)."""
        while self._copying:
            await asyncio.gather(*self._copying, return_exceptions=True)
