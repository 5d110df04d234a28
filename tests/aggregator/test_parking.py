"""Telemetry waits a while for its runner's placement, within a bound."""

from __future__ import annotations

from rankscope.services.aggregator.parking import Parked, Parking
from rankscope.shared.wire import Phase, PhaseEntries
from tests.aggregator.builders import entries, rank


def _item(instance: str, seq: int, at: float) -> Parked:
    event = entries(rank(0, instance), (seq, seq, Phase.IDLE, None))
    return Parked(subject="s", data=b"", event=event, stored_ns=None, at=at)


def test_a_runner_s_messages_come_back_in_order_once_taken() -> None:
    parking = Parking(limit=10, hold_s=30)
    for seq in range(3):
        assert parking.park(_item("a", seq, 0.0)) == []
    taken = [p.event for p in parking.take("a-r0")]
    assert [e.entries[0].seq for e in taken if isinstance(e, PhaseEntries)] == [0, 1, 2]
    assert len(parking) == 0
    assert parking.take("a-r0") == []


def test_past_the_bound_the_runner_parked_first_goes_first() -> None:
    parking = Parking(limit=3, hold_s=30)
    parking.park(_item("a", 0, 0.0))
    parking.park(_item("a", 1, 0.0))
    parking.park(_item("b", 0, 1.0))
    evicted = parking.park(_item("c", 0, 2.0))
    assert [p.event.runner.runnerId for p in evicted] == ["a-r0", "a-r0"]
    assert len(parking) == 2


def test_what_waited_longer_than_the_hold_expires_and_nothing_else() -> None:
    parking = Parking(limit=10, hold_s=30)
    parking.park(_item("a", 0, 0.0))
    parking.park(_item("b", 0, 20.0))
    assert [p.event.runner.runnerId for p in parking.expired(31.0)] == ["a-r0"]
    assert parking.expired(31.0) == []
    assert [p.event.runner.runnerId for p in parking.take("b-r0")] == ["b-r0"]
