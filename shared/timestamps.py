"""Wire timestamps: RFC 3339, UTC, microseconds, `Z`, fixed width, so that string order
is time order (`2026-11-21T22:47:48.123456Z`)."""

from __future__ import annotations

import time
from datetime import UTC, datetime

__all__ = ["format_ts", "now", "parse_ts", "to_epoch"]

_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"


def format_ts(moment: datetime) -> str:
    """Format an aware datetime as a wire timestamp."""
    if moment.tzinfo is None:
        raise ValueError("naive datetime: wire timestamps are UTC and need a timezone")
    return moment.astimezone(UTC).strftime(_FORMAT)


def now() -> str:
    """The current time as a wire timestamp."""
    ns = time.time_ns()
    seconds, micros = divmod(ns // 1000, 1_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{micros:06d}Z"


def parse_ts(text: str) -> datetime:
    """Parse an RFC 3339 timestamp (any offset, any fraction) into an aware UTC datetime.

    Raises:
        ValueError: `text` is not an RFC 3339 date-time with an offset or `Z`.
    """
    moment = datetime.fromisoformat(text)
    if moment.tzinfo is None:
        raise ValueError(f"timestamp {text!r} has no UTC offset")
    return moment.astimezone(UTC)


def to_epoch(text: str) -> float:
    """Seconds since the epoch of a wire timestamp."""
    return parse_ts(text).timestamp()
