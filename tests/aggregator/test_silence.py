"""Which nodes are silent, on virtual time: heartbeats and answers fed with their times,
rounds and rechecks asked when due, verdicts with their reasons, outages forgiven."""

from __future__ import annotations

from collections.abc import Collection

from rankscope.services.aggregator.silence import NO_AGENT, Answer, Ask, Silence
from rankscope.shared.timestamps import from_micros
from rankscope.shared.wire import NodeInfo, UnreachableNode
from tests.ranktable.builders import node_info

TTL = 10.0  # heartbeats overdue after 5 s
EPOCH = 1_800_000_000.0  # NATS's clock, seconds


class Cluster:
    """A silence machine and the nodes it has heard of, driven on virtual time."""

    def __init__(self, *nodes: str) -> None:
        self.silence = Silence(ttl_s=TTL, probe_interval=60.0, probe_timeout=0.5)
        self.nodes: dict[str, NodeInfo] = {}
        self.unreachable: dict[str, UnreachableNode] = {}
        for node_id in nodes:
            self.beat(node_id, at=0.0)

    def beat(self, node_id: str, *, at: float, stored: float | None = None) -> None:
        """`node_id`'s heartbeat, read at `at` and stored by NATS at `stored` (as read)."""
        stored_s = EPOCH + (at if stored is None else stored)
        info = node_info(node_id, 8, lastHeartbeat=from_micros(int(stored_s * 1e6)))
        self.nodes[node_id] = info
        self.silence.heard(node_id, info, int(stored_s * 1e9), at)

    def due(self, at: float) -> Ask | None:
        return self.silence.due(
            at,
            placed=lambda: set(self.nodes),
            elsewhere=set(),
            owns=lambda _: True,
            unreachable=self.unreachable,
        )

    def answer(self, ask: Ask, at: float, said: dict[str, Answer]) -> Collection[str]:
        """Each node of `ask` says what `said` gives it (an empty list by default); the
        unreachable nodes after."""
        answers = [said.get(n, set()) for n in ask.nodes]
        self.unreachable = self.silence.answered(
            ask, answers, at, nodes=self.nodes, unreachable=self.unreachable
        )
        return self.unreachable


def test_a_silent_node_is_unreachable_after_two_full_rounds_and_reachable_once_it_answers() -> None:
    cluster = Cluster("node-0", "node-1")
    first = cluster.due(0.0)
    assert first == Ask(["node-0", "node-1"], full=True)
    assert cluster.answer(first, 0.5, {"node-1": None}) == {}  # one late answer: a busy node
    cluster.beat("node-1", at=4.0)
    assert cluster.due(8.0) is None  # rounds every 60 s; its beat is not overdue yet
    cluster.beat("node-0", at=59.0)
    cluster.beat("node-1", at=59.0)
    second = cluster.due(60.0)
    assert second is not None
    assert second.full
    assert set(cluster.answer(second, 60.5, {"node-1": None})) == {"node-1"}
    assert cluster.unreachable["node-1"].error == (
        "no answer to live diagnostics within 0.5s, 2 rounds in a row (silent for 60.0s)"
    )
    third = cluster.due(120.0)
    assert third is not None
    assert cluster.answer(third, 120.5, {}) == {}


def test_no_agent_at_all_or_no_heartbeat_is_unreachable_from_the_first_round() -> None:
    cluster = Cluster("node-0")
    cluster.nodes.pop("node-0")  # its entry expired
    ask = Ask(["node-0", "node-1"], full=True)
    found = cluster.answer(ask, 3.0, {"node-1": NO_AGENT})
    assert set(found) == {"node-0", "node-1"}
    assert cluster.unreachable["node-0"].error == (
        "no heartbeat for 3.0s (TTL 10s); entry expired or never written"
    )
    assert cluster.unreachable["node-1"].error.startswith("no heartbeat since this aggregator")


