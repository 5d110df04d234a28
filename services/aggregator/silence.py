"""Which nodes are silent: heartbeats read and probe rounds answered go in, each with the
time it happened; when to ask whom, which nodes are unreachable and why, and clocks that
disagree with NATS's come out. Pure: `liveness.py` asks the nodes and reads the clocks."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from rankscope.shared.timestamps import to_epoch
from rankscope.shared.wire import NodeInfo, UnreachableNode

__all__ = [
    "CLOCK_TOLERANCE_S",
    "MISSED_ROUNDS",
    "NO_AGENT",
    "OVERDUE_TTL_SHARE",
    "Answer",
    "Ask",
    "ClockNote",
    "Silence",
]

MISSED_ROUNDS = 2
"""Probe rounds in a row a node must leave unanswered to be called unreachable: one late
answer is a busy node. A node where no agent listens at all (NATS says so at once), or
whose heartbeat is overdue too, is unreachable from the first round."""

OVERDUE_TTL_SHARE = 0.5
"""A node's heartbeat is overdue once it is older than this share of the TTL: agents beat
every third of it, so one beat is missed and the next late. Older by this aggregator's
clock, and by NATS's next to the newest heartbeat read from any node, unless none was
read for as long: an aggregator behind in reading heartbeats sees every node's beat late,
not one."""

CLOCK_TOLERANCE_S = 2.0
"""How far a node's clock may be from the NATS server's before the aggregator says so."""

NO_AGENT = "no agent answers live diagnostics there (NATS: no responders)"

Answer = set[str] | str | None
"""What a node said to a probe: the runners its agent lists, why it is silent when NATS
says so at once (`NO_AGENT`), or None for no usable answer in time."""


@dataclass(frozen=True, slots=True)
class Ask:
    """Probe these nodes now: a full round (every node of interest), or a recheck of the
    silent ones that counts no missed round."""

    nodes: list[str]
    full: bool


@dataclass(frozen=True, slots=True)
class ClockNote:
    """A node's clock crossed `CLOCK_TOLERANCE_S` from the NATS server's, either way."""

    node_id: str
    offset: float
    """Seconds ahead of the server's (negative: behind)."""
    agrees: bool
    """Whether it is back within the tolerance."""


