"""Runner-side pieces that need no NATS: the ring hostfile, the recorder's bound, the
watchdog, exit causes, the crash breaker."""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing
import os
import queue
import signal
import socket
import time
from typing import Any
from unittest.mock import MagicMock

from rankscope.services.agent.runner import watchdog as watchdog_module
from rankscope.services.agent.runner.channel import Entries, Entry, Output, Status
from rankscope.services.agent.runner.config import RunnerConfig, Timeouts
from rankscope.services.agent.runner.recorder import Recorder
from rankscope.services.agent.runner.shard import ring_hosts
from rankscope.services.agent.runner.watchdog import WEDGED_EXIT, Watchdog
from rankscope.services.agent.supervisor import RunnerSupervisor, exit_cause
from rankscope.shared.subjects import Subjects
from rankscope.shared.telemetry import TelemetryPublisher
from rankscope.shared.timestamps import now, parse_ts
from rankscope.shared.wire import (
    Breadcrumb,
    MlxMemorySnapshot,
    Phase,
    RunnerAssignment,
    RunnerRef,
    RunnerStatusKind,
)
from tests.stack_up import free_port


def _rank(rank: int, start: int, end: int) -> RunnerAssignment:
    return RunnerAssignment(
        runnerId=f"r{rank}",
        nodeId=f"n{rank}",
        deviceRank=rank,
        worldSize=3,
        startLayer=start,
        endLayer=end,
        nLayers=10,
        host=f"10.0.0.{rank}",
        port=5000 + rank,
    )


RANKS = [_rank(0, 0, 2), _rank(1, 2, 7), _rank(2, 7, 10)]


def test_the_ring_is_in_device_rank_order_whatever_order_it_is_given_in() -> None:
    assert ring_hosts(RANKS[::-1]) == [["10.0.0.0:5000"], ["10.0.0.1:5001"], ["10.0.0.2:5002"]]


def _snapshot() -> MlxMemorySnapshot:
    return MlxMemorySnapshot(generatedAt=now(), source="test")


def test_full_queue_drops_and_counts_without_blocking() -> None:
    context = multiprocessing.get_context("spawn")
    telemetry: Any = context.Queue(2)
    recorder = Recorder(telemetry=telemetry, control=context.Queue(), memory=_snapshot)
    for index in range(5):
        recorder.record(Phase.DECODE_STREAM, "token", attrs={"i": index})
    assert recorder.dropped == 3
    kept = [telemetry.get(timeout=5), telemetry.get(timeout=5)]
    assert [item.attrs["i"] for item in kept] == [0, 1]
    recorder.record(Phase.COMPLETION, "stop")
    after = telemetry.get(timeout=5)
    assert isinstance(after, Entry)
    assert after.dropped == 3  # the next entry that fits says how many went missing before it
    recorder.flush()


def _drain(channel: Any, wait: float = 0.5) -> list[Any]:
    """Everything on a queue within `wait` seconds of quiet."""
    got = []
    while True:
        try:
            got.append(channel.get(timeout=wait))
        except queue.Empty:
            return got


def _entries(messages: list[Any]) -> list[Any]:
    """The entries in telemetry messages, batches unpacked, in order."""
    return [e for m in messages for e in (m.entries if isinstance(m, Entries) else [m])]


def _say_then_hold_the_lock(telemetry: Any, control: Any, speaking: Any, release: Any) -> None:
    read = ctypes.PyDLL(None).read  # PyDLL: the interpreter's lock is kept through the call
    byte = ctypes.create_string_buffer(1)
    recorder = Recorder(telemetry=telemetry, control=control, memory=_snapshot)
    speaking.set()
    recorder.record(Phase.CONNECT_GROUP, "init")
    recorder.status(RunnerStatusKind.CONNECTING)
    recorder.deliver(10)
    read(release.fileno(), byte, 1)  # holding the lock until released: MLX's ring connect
    os._exit(0)  # what was not written by now never is


