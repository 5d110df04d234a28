"""Wire timestamps: RFC 3339, UTC, microseconds, `Z`, fixed width, so that string order
is time order (`2026-11-21T22:47:48.123456Z`)."""

from __future__ import annotations

import time
from datetime import UTC, datetime

__all__ = [
    "check_ts",
    "format_ts",
    "from_micros",
    "later",
    "micros",
    "now",
    "parse_ts",
    "second_micros",
    "stamp_micros",
    "to_epoch",
]

_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"


def format_ts(moment: datetime) -> str:
    """Format an aware datetime as a wire timestamp."""
    if moment.tzinfo is None:
        raise ValueError("naive datetime: wire timestamps are UTC and need a timezone")
    return moment.astimezone(UTC).strftime(_FORMAT)


_second: list[tuple[int, str]] = [(-1, "")]
"""The last whole second formatted, and how (formatting is most of the cost of `now`, and
ingest writes one timestamp a message)."""


def now() -> str:
    """The current time as a wire timestamp."""
    return from_micros(time.time_ns() // 1000)


def later(seconds: float) -> str:
    """The wire timestamp `seconds` from now."""
    return format_ts(datetime.fromtimestamp(time.time() + seconds, UTC))


def check_ts(text: str) -> str:
    """`text` as a wire timestamp of a real moment: the fixed-width UTC form `now` writes,
    whose string order is time order. Any RFC 3339 date-time with an offset (`+02:00`,
    `+00:00`, any fraction) is taken and given back in that form.

    Raises:
        ValueError: it is no RFC 3339 date-time with an offset, saying so, quoting at most
            40 characters of `text`.
    """
    if len(text) == 27 and text[10] == "T" and text[19] == "." and text[26] == "Z":
        fraction = text[20:26]
        try:
            _whole_second(text[:19])
        except ValueError as exc:
            raise ValueError(f"timestamp {text!r}: {exc}") from None
        if not (fraction.isascii() and fraction.isdigit()):
            raise ValueError(f"timestamp {text!r}: its fraction is not six digits")
        return text
    try:
        return format_ts(parse_ts(text))
    except ValueError:
        raise ValueError(
            f"timestamp {text[:40]!r} is not an RFC 3339 date-time with an offset, such as "
            "2026-11-21T22:47:48.123456Z"
        ) from None


_DIGITS = bytes.maketrans(b"123456789", b"000000000")
_STAMP = b"0000-00-00T00:00:00.000000Z"
"""A fixed-width wire timestamp, its digits all `0` (ASCII: a byte a character)."""


def second_micros(texts: list[str]) -> list[int] | None:
    """Microseconds since the epoch of each of `texts`, if all are fixed-width wire
    timestamps of one real second, in order (a batch of flight-recorder entries, checked at
    once); None if not (each then wants `check_ts`)."""
    if len(texts) < 2:
        return [] if not texts else (None if (at := stamp_micros(texts[0])) is None else [at])
    first = texts[0]
    if (  # sorted, the first and last of one second: each begins with that second, so
        # each begins where a stamp of the joined shape does, and is one
        first[:19] != texts[-1][:19]
        or "".join(texts).encode().translate(_DIGITS) != _STAMP * len(texts)
        or texts != sorted(texts)
    ):
        return None
    base = _real_second(first[:19])
    if base is None:
        return None
    return [base + int(text[20:26]) for text in texts]


def stamp_micros(text: str) -> int | None:
    """Microseconds since the epoch of `text` if it is a fixed-width wire timestamp of a
    real second; None if not (it then wants `check_ts`)."""
    if text.encode().translate(_DIGITS) != _STAMP:
        return None
    base = _real_second(text[:19])
    return None if base is None else base + int(text[20:26])


def _real_second(prefix: str) -> int | None:
    """Microseconds since the epoch of the whole second a fixed-width wire timestamp begins
    with (digits where digits belong), or None if there is no such second."""
    whole = _seconds.get(prefix)
    if whole is None:
        try:
            whole = _whole_second(prefix)
        except ValueError:
            return None
    return whole * 1_000_000


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


_seconds: dict[str, int] = {}


def _whole_second(prefix: str) -> int:
    """Seconds since the epoch of the whole-second part of a fixed-width wire timestamp,
    remembered (ingest meets the same few seconds message after message).

    Raises:
        ValueError: it is no date and time.
    """
    whole = _seconds.get(prefix)
    if whole is None:
        if len(_seconds) > 4096:
            _seconds.clear()
        whole = _seconds[prefix] = int(datetime.fromisoformat(prefix + "+00:00").timestamp())
    return whole


def micros(at: str) -> int:
    """Microseconds since the epoch of a wire timestamp (fast for the fixed-width form;
    any RFC 3339 form is accepted)."""
    if len(at) == 27 and at[26] == "Z":
        return _whole_second(at[:19]) * 1_000_000 + int(at[20:26])
    moment = datetime.fromisoformat(at)
    return int(moment.timestamp()) * 1_000_000 + moment.microsecond


def from_micros(value: int) -> str:
    """The wire timestamp of microseconds since the epoch."""
    seconds, fraction = divmod(value, 1_000_000)
    second, text = _second[0]
    if second != seconds:
        text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
        _second[0] = (seconds, text)
    return f"{text}.{fraction:06d}Z"
