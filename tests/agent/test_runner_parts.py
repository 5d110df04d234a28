"""Runner-side pieces that need no NATS: the ring hostfile, the recorder's bound, exit causes,
the crash breaker."""

from __future__ import annotations

import asyncio
import multiprocessing
import signal
from typing import Any
from unittest.mock import MagicMock

from services.agent.publisher import TelemetryPublisher
from services.agent.runner.channel import ENTRY
from services.agent.runner.config import RunnerConfig
from services.agent.runner.recorder import Recorder
from services.agent.runner.shard import ring_hosts
from services.agent.runner.watchdog import WEDGED_EXIT
from services.agent.supervisor import RunnerSupervisor, exit_cause
from shared.subjects import Subjects
from shared.timestamps import now
from shared.wire import MlxMemorySnapshot, Phase, RunnerAssignment, RunnerRef


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
    assert [item[5]["i"] for item in kept] == [0, 1]
    recorder.record(Phase.COMPLETION, "stop")
    after = telemetry.get(timeout=5)
    assert after[0] == ENTRY
    assert after[-1] == 3  # the next entry that fits says how many went missing before it
    recorder.flush()


def test_exit_causes() -> None:
    assert exit_cause(-signal.SIGKILL) == "killed by SIGKILL"
    assert exit_cause(-signal.SIGSEGV) == "killed by SIGSEGV"
    assert exit_cause(1) == "exit code 1"
    assert exit_cause(WEDGED_EXIT) == "watchdog: a collective did not finish in time"


def _supervisor() -> RunnerSupervisor:
    rank = RANKS[0]
    ref = RunnerRef(
        runnerId=rank.runnerId,
        nodeId=rank.nodeId,
        instanceId="i",
        modelId="m",
        deviceRank=rank.deviceRank,
        worldSize=rank.worldSize,
    )
    config = RunnerConfig(runner=ref, assignment=rank, assignments=tuple(RANKS), model_path="")
    supervisor = RunnerSupervisor(
        config=config,
        subjects=Subjects("t"),
        publisher=TelemetryPublisher(js=MagicMock()),  # queues only: it is never run
        first_seq=0,
        on_output=lambda chunk: None,
        on_task=lambda task, status, detail: None,
    )
    supervisor._releasing = True  # the restarts it schedules do nothing here
    return supervisor


async def test_a_victim_of_its_peers_is_restarted_without_tripping_the_breaker() -> None:
    supervisor = _supervisor()
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
