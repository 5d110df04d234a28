"""The one fold of a runner's entries: one at a time (the agent) or in batches (the
aggregator) ends in the same place."""

from __future__ import annotations

from typing import Any

from rankscope.shared.synopsis import Synopsis, advance
from rankscope.shared.wire import FlightEntry, MlxMemorySnapshot, Phase

MEMORY = MlxMemorySnapshot(generatedAt="2026-11-23T10:00:01.000000Z", source="mlx")


def _entry(seq: int, phase: Phase, **fields: Any) -> FlightEntry:
    at = f"2026-11-23T10:00:{seq:02d}.000000Z"
    return FlightEntry(seq=seq, at=at, phase=phase, event="e", **fields)


ENTRIES = [
    _entry(1, Phase.IDLE, mlxMemory=MEMORY),
    _entry(2, Phase.TASK_AGREEMENT, taskId="t", commandId="c"),
    _entry(3, Phase.DECODE_STREAM, attrs={"step": 4}),
    _entry(4, Phase.DECODE_STREAM, attrs={"step": 5}, detail="token"),
    _entry(5, Phase.DECODE_STREAM, attrs={"step": True}),  # not a step
]


def test_one_at_a_time_and_in_batches_agree() -> None:
    one_by_one = Synopsis()
    for entry in ENTRIES:
        one_by_one = advance(one_by_one, [entry])
    batched = advance(advance(Synopsis(), ENTRIES[:3]), ENTRIES[3:])
    assert one_by_one == batched == advance(Synopsis(), ENTRIES)
    assert one_by_one == Synopsis(
        phase=Phase.DECODE_STREAM,
        phase_since="2026-11-23T10:00:03.000000Z",  # where the run of its phase began
        detail=None,
        last_at="2026-11-23T10:00:05.000000Z",
        task_id="t",
        command_id="c",
        step=5,
        memory=MEMORY,
        seq=5,
    )


def test_entries_no_newer_than_the_folded_move_nothing_back() -> None:
    ahead = advance(Synopsis(), ENTRIES[3:])  # a later batch overtook an earlier one
    assert advance(ahead, ENTRIES[:3]) == ahead
    assert advance(ahead, ENTRIES) == ahead


def test_going_idle_ends_the_task_and_a_new_phase_starts_its_clock() -> None:
    working = advance(Synopsis(), ENTRIES)
    idle = advance(working, [_entry(9, Phase.IDLE)])
    assert (idle.task_id, idle.command_id) == (None, None)
    assert idle.phase_since == "2026-11-23T10:00:09.000000Z"
    assert (idle.step, idle.memory) == (5, MEMORY)  # kept until an entry says otherwise


def test_no_entry_counts_as_later_than_its_arrival() -> None:
    ahead = advance(Synopsis(), [_entry(30, Phase.WARMUP)], received="2026-11-23T10:00:20.000000Z")
    assert ahead.phase_since == ahead.last_at == "2026-11-23T10:00:20.000000Z"
    assert advance(ahead, []) is ahead


def test_the_newest_snapshot_of_a_batch_is_the_one_kept() -> None:
    later = MlxMemorySnapshot(generatedAt="2026-11-23T10:00:07.000000Z", source="mlx")
    batch = [*ENTRIES, _entry(6, Phase.DECODE_STREAM, mlxMemory=later), _entry(7, Phase.IDLE)]
    assert advance(Synopsis(), batch).memory == later
    assert advance(advance(Synopsis(), batch[:3]), batch[3:]).memory == later