def test_a_silent_node_is_rechecked_alone_once_its_heartbeat_is_overdue_not_a_round_later() -> None:
    cluster = Cluster("node-0", "node-1")
    ask = cluster.due(0.0)
    assert ask is not None
    cluster.answer(ask, 0.3, {"node-0": None})
    assert cluster.unreachable == {}
    assert cluster.silence.wake(cluster.unreachable) == TTL / 2  # node-0's beat overdue
    assert cluster.due(4.9) is None
    recheck = cluster.due(5.0)
    assert recheck == Ask(["node-0"], full=False)
    cluster.beat("node-1", at=5.2)  # node-1 beats on, by NATS's clock as well
    assert set(cluster.answer(recheck, 5.3, {"node-0": None})) == {"node-0"}
    assert cluster.unreachable["node-0"].error == (
        "no answer to live diagnostics within 0.5s and no heartbeat for 5.3s (silent for 5.0s)"
    )
    assert cluster.due(6.0) is None  # the recheck is not repeated
    assert cluster.silence.wake(cluster.unreachable) == 60.0


def test_a_recheck_that_changed_nothing_is_not_repeated_until_the_next_round() -> None:
    cluster = Cluster("node-0")
    ask = cluster.due(0.0)
    assert ask is not None
    cluster.answer(ask, 0.3, {"node-0": None})
    assert cluster.due(5.0) == Ask(["node-0"], full=False)  # NATS was out: no answer fed
    assert cluster.due(5.1) is None
    assert cluster.silence.wake(cluster.unreachable) == 60.0


def test_heartbeats_read_late_by_a_busy_aggregator_make_no_node_overdue() -> None:
    cluster = Cluster("node-0", "node-1")
    ask = cluster.due(0.0)
    assert ask is not None
    cluster.answer(ask, 0.3, {})
    # the aggregator read nothing for 6 s (it was busy), then node-1's beat, which NATS
    # stored a second after node-0's: node-0's beat is not overdue by NATS's clock
    cluster.beat("node-1", at=6.0, stored=1.0)
    recheck = Ask(["node-0", "node-1"], full=True)
    assert cluster.answer(recheck, 6.1, {"node-0": None, "node-1": None}) == {}
    cluster.beat("node-1", at=7.0, stored=7.0)  # now one is newer by NATS's clock too
    found = cluster.answer(Ask(["node-0"], full=False), 7.1, {"node-0": None})
    assert cluster.unreachable["node-0"].error.startswith(
        "no answer to live diagnostics within 0.5s and no heartbeat for 7.1s"
    )
    assert set(found) == {"node-0"}


def test_after_an_outage_of_nats_every_node_starts_afresh() -> None:
    cluster = Cluster("node-0")
    for moment in (0.0, 60.0):
        ask = cluster.due(moment)
        assert ask is not None
        if moment:
            cluster.silence.outage_over(moment)  # the bus was out in between
        cluster.answer(ask, moment + 0.5, {"node-0": None})
    assert cluster.unreachable == {}  # one missed round since the outage


def test_nodes_no_longer_asked_are_no_longer_suspect_and_a_recheck_keeps_other_verdicts() -> None:
    cluster = Cluster("node-0", "node-1", "node-2")
    cluster.nodes.pop("node-2")
    ask = cluster.due(0.0)
    assert ask is not None
    cluster.answer(ask, 0.5, {"node-0": None, "node-1": None})
    assert set(cluster.unreachable) == {"node-2"}
    recheck = cluster.answer(Ask(["node-1"], full=False), 5.5, {"node-1": None})
    assert set(recheck) == {"node-1", "node-2"}  # node-2's verdict kept by a recheck
    cluster.nodes.pop("node-0")
    cluster.silence.heartbeats.pop("node-0")
    again = cluster.due(60.0)
    assert again is not None
    assert "node-0" not in again.nodes


def test_a_clock_crossing_the_tolerance_is_noted_once_each_way() -> None:
    cluster = Cluster()
    silence = cluster.silence
    stored = int(EPOCH * 1e9)
    ahead = node_info("node-0", 8, lastHeartbeat=from_micros(int((EPOCH + 30) * 1e6)))
    note = silence.heard("node-0", ahead, stored, 0.0)
    assert note is not None
    assert not note.agrees
    assert round(note.offset) == 30
    assert silence.heard("node-0", ahead, stored, 1.0) is None  # said once
    agreeing = node_info("node-0", 8, lastHeartbeat=from_micros(int(EPOCH * 1e6)))
    back = silence.heard("node-0", agreeing, stored, 2.0)
    assert back is not None
    assert back.agrees
    assert silence.heard("node-0", None, None, 3.0) is None
    assert silence.clock_offsets == {}
