"""Wire timestamps are fixed-width RFC 3339 UTC, so string order is time order."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rankscope.shared.timestamps import (
    check_ts,
    format_ts,
    micros,
    now,
    parse_ts,
    second_micros,
    to_epoch,
)
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


_SECOND = "2026-02-28T23:59:59"
"""A second the strategies below build stamps around (the next day is March's first)."""


def _stamp(fraction: int, second: str = _SECOND) -> str:
    return f"{second}.{fraction:06d}Z"


_EDITS = st.sampled_from(
    [
        lambda text: text,
        lambda text: text.replace("02-28", "02-29"),  # no such day in 2026
        lambda text: text.replace("02-28", "02-31"),
        lambda text: text.replace("2026-02-28T23:59:59", "2028-02-29T23:59:59"),  # a leap day
        lambda text: text.replace("23:59", "24:00"),
        lambda text: text.replace(".", ",", 1),
        lambda text: text[:-1] + "+00:00",
        lambda text: text[:-1] + "+02:00",
        lambda text: text[:-1],
        lambda text: text[:-2] + "\u0663Z",  # a digit, but not an ASCII one
        lambda text: text[:-2] + "|Z",
        lambda text: text + "|" + text,
        lambda text: text[:20] + "+1234Z",
        lambda text: "0000" + text[4:],
        lambda text: "",
    ]
)


@settings(max_examples=500)
@given(
    st.lists(st.tuples(st.integers(0, 999_999), _EDITS), min_size=1, max_size=40),
    st.booleans(),
)
def test_a_batch_of_stamps_is_taken_at_once_only_as_each_alone_would_be(
    stamps: list[tuple[int, Any]], ordered: bool
) -> None:
    """`second_micros` gives each stamp's µs exactly when every one of them is a wire
    timestamp `check_ts` keeps as it is, of one second and in order; else None, whatever
    the edit (offsets, bad days, separators inside a stamp, non-ASCII digits)."""
    texts = [edit(_stamp(fraction)) for fraction, edit in stamps]
    if ordered:
        texts.sort()
    found = second_micros(texts)
    kept = []
    for text in texts:
        try:
            kept.append(check_ts(text) == text)
        except ValueError:
            kept.append(False)
    if found is not None:
        assert all(kept)
        assert found == [micros(text) for text in texts]
    one_second = len({text[:19] for text in texts}) == 1
    if all(kept) and one_second and texts == sorted(texts):
        assert found is not None


def test_stamps_a_batch_holds_that_only_look_alike_are_each_checked() -> None:
    fixed = [_stamp(1), _stamp(2)]
    assert second_micros(fixed) == [micros(text) for text in fixed]
    for texts in (
        [_stamp(1)[:-2] + "\u0663Z"],  # int() would read it
        [_stamp(1)[:-1] + "|" + _stamp(2)[1:]],  # two halves that join up as two stamps
        [_stamp(1)[:-1], "Z" + _stamp(2)],
        [_stamp(2), _stamp(1)],  # out of order
        [_stamp(1), _stamp(3, "2026-02-28T23:59:58"), _stamp(2)],  # of another second
        [_stamp(1, "2026-02-29T00:00:00")],
    ):
        assert second_micros(texts) is None, texts