class Silence:
    """The liveness of nodes as a machine: events in, verdicts out, time as data.

    Args:
        ttl_s: the heartbeat TTL of the nodes bucket.
        probe_interval: seconds between full rounds.
        probe_timeout: the deadline of one round (said in the verdicts).
    """

    def __init__(self, *, ttl_s: float, probe_interval: float, probe_timeout: float) -> None:
        self._ttl_s = ttl_s
        self._probe_interval = probe_interval
        self._probe_timeout = probe_timeout
        self.heartbeats: dict[str, float] = {}
        """When each node's last heartbeat was read, by the aggregator's clock."""
        self._beats_stored: dict[str, int] = {}
        """When NATS stored each node's last heartbeat read (ns since the epoch)."""
        self._newest_stored = 0
        """When NATS stored the newest heartbeat read from any node (ns since the epoch)."""
        self._newest_read = -math.inf
        """When a heartbeat of any node was last read, by the aggregator's clock."""
        self.clock_offsets: dict[str, float] = {}
        """Seconds each node's clock is ahead of the NATS server's (negative: behind)."""
        self._silent_since: dict[str, float] = {}
        self._missed_rounds: dict[str, int] = {}
        """Full rounds in a row each node gave no usable answer in."""
        self._next_round = -math.inf
        self._rechecked: float | None = None
        """When the last recheck was due: one that changed nothing is not repeated."""

    def heard(
        self, node_id: str, info: NodeInfo | None, stored_ns: int | None, at: float
    ) -> ClockNote | None:
        """A node's heartbeat read at `at` (None: its entry expired or was deleted), which
        NATS stored at `stored_ns`; a note when its clock crossed the tolerance."""
        if info is None:
            self.clock_offsets.pop(node_id, None)
            return None
        self.heartbeats[node_id] = self._newest_read = at
        if stored_ns is None:
            return None
        self._beats_stored[node_id] = stored_ns
        self._newest_stored = max(self._newest_stored, stored_ns)
        offset = to_epoch(info.lastHeartbeat) - stored_ns / 1e9
        before = self.clock_offsets.get(node_id, 0.0)
        self.clock_offsets[node_id] = offset
        if abs(offset) > CLOCK_TOLERANCE_S >= abs(before):
            return ClockNote(node_id, offset, agrees=False)
        if abs(before) > CLOCK_TOLERANCE_S >= abs(offset):
            return ClockNote(node_id, offset, agrees=True)
        return None

    def due(
        self,
        at: float,
        *,
        placed: Callable[[], set[str]],
        elsewhere: Collection[str],
        owns: Callable[[str], bool],
        unreachable: Collection[str],
    ) -> Ask | None:
        """What to ask at `at`, if anything: a full `round` every `probe_interval`; in
        between, a recheck of the silent nodes not yet `unreachable` once the earliest
        one's heartbeat is overdue, well before the rank-table service gives it up."""
        if at >= self._next_round:
            return self.round(at, placed(), elsewhere=elsewhere, owns=owns)
        recheck = self._recheck_due(unreachable)
        if recheck is None or recheck == self._rechecked or recheck > at:
            return None
        self._rechecked = recheck
        return Ask(sorted(n for n in self._missed_rounds if n not in unreachable), full=False)

    def round(
        self,
        at: float,
        placed: set[str],
        *,
        elsewhere: Collection[str],
        owns: Callable[[str], bool],
    ) -> Ask:
        """A full round at `at`: the nodes of its instances (`placed`) and its share (`owns`)
        of the nodes heard of that no partition places on (`elsewhere`: those another
        partition does). A node no longer asked is no longer suspect."""
        self._next_round, self._rechecked = at + self._probe_interval, None
        spare = {n for n in self.heartbeats if n not in elsewhere and owns(n)}
        targets = sorted(placed | spare)
        for gone in (self._missed_rounds.keys() | self._silent_since.keys()) - set(targets):
            self._missed_rounds.pop(gone, None)
            self._silent_since.pop(gone, None)
        return Ask(targets, full=True)

    def wake(self, unreachable: Collection[str]) -> float:
        """When `due` next has something to ask."""
        recheck = self._recheck_due(unreachable)
        if recheck is None or recheck == self._rechecked:
            return self._next_round
        return min(recheck, self._next_round)

    def _recheck_due(self, unreachable: Collection[str]) -> float | None:
        """When the heartbeat of the earliest node left silent, and not yet called
        unreachable, will be overdue; None when there is no such node."""
        overdue = self._ttl_s * OVERDUE_TTL_SHARE
        return min(
            (
                self.heartbeats[n] + overdue
                for n in self._missed_rounds
                if n not in unreachable and n in self.heartbeats
            ),
            default=None,
        )

    def answered(
        self,
        ask: Ask,
        answers: Sequence[Answer],
        at: float,
        *,
        nodes: Mapping[str, NodeInfo],
        unreachable: Mapping[str, UnreachableNode],
    ) -> dict[str, UnreachableNode]:
        """The nodes unreachable after `ask` was answered at `at`, of those heard of
        (`nodes`) and those called unreachable so far (kept by a recheck)."""
        found = {} if ask.full else dict(unreachable)
        for node_id, answer in zip(ask.nodes, answers, strict=True):
            found.pop(node_id, None)
            if (why := self._verdict(node_id, answer, at, nodes, full=ask.full)) is not None:
                found[node_id] = why
        return found

    def _verdict(
        self,
        node_id: str,
        answer: Answer,
        at: float,
        nodes: Mapping[str, NodeInfo],
        *,
        full: bool,
    ) -> UnreachableNode | None:
        """Note what `node_id` answered: why it is unreachable, if it is."""
        node = nodes.get(node_id)
        if isinstance(answer, set):
            self._silent_since.pop(node_id, None)
            self._missed_rounds.pop(node_id, None)
            if node is not None:
                return None
        else:
            self._silent_since.setdefault(node_id, at)
            self._missed_rounds[node_id] = self._missed_rounds.get(node_id, 0) + full
        beat = self.heartbeats.get(node_id)
        asked = f"no answer to live diagnostics within {self._probe_timeout:g}s"
        since = f" (silent for {at - self._silent_since.get(node_id, at):.1f}s)"
        if node is None:
            age = f"for {at - beat:.1f}s" if beat is not None else "since this aggregator started"
            error = f"no heartbeat {age} (TTL {self._ttl_s:g}s); entry expired or never written"
        elif isinstance(answer, str):
            error = answer
        elif answer is None and self._overdue(node_id, at):
            # two signals agree, well before the rank-table service gives the node up at
            # the TTL and releases its instances (which ends their judging)
            quiet = at - beat if beat is not None else 0.0
            error = f"{asked} and no heartbeat for {quiet:.1f}s{since}"
        elif answer is None and self._missed_rounds[node_id] >= MISSED_ROUNDS:
            error = f"{asked}, {self._missed_rounds[node_id]} rounds in a row{since}"
        else:
            return None
        return UnreachableNode(nodeId=node_id, url=node.address if node else None, error=error)

    def _overdue(self, node_id: str, at: float) -> bool:
        """Whether `node_id`'s heartbeat is overdue at `at` (`OVERDUE_TTL_SHARE`)."""
        limit = self._ttl_s * OVERDUE_TTL_SHARE
        beat, stored = self.heartbeats.get(node_id), self._beats_stored.get(node_id)
        if beat is None:
            return True
        if at - beat <= limit:
            return False
        return (
            stored is None
            or self._newest_stored - stored > limit * 1e9
            or at - self._newest_read > limit
        )

    def outage_over(self, at: float) -> None:
        """NATS answers again at `at`: silence during the outage said nothing of the nodes,
        so every node starts afresh, as if heard from then."""
        self._silent_since.clear()
        self._missed_rounds.clear()
        self.heartbeats = dict.fromkeys(self.heartbeats, at)