def test_what_a_rank_said_before_a_call_holding_the_interpreter_s_lock_is_out_during_it() -> None:
    """A rank connecting its ring says so before MLX holds the lock for as long as the
    connect takes (for good, if a peer never comes): without `deliver` the queues' feeder
    threads could not write it, and its agent saw nothing all that time."""
    context = multiprocessing.get_context("spawn")
    telemetry, control, speaking = context.Queue(), context.Queue(), context.Event()
    release, releasing = context.Pipe(duplex=False)
    child = context.Process(
        target=_say_then_hold_the_lock, args=(telemetry, control, speaking, release)
    )
    child.start()
    try:
        assert speaking.wait(60)
        assert control.get(timeout=5) == Status(RunnerStatusKind.CONNECTING)
        entry = telemetry.get(timeout=5)
        assert (entry.phase, entry.event) == (Phase.CONNECT_GROUP, "init")
        assert child.is_alive()  # still holding the lock
    finally:
        releasing.send_bytes(b"go")
        child.join(30)


def test_a_tokens_entries_and_text_wait_for_the_next_tokens_then_go_together() -> None:
    context = multiprocessing.get_context("spawn")
    telemetry: Any = context.Queue()
    control: Any = context.Queue()
    recorder = Recorder(telemetry=telemetry, control=control, memory=_snapshot, window=60)
    recorder.record(Phase.DECODE_WAIT_FIRST_TOKEN, "first_token")
    for index in range(5):
        recorder.output("cmd", f"t{index} ")
        recorder.record(Phase.DECODE_STREAM, "token", attrs={"i": index}, batch=True)
    sent = _drain(telemetry)
    assert [e.event for e in _entries(sent)] == ["first_token"]  # the tokens' entries wait
    assert _drain(control) == [Output(commandId="cmd", seq=0, text="t0 ")]  # the first text goes
    recorder.output("cmd", "t5", "stop", (3, 6))
    assert _drain(control) == [
        Output(commandId="cmd", seq=1, text="t1 t2 t3 t4 t5", finish="stop", tokens=(3, 6))
    ]
    recorder.record(Phase.COMPLETION, "stop")
    (batch,) = _drain(telemetry)  # one message, one wakeup of the agent
    assert isinstance(batch, Entries)
    assert [(e.event, e.attrs.get("i")) for e in batch.entries] == [
        *(("token", i) for i in range(5)),
        ("stop", None),
    ]
    recorder.flush()


def test_with_no_wait_between_tokens_each_goes_at_once() -> None:
    context = multiprocessing.get_context("spawn")
    telemetry: Any = context.Queue()
    control: Any = context.Queue()
    recorder = Recorder(telemetry=telemetry, control=control, memory=_snapshot, window=0)
    for index in range(3):
        recorder.output("cmd", f"t{index}")
        recorder.record(Phase.DECODE_STREAM, "token", attrs={"i": index}, batch=True)
    assert [type(m) for m in _drain(telemetry)] == [Entry] * 3
    assert [(m.seq, m.text) for m in _drain(control)] == [(0, "t0"), (1, "t1"), (2, "t2")]
    recorder.flush()


def _stuck_after_tokens(telemetry: Any, control: Any, seen: Any) -> None:
    """A rank that decodes three tokens, then hangs in its next step."""
    watchdog_module.WAIT_NOTE_S = 0.2
    recorder = Recorder(telemetry=telemetry, control=control, memory=_snapshot, window=60)
    watchdog = Watchdog(recorder)
    recorder.record(Phase.DECODE_WAIT_FIRST_TOKEN, "first_token")
    for index in range(3):
        recorder.output("cmd", f"t{index} ")
        recorder.record(Phase.DECODE_STREAM, "token", attrs={"i": index}, batch=True)
    with watchdog.guard("decode_stream", 30.0):
        seen.wait(30)  # stuck until the test has seen what it needs
    recorder.flush()


def test_a_rank_stuck_mid_decode_has_its_waiting_tokens_out_with_its_wait_note() -> None:
    context = multiprocessing.get_context("spawn")
    telemetry: Any = context.Queue()
    control: Any = context.Queue()
    seen = context.Event()
    process = context.Process(target=_stuck_after_tokens, args=(telemetry, control, seen))
    process.start()
    try:
        assert telemetry.get(timeout=30).event == "first_token"
        batch = telemetry.get(timeout=30)  # while it is still stuck
        assert [(e.event, e.attrs.get("i")) for e in batch.entries] == [
            ("token", 0),
            ("token", 1),
            ("token", 2),
            (Breadcrumb.COLLECTIVE_WAIT, None),
        ]
        chunks = [control.get(timeout=5), control.get(timeout=5)]
        assert [(c.seq, c.text, c.finish) for c in chunks] == [
            (0, "t0 ", None),
            (1, "t1 t2 ", None),
        ]
    finally:
        seen.set()
        process.join(30)
    assert process.exitcode == 0


