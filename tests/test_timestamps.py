"""Wire timestamps are fixed-width RFC 3339 UTC, so string order is time order."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta, timezone

import pytest

from rankscope.shared.timestamps import check_ts, format_ts, now, parse_ts, to_epoch
from rankscope.shared.wire import FlightEntry, decode

WIRE = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{6}Z$")


def test_now_is_fixed_width_utc_with_microseconds() -> None:
    assert WIRE.match(now())


def test_format_keeps_microseconds_even_when_zero() -> None:
    assert format_ts(datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)) == "2026-01-02T03:04:05.000000Z"


def test_other_offsets_are_converted_to_utc() -> None:
    moment = datetime(2026, 1, 2, 3, 0, tzinfo=timezone(timedelta(hours=2)))
    assert format_ts(moment) == "2026-01-02T01:00:00.000000Z"


def test_naive_datetimes_are_refused() -> None:
    with pytest.raises(ValueError, match="naive"):
        format_ts(datetime(2026, 1, 2))


def test_string_order_is_time_order() -> None:
    base = datetime(2026, 11, 21, 23, 59, 59, 999999, tzinfo=UTC)
    moments = [base + timedelta(microseconds=step) for step in (0, 1, 10, 1_000_000, 86400e6)]
    texts = [format_ts(m) for m in moments]
    assert sorted(texts) == texts


def test_parse_round_trips_and_accepts_offsets() -> None:
    text = "2026-11-21T22:47:48.123456Z"
    assert format_ts(parse_ts(text)) == text
    assert to_epoch("2026-11-21T23:47:48.123456+01:00") == to_epoch(text)
    with pytest.raises(ValueError, match="no UTC offset"):
        parse_ts("2026-11-21T22:47:48")


def test_any_rfc_3339_offset_is_taken_and_given_back_as_utc() -> None:
    assert check_ts("2026-11-21T14:00:00.5+02:00") == "2026-11-21T12:00:00.500000Z"
    assert check_ts("2026-11-21T12:00:00+00:00") == "2026-11-21T12:00:00.000000Z"
    assert check_ts("2026-11-21T12:00:00.123456Z") == "2026-11-21T12:00:00.123456Z"
    for bad in (
        "2026-11-21T12:00:00",
        "yesterday",
        "",
        "2026-02-30T10:00:00.000000Z",
        "2026-11-21T12:00:00.12345xZ",
        "2026-11-21T12:00:00.12345\u0663Z",  # an Arabic-Indic digit: a digit, not ASCII
        "2026-11-21T24:00:00.000000Z",
    ):
        with pytest.raises(ValueError, match="timestamp"):
            check_ts(bad)
    check_ts("2026-11-21T12:00:00.000000Z")  # its second now remembered, the fraction still counts
    with pytest.raises(ValueError, match="six digits"):
        check_ts("2026-11-21T12:00:00.-00000Z")


def test_an_entry_stamped_with_an_offset_is_stored_in_utc() -> None:
    entry = decode(
        b'{"seq": 0, "at": "2026-11-21T14:00:00+02:00", "phase": "idle", "event": "e"}',
        FlightEntry,
    )
    assert entry.at == "2026-11-21T12:00:00.000000Z"
