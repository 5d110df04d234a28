"""Whether JetStream stores messages now: a canary write, told apart from NATS outages.

On a full disk or store, NATS still answers pings while JetStream refuses or never
acknowledges writes: the telemetry stops with nothing but timeouts on the agents. A
service that writes its canary now and then learns it, with the server's reason when it
gives one. On a NATS cluster each stream has its own leader, elected among its replicas:
one that lost its quorum stores nothing while the canary's stream still does, so the
check asks every stream's leader as well. An answer that does not come in time is asked
for again once: on a loaded machine one late acknowledgement is no outage.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.js import JetStreamContext
from nats.js.errors import APIError

from rankscope.shared.timestamps import now

__all__ = ["STORAGE_CHECK_S", "Storage"]

log = logging.getLogger(__name__)

STORAGE_CHECK_S = 2.0
"""Seconds between canary writes of a service watching JetStream."""
ATTEMPTS = 2
CANARY_BYTES = 16 << 10
"""The canary's size: larger than the slack a store file keeps at its end (a file system
block, a page), so a canary is stored only while the disk has room for new data. A tiny
one still fits that slack for tens of seconds after a disk filled."""
"""Tries of a check whose answers do not come in time before it counts as failed."""


def _reason(error: Exception, timeout: float) -> str:
    if isinstance(error, APIError):
        return f"the server refused a write: {error.description} (error {error.err_code})"
    if isinstance(error, NoRespondersError):
        return "JetStream is not running on the server (disabled, e.g. after its disk filled)"
    if isinstance(error, TimeoutError):
        return f"no write acknowledged within {timeout:g}s"
    return f"a write failed: {error or type(error).__name__}"


class _NotStoredError(Exception):
    """Why a check failed, in words; `late` when only an answer did not come in time."""

    def __init__(self, reason: str, *, late: bool) -> None:
        super().__init__(reason)
        self.late = late


class Storage:
    """Whether a canary write was stored, as of the last `check`.

    Args:
        js: the JetStream context.
        subject: the canary subject (see `Layout.canary_stream`).
        timeout: seconds to wait for the acknowledgement, and for each stream's leader.
        streams: the streams whose leaders must answer (see `Layout.stream_names`).
        clock: monotonic seconds.
    """

    def __init__(
        self,
        js: JetStreamContext,
        subject: str,
        *,
        timeout: float,
        streams: Sequence[str] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._js = js
        self._subject = subject
        self._timeout = timeout
        self._streams = tuple(streams)
        self._clock = clock
        self.failing_since: float | None = None
        self.failing_since_wall: str | None = None
        self.reason = ""
        """Why the last write was not stored (empty when it was)."""

    @property
    def storing(self) -> bool:
        """Whether the last canary write was stored."""
        return self.failing_since is None

    async def check(self) -> bool:
        """Ask every stream's leader, then write the canary; returns whether every stream
        has a leader and JetStream stored the canary. An answer that does not come in time
        is asked for again once before it counts: one late answer on a loaded machine is
        no outage, a leader lost or a server stopped stays silent the second time too."""
        for attempt in range(ATTEMPTS):
            try:
                await asyncio.gather(*(self._led(name) for name in self._streams))
                canary = now().encode().ljust(CANARY_BYTES)
                await self._js.publish(self._subject, canary, timeout=self._timeout)
            except _NotStoredError as exc:
                reason, late = str(exc), exc.late
            except (NatsError, APIError, TimeoutError) as exc:
                reason, late = _reason(exc, self._timeout), isinstance(exc, TimeoutError)
            else:
                break
            if not late or attempt + 1 == ATTEMPTS:
                self._failing(reason)
                return False
        if self.failing_since is not None:
            log.info("JetStream stores again after %.0fs", self._clock() - self.failing_since)
            self.failing_since = self.failing_since_wall = None
            self.reason = ""
        return True

    async def _led(self, name: str) -> None:
        try:
            info = await asyncio.wait_for(self._js.stream_info(name), self._timeout)
        except TimeoutError:
            raise _NotStoredError(
                f"stream {name} did not answer within {self._timeout:g}s (on a cluster: it has "
                "no leader, its replicas lost their quorum)",
                late=True,
            ) from None
        except APIError as exc:
            raise _NotStoredError(
                f"stream {name}: {exc.description} (error {exc.err_code})", late=False
            ) from None
        if info.cluster is not None and not info.cluster.leader:
            raise _NotStoredError(
                f"stream {name} has no leader (its replicas lost their quorum)", late=False
            )

    def forget(self) -> None:
        """Drop the failure noted, if any: a write that failed while NATS itself was out
        says nothing of JetStream once NATS is back."""
        self.failing_since = self.failing_since_wall = None
        self.reason = ""

    def _failing(self, reason: str) -> None:
        self.reason = reason
        if self.failing_since is None:
            self.failing_since, self.failing_since_wall = self._clock(), now()
            log.error("JetStream is not storing: %s", self.reason)

    def why(self) -> str:
        """The failure in words (empty while writes are stored)."""
        if self.failing_since is None:
            return ""
        return f"JetStream not storing since {self.failing_since_wall}: {self.reason}"