def test_a_dropped_batch_counts_every_entry_in_it() -> None:
    context = multiprocessing.get_context("spawn")
    telemetry: Any = context.Queue(1)
    recorder = Recorder(telemetry=telemetry, control=context.Queue(), memory=_snapshot, window=60)
    recorder.record(Phase.DECODE_WAIT_FIRST_TOKEN, "first_token")  # fills the queue
    for index in range(3):
        recorder.record(Phase.DECODE_STREAM, "token", attrs={"i": index}, batch=True)
    recorder.record(Phase.PARSER, "finalize")  # the four go as one, and find no room
    assert recorder.dropped == 4
    assert telemetry.get(timeout=5).event == "first_token"
    recorder.record(Phase.COMPLETION, "stop")
    after = telemetry.get(timeout=5)
    assert (after.event, after.dropped) == ("stop", 4)
    recorder.flush()


Guarded = tuple[str, float, float | tuple[float, ...]]
"""A guarded call: its site, its deadline and how long its body takes, in seconds (in
chunks, each progress, when a tuple)."""


def _guard_in_turn(calls: list[Guarded], note_s: float, telemetry: Any) -> None:
    """A runner's main thread, in brief: each call in turn under one watchdog."""
    watchdog_module.WAIT_NOTE_S = note_s
    control: Any = multiprocessing.get_context("spawn").Queue()
    recorder = Recorder(telemetry=telemetry, control=control, memory=_snapshot)
    watchdog = Watchdog(recorder)
    for site, deadline, takes in calls:
        with watchdog.guard(site, deadline):
            for chunk in takes if isinstance(takes, tuple) else (takes,):
                time.sleep(chunk)  # a chunk of work done: progress
                watchdog.advance()
    recorder.flush()


def _guarded(calls: list[Guarded], note_s: float) -> tuple[int | None, list[Entry]]:
    """The exit code of a process running `calls`, and the entries it recorded."""
    context = multiprocessing.get_context("spawn")
    telemetry: Any = context.Queue()
    process = context.Process(target=_guard_in_turn, args=(calls, note_s, telemetry))
    process.start()
    entries = []
    while process.is_alive() or not telemetry.empty():
        try:
            entries.append(telemetry.get(timeout=0.2))
        except queue.Empty:
            continue
    process.join()
    return process.exitcode, entries


DECODING = [("decode_stream", 30.0, 0.0)] * 50
"""A guard per token, each with the same deadline: the watchdog is not woken for them."""


def test_a_short_deadline_after_many_long_ones_still_ends_the_wedged_runner() -> None:
    code, entries = _guarded([*DECODING, ("cancel_check", 0.3, 1.5)], note_s=5.0)
    assert code == WEDGED_EXIT  # not 0: the watchdog looked at 0.3 s, not at the 5 s note
    (timeout,) = [e for e in entries if e.event == Breadcrumb.COLLECTIVE_TIMEOUT]
    assert timeout.detail == "cancel_check did not finish within 0.3s"
    assert timeout.attrs["site"] == "cancel_check"


def test_a_long_wait_after_many_short_ones_is_noted_with_since_when_and_its_end() -> None:
    code, entries = _guarded([*DECODING, ("decode_stream", 30.0, 0.8)], note_s=0.2)
    assert code == 0
    events = [e.event for e in entries]
    assert events == [Breadcrumb.COLLECTIVE_WAIT, Breadcrumb.COLLECTIVE_RESUMED]
    wait, resumed = entries
    parse_ts(str(wait.attrs["since"]))
    assert wait.detail == f"waiting in decode_stream since {wait.attrs['since']}"
    assert resumed.attrs["site"] == "decode_stream"
    assert float(str(resumed.attrs["waitedSeconds"])) >= 0.8


