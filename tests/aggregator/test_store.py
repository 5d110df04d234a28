"""The entry store keeps time order, bounds memory, and finds the newest entries fast."""

from __future__ import annotations

import bisect

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from rankscope.services.aggregator.seqs import MAX_RUNS, SeqTracker
from rankscope.services.aggregator.store import (
    BATCH_BYTES,
    INDEX_BYTES,
    EntryStore,
    StoreImage,
)
from rankscope.shared.inputs import entry_times
from rankscope.shared.timestamps import micros
from rankscope.shared.wire import Phase, PhaseEntries, encode
from tests.aggregator.builders import at, entries, rank


def test_seq_tracker_dedupes_and_counts_gaps() -> None:
    seqs = SeqTracker()
    assert [seqs.add(s) for s in (0, 1, 1, 3, 5)] == [True, True, False, True, True]
    assert seqs.missing == 2  # 2 and 4
    assert seqs.add(2)
    assert seqs.add(4)
    assert seqs.missing == 0
    assert (seqs.first, seqs.last, seqs.seen) == (0, 5, 6)


@given(st.lists(st.integers(min_value=0, max_value=300), max_size=400))
def test_seq_tracker_agrees_with_a_set_in_any_order(arrivals: list[int]) -> None:
    seqs, model = SeqTracker(), set[int]()
    for seq in arrivals:
        assert seqs.add(seq) == (seq not in model)
        model.add(seq)
    assert seqs.seen == len(model)
    if model:
        assert (seqs.first, seqs.last) == (min(model), max(model))
        assert seqs.missing == max(model) + 1 - min(model) - len(model)
    covered = {
        s for start, end in zip(seqs.starts, seqs.ends, strict=True) for s in range(start, end)
    }
    assert covered == model
    assert all(end < start for end, start in zip(seqs.ends, seqs.starts[1:], strict=False))


def test_a_history_trimmed_at_its_start_costs_one_run_not_a_set_of_seqs() -> None:
    seqs = SeqTracker()
    batch = entries(rank(0), *[(s, 0, Phase.DECODE_STREAM, s) for s in range(5_000, 6_000)])
    assert len(seqs.fresh([e.seq for e in batch.entries])) == 1_000
    for seq in range(6_000, 1_000_000):
        seqs.add(seq)
    assert (seqs.starts, seqs.ends) == ([5_000], [1_000_000])
    assert (seqs.first, seqs.missing) == (5_000, 0)  # the trimmed start is not "missing"


def _filed(batch: PhaseEntries) -> tuple[range, list[int]]:
    """The positions and times (µs) of all of a batch's entries, as the store takes them."""
    return range(len(batch.entries)), entry_times(list(batch.entries))


def _fill(store: EntryStore, runner: int, times: list[float]) -> None:
    batch = entries(rank(runner), *[(i, t, Phase.DECODE_STREAM, i) for i, t in enumerate(times)])
    store.add(batch.runner.runnerId, encode(batch), *_filed(batch))


def test_a_runner_sending_every_other_seq_costs_a_bound_and_its_gaps_stay_counted() -> None:
    seqs = SeqTracker()
    for seq in range(0, 2 * 100_000, 2):  # 100,000 gaps
        assert seqs.add(seq)
    assert len(seqs.starts) == len(seqs.ends) == MAX_RUNS
    assert seqs.missing == 100_000 - 1
    assert (seqs.first, seqs.last) == (0, 199_998)
    assert not seqs.add(199_998)  # the newest runs are exact: a redelivery is one
    assert seqs.add(199_997)  # and a late seq among them is new


def test_newest_merges_runners_in_time_order_and_keeps_the_newest() -> None:
    store = EntryStore()
    _fill(store, 0, [0, 2, 4, 6])
    _fill(store, 1, [1, 3, 5, 7])
    found = store.newest(["i-r0", "i-r1"], limit=3)
    assert [(runner, e.at) for _, runner, e in found] == [
        ("i-r1", at(5)),
        ("i-r0", at(6)),
        ("i-r1", at(7)),
    ]


def test_time_window_filters() -> None:
    store = EntryStore()
    _fill(store, 0, [0, 1, 2, 3, 4])
    found = store.newest(["i-r0"], since=micros(at(1)), until=micros(at(3)), limit=10)
    assert [e.at for _, _, e in found] == [at(1), at(2), at(3)]


def test_late_entries_are_put_in_time_order() -> None:
    store = EntryStore()
    _fill(store, 0, [5, 6])
    _fill(store, 0, [1])
    assert [e.at for _, _, e in store.newest(["i-r0"], limit=10)] == [at(1), at(5), at(6)]