def test_a_long_call_that_advances_chunk_by_chunk_is_never_taken_for_wedged() -> None:
    prefill = ("prefill_pipeline", 0.5, (0.3, 0.3, 0.3, 0.3))  # 1.2 s in all, 0.3 s a chunk
    code, entries = _guarded([prefill], note_s=5.0)
    assert code == 0
    assert not [e for e in entries if e.event == Breadcrumb.COLLECTIVE_TIMEOUT]
    code, _ = _guarded([("prefill_pipeline", 0.5, (1.2,))], note_s=5.0)
    assert code == WEDGED_EXIT  # the same work in one piece, with no progress between


def test_exit_causes() -> None:
    assert exit_cause(-signal.SIGKILL) == "killed by SIGKILL"
    assert exit_cause(-signal.SIGSEGV) == "killed by SIGSEGV"
    assert exit_cause(1) == "exit code 1"
    assert exit_cause(WEDGED_EXIT) == "watchdog: a collective did not finish in time"


def _supervisor(
    ranks: tuple[RunnerAssignment, ...] = tuple(RANKS), timeouts: Timeouts | None = None
) -> RunnerSupervisor:
    rank = ranks[0]
    ref = RunnerRef(
        runnerId=rank.runnerId,
        nodeId=rank.nodeId,
        instanceId="i",
        modelId="m",
        deviceRank=rank.deviceRank,
        worldSize=rank.worldSize,
    )
    config = RunnerConfig(
        runner=ref,
        assignment=rank,
        assignments=ranks,
        model_path="",
        timeouts=timeouts or Timeouts(),
    )
    return RunnerSupervisor(
        config=config,
        subjects=Subjects("t"),
        publisher=TelemetryPublisher(nc=MagicMock()),  # queues only: it is never run
        first_seq=0,
        on_output=lambda chunk: None,
        on_task=lambda task, status, detail, refused: None,
    )


async def test_a_rank_whose_ring_never_connects_is_ended_by_its_agent_as_a_victim() -> None:
    """Its peer's port takes connections and says nothing: MLX waits in the connect holding
    the interpreter's lock, where the rank's own watchdog cannot run."""
    mine, theirs = free_port(), free_port()
    ranks = tuple(
        RunnerAssignment(
            runnerId=f"r{r}",
            nodeId=f"n{r}",
            deviceRank=r,
            worldSize=2,
            startLayer=r,
            endLayer=r + 1,
            nLayers=2,
            host="127.0.0.1",
            port=port,
        )
        for r, port in enumerate((mine, theirs))
    )
    supervisor = _supervisor(ranks, Timeouts(connect=2.0))
    with socket.create_server(("127.0.0.1", theirs)):
        supervisor.start()
        try:
            for _ in range(600):
                if supervisor.status is RunnerStatusKind.FAILED:
                    break
                await asyncio.sleep(0.1)
            breadcrumb = supervisor.entries[-2]
            assert (breadcrumb.phase, breadcrumb.event) == (
                Phase.CONNECT_GROUP,
                Breadcrumb.COLLECTIVE_TIMEOUT,
            )
            assert breadcrumb.detail == "connect_group did not finish within 2s"
            assert supervisor.status is RunnerStatusKind.FAILED
            assert supervisor.restarts == 1  # as a victim of its peers
        finally:
            await supervisor.release()


async def test_a_victim_of_its_peers_is_restarted_without_tripping_the_breaker() -> None:
    supervisor = _supervisor()
    supervisor._releasing = True  # the restarts it schedules do nothing here
    supervisor._loop = asyncio.get_running_loop()
    for _ in range(5):  # its collective timed out five times: it only waits for its peers
        supervisor._crash(WEDGED_EXIT, exit_cause(WEDGED_EXIT))
    supervisor._lost_peer = "decode_stream"
    supervisor._crash(1, "lost its peer in decode_stream (exit code 1)")
    assert not supervisor.gave_up
    assert supervisor.status.value == "RunnerFailed"
    supervisor._lost_peer = None
    for _ in range(3):  # crashes of its own
        supervisor._crash(1, "exit code 1")
    assert supervisor.gave_up