@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(min_value=0, max_value=3_000), min_size=1, max_size=6),
            st.integers(min_value=0, max_value=3_000),
        ),
        max_size=12,
    )
)
def test_every_entry_is_filed_at_its_time_or_its_arrival_in_time_order(
    batches: list[tuple[list[int], int]],
) -> None:
    """Batches in order or not, within one second or across, some late, some ahead of
    their arrival (ms after T0): each entry filed where its time belongs, at its arrival
    when later, after the entries of the same time filed before it."""
    store, model = EntryStore(), list[tuple[int, int, int]]()
    for batch, (millis, arrived_ms) in enumerate(batches):
        sent = entries(
            rank(0), *[(i, t / 1000, Phase.DECODE_STREAM, i) for i, t in enumerate(millis)]
        )
        arrived = micros(at(arrived_ms / 1000))
        store.add("i-r0", encode(sent), *_filed(sent), arrived)
        for position, entry in enumerate(sent.entries):
            filed = min(micros(entry.at), arrived)
            index = bisect.bisect_right([time for time, _, _ in model], filed)
            model.insert(index, (filed, batch, position))
    log = store._logs.get("i-r0")
    held = list(zip(log.times, log.batches, log.positions, strict=True)) if log else []
    assert held == model


def test_micros_reads_any_rfc3339_form_alike() -> None:
    assert micros("2026-11-21T12:00:01.000002Z") == micros("2026-11-21T13:00:01.000002+01:00")
    assert micros("2026-11-21T12:00:01.000002Z") - micros("2026-11-21T12:00:00Z") == 1_000_002


def test_evicting_a_batch_entry_by_entry_frees_it_at_the_end() -> None:
    store = EntryStore(per_runner=2)
    _fill(store, 0, [0, 1, 2])
    assert len(store._payloads) == 1  # the batch still holds two live entries
    _fill(store, 0, [3, 4])
    assert len(store._payloads) == 1  # the first batch's entries are all gone now
    assert [e.at for _, _, e in store.newest(["i-r0"], limit=9)] == [at(3), at(4)]


def test_retention_per_runner_and_in_total() -> None:
    store = EntryStore(per_runner=3, total=5)
    _fill(store, 0, [0, 1, 2, 3, 4])
    assert store.count("i-r0") == 3
    _fill(store, 1, [5, 6, 7])
    assert store.size == 5
    assert store.evicted == 3
    assert [e.at for _, _, e in store.newest(["i-r0"], limit=10)][-1] == at(4)


def test_entries_come_back_as_they_went_in() -> None:
    store = EntryStore()
    batch = entries(rank(0), (0, 1.5, Phase.PREFILL_PIPELINE, 7))
    store.add("i-r0", encode(batch), *_filed(batch))
    ((_, _, stored),) = store.newest(["i-r0"], limit=1)
    original = batch.entries[0]
    assert stored == original


def _flood(store: EntryStore, node: str, runner: int, count: int, size: int) -> None:
    """`count` single-entry batches of `size` bytes each from `runner` on `node`."""
    for seq in range(count):
        store.add(f"{node}-r{runner}", b"x" * size, [0], [seq], node=node)


def test_a_node_that_floods_past_the_byte_bound_gives_up_its_own_history() -> None:
    store = EntryStore(max_bytes=200_000)
    _flood(store, "quiet", 0, 100, 500)
    kept = store.bytes
    assert kept == 100 * (500 + BATCH_BYTES + INDEX_BYTES)
    _flood(store, "loud", 0, 2_000, 1_000)
    _flood(store, "loud", 1, 2_000, 1_000)
    assert store.bytes <= 200_000
    assert store.count("quiet-r0") == 100  # none of another node's
    assert store.trimmed.keys() == {"loud"}
    assert store.trimmed["loud"] == 4_000 * (1_000 + BATCH_BYTES + INDEX_BYTES) - (
        store.bytes - kept
    )
    assert store.count("loud-r0") + store.count("loud-r1") < 200


def test_bytes_held_are_counted_again_from_a_snapshot() -> None:
    store = EntryStore(max_bytes=100_000)
    _flood(store, "a", 0, 50, 300)
    _fill(store, 1, [0, 1, 2])
    kept = msgspec.msgpack.encode(store.image())

    def image() -> StoreImage:  # a store takes its image's payloads over
        return msgspec.msgpack.decode(kept, type=StoreImage)

    again = EntryStore.from_image(image(), per_runner=1000, total=1000, max_bytes=10_000)
    assert again.bytes <= 10_000
    assert again.count("i-r1") == 3  # node "" holds the least: "a" gave up its own
    assert EntryStore.from_image(image(), per_runner=1000, total=1000).bytes == store.bytes
