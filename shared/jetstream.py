"""JetStream streams and KV buckets rankscope relies on (`provision.py` makes them), and
writes that wait out a leader election.

Streams are named `<PREFIX>_<WHAT>`, buckets `<prefix>_<what>`; both derive from the
subject prefix so several installations can share one NATS account.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from nats.errors import NoRespondersError
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, KeyValueConfig, PubAck, StorageType, StreamConfig
from nats.js.errors import (
    NoStreamResponseError,
    ServiceUnavailableError,
)

from rankscope.shared.settings import Settings
from rankscope.shared.subjects import Subjects
from rankscope.shared.wire.events import TASK_HORIZON_S

__all__ = [
    "DUPLICATE_WINDOW_S",
    "ELECTION_S",
    "UNANSWERED",
    "BucketSpec",
    "Layout",
    "StreamSpec",
    "publish_acked",
]

log = logging.getLogger(__name__)

TELEMETRY_MAX_MESSAGE = 1 << 20
"""The largest telemetry message JetStream stores: an agent's batch of 64 entries is tens
of KB; one the size of a timeline answer would fill every timeline that shows it."""

PLACEMENT_MAX_MESSAGE = 16 << 20
"""The largest placement event JetStream stores: a recorded job of the most ranks it may
have (4,096, commands cut) is a few MB; nothing larger may push the events that rebuild
every view out of the stream."""

DEAD_LETTERS_KEPT = 256
"""Dead letters kept per writer: at most 4 MiB each (16 KiB a letter), so 16 writers
flooding at once still fit the stream's bytes."""

DUPLICATE_WINDOW_S = 120.0
"""Dedupe window for `Nats-Msg-Id`; covers the longest publish retry of any producer."""


@dataclass(frozen=True, slots=True)
class StreamSpec:
    """What rankscope needs of one stream; the server fills in the rest."""

    name: str
    subjects: tuple[str, ...]
    max_age_s: float = 0.0
    max_bytes: int = -1
    max_msgs_per_subject: int = -1
    max_msg_size: int = -1
    duplicate_window_s: float = DUPLICATE_WINDOW_S
    replicas: int = 1

    def config(self) -> StreamConfig:
        """The full stream configuration for creation."""
        return StreamConfig(
            name=self.name,
            subjects=list(self.subjects),
            storage=StorageType.FILE,
            discard=DiscardPolicy.OLD,
            max_age=self.max_age_s,
            max_bytes=self.max_bytes,
            max_msgs_per_subject=self.max_msgs_per_subject,
            max_msg_size=self.max_msg_size,
            duplicate_window=self.duplicate_window_s,
            allow_direct=True,
            num_replicas=self.replicas,
        )

    def differs_from(self, current: StreamConfig) -> bool:
        """Whether the server's configuration lacks what this spec asks for."""
        return (
            sorted(current.subjects or []) != sorted(self.subjects)
            or (current.max_age or 0.0) != self.max_age_s
            or (current.max_bytes or -1) != self.max_bytes
            or current.max_msgs_per_subject != self.max_msgs_per_subject
            or (current.max_msg_size or -1) != self.max_msg_size
            or current.duplicate_window != self.duplicate_window_s
            or (current.num_replicas or 1) != self.replicas
        )

    def applied_to(self, current: StreamConfig) -> StreamConfig:
        """`current` with this spec's limits, for an update that keeps the rest."""
        return current.evolve(
            subjects=list(self.subjects),
            max_age=self.max_age_s,
            max_bytes=self.max_bytes,
            max_msgs_per_subject=self.max_msgs_per_subject,
            max_msg_size=self.max_msg_size,
            duplicate_window=self.duplicate_window_s,
            num_replicas=self.replicas,
        )


@dataclass(frozen=True, slots=True)
class BucketSpec:
    """What rankscope needs of one KV bucket."""

    bucket: str
    history: int = 1
    ttl_s: float = 0.0
    replicas: int = 1

    @property
    def stream_name(self) -> str:
        """The stream behind the bucket."""
        return f"KV_{self.bucket}"

    def config(self) -> KeyValueConfig:
        """The bucket configuration for creation."""
        return KeyValueConfig(
            bucket=self.bucket,
            history=self.history,
            ttl=self.ttl_s or None,
            storage=StorageType.FILE,
            direct=True,
            replicas=self.replicas,
        )

    def differs_from(self, current: StreamConfig) -> bool:
        """Whether the bucket's stream lacks this spec's history or TTL, or takes rollups."""
        return (
            current.max_msgs_per_subject != self.history
            or (current.max_age or 0.0) != self.ttl_s
            or bool(current.allow_rollup_hdrs)
            or (current.num_replicas or 1) != self.replicas
        )

    def applied_to(self, current: StreamConfig) -> StreamConfig:
        """`current` with this spec's history and TTL (the dedupe window may not exceed it),
        refusing `Nats-Rollup` headers: with them, one writer of a single key could purge
        every key of the bucket (nats-py creates buckets allowing them; rankscope purges
        no key)."""
        window = current.duplicate_window
        if self.ttl_s:
            window = min(window or DUPLICATE_WINDOW_S, self.ttl_s)
        return current.evolve(
            max_msgs_per_subject=self.history,
            max_age=self.ttl_s,
            duplicate_window=window,
            allow_rollup_hdrs=False,
            num_replicas=self.replicas,
        )


@dataclass(frozen=True, slots=True)
class Layout:
    """Every stream and bucket of one installation."""

    subjects: Subjects = field(default_factory=Subjects)
    telemetry_max_age_s: float = 7 * 86400.0
    telemetry_max_bytes: int = 1 << 30
    telemetry_max_msgs_per_subject: int = 700_000
    """A week of one memory sample a second, per runner."""
    node_ttl_s: float = 10.0
    replicas: int = 1
    """Copies of every stream and bucket (servers of a NATS cluster that hold one)."""

    @classmethod
    def from_settings(cls, settings: Settings) -> Layout:
        """The layout an installation's settings describe."""
        return cls(
            subjects=Subjects(settings.subject_prefix),
            telemetry_max_age_s=settings.telemetry_max_age,
            telemetry_max_bytes=settings.telemetry_max_bytes,
            telemetry_max_msgs_per_subject=settings.telemetry_max_msgs_per_subject,
            node_ttl_s=settings.heartbeat_ttl,
            replicas=settings.replicas,
        )

    def _name(self, what: str) -> str:
        return f"{self.subjects.prefix.replace('.', '_').upper()}_{what}"

    def _bucket(self, what: str) -> str:
        return f"{self.subjects.prefix.replace('.', '_')}_{what}"

    @property
    def runner_stream(self) -> StreamSpec:
        """Runner telemetry: flight-recorder entries, memory snapshots, status changes.

        Each subject is one runner's kind of telemetry; capping messages per subject makes a
        chatty runner give up its own oldest messages instead of everyone's, as long as
        runners x cap x message size stays under the byte limit.
        """
        return StreamSpec(
            self._name("RUNNER"),
            (self.subjects.runner_all(),),
            max_age_s=self.telemetry_max_age_s,
            max_bytes=self.telemetry_max_bytes,
            max_msgs_per_subject=self.telemetry_max_msgs_per_subject,
            max_msg_size=TELEMETRY_MAX_MESSAGE,
            replicas=self.replicas,
        )

    @property
    def placement_stream(self) -> StreamSpec:
        """Placement decisions, kept as long as their bytes fit: they rebuild the views.
        Only the rank-table service writes them, from the specs (recorded jobs have a
        stream of their own): a few KB a placement, tens of thousands of them."""
        return StreamSpec(
            self._name("PLACEMENT"),
            (self.subjects.placement_all(),),
            max_bytes=128 << 20,
            max_msg_size=PLACEMENT_MAX_MESSAGE,
            replicas=self.replicas,
        )

    @property
    def recorded_stream(self) -> StreamSpec:
        """Recorded jobs' placement events (`rankscope record`), apart from the placed
        instances': nodes register recorded ranks, and whatever they register pushes out
        only older recorded jobs' events, never a spec's instance's."""
        return StreamSpec(
            self._name("RECORDED"),
            (self.subjects.recorded_all(),),
            max_bytes=64 << 20,
            max_msg_size=PLACEMENT_MAX_MESSAGE,
            replicas=self.replicas,
        )

    @property
    def fr_stream(self) -> StreamSpec:
        """PyTorch jobs' Flight Recorder dumps loaded into rankscope (`rankscope fr load`):
        the newest load of each job, read again by an aggregator that restarts."""
        return StreamSpec(
            self._name("FR"),
            (self.subjects.fr_load_all(),),
            max_bytes=64 << 20,
            max_msg_size=PLACEMENT_MAX_MESSAGE,
            max_msgs_per_subject=1,
            replicas=self.replicas,
        )

    @property
    def tasks_stream(self) -> StreamSpec:
        """Tasks and task status."""
        return StreamSpec(
            self._name("TASKS"),
            (self.subjects.tasks_all(),),
            max_age_s=self.telemetry_max_age_s,
            max_bytes=256 << 20,
            replicas=self.replicas,
        )

    @property
    def inputs_stream(self) -> StreamSpec:
        """Tasks whole, one copy per node of their instance, kept as long as a task may wait
        to start (the oldest go first past 64 MiB): no agent may read the prompts of
        another node's instances."""
        return StreamSpec(
            self._name("INPUTS"),
            (self.subjects.task_inputs_all(),),
            max_age_s=TASK_HORIZON_S,
            max_bytes=64 << 20,
            replicas=self.replicas,
        )

    @property
    def ranktable_stream(self) -> StreamSpec:
        """Rank tables; the latest per job stays readable, with a short history behind it."""
        return StreamSpec(
            self._name("RANKTABLE"),
            (self.subjects.ranktable_all(),),
            max_msgs_per_subject=64,
            replicas=self.replicas,
        )

    @property
    def diagnosis_stream(self) -> StreamSpec:
        """Findings as they appear and clear."""
        return StreamSpec(
            self._name("DIAGNOSIS"),
            (self.subjects.diagnosis_all(),),
            max_age_s=self.telemetry_max_age_s,
            max_bytes=256 << 20,
            replicas=self.replicas,
        )

    @property
    def deadletter_stream(self) -> StreamSpec:
        """Messages no consumer could apply, kept for a post-mortem. Each writer (service
        or agent) has its own subject and keeps its newest `DEAD_LETTERS_KEPT`: one that
        floods evicts its own, not another's."""
        return StreamSpec(
            self._name("DEADLETTER"),
            (self.subjects.deadletter_all(),),
            max_age_s=self.telemetry_max_age_s,
            max_bytes=64 << 20,
            max_msgs_per_subject=DEAD_LETTERS_KEPT,
            replicas=self.replicas,
        )

    @property
    def canary_stream(self) -> StreamSpec:
        """One tiny message per writer, rewritten to learn whether JetStream stores now. It
        reserves no space on purpose: it fails when the unreserved store (the buckets',
        heartbeats among them) runs out, or the disk does, first."""
        return StreamSpec(
            self._name("CANARY"),
            (self.subjects.canary_all(),),
            max_msgs_per_subject=1,
            replicas=self.replicas,
        )

    @property
    def streams(self) -> tuple[StreamSpec, ...]:
        """All streams."""
        return (
            self.runner_stream,
            self.placement_stream,
            self.recorded_stream,
            self.fr_stream,
            self.tasks_stream,
            self.inputs_stream,
            self.ranktable_stream,
            self.diagnosis_stream,
            self.deadletter_stream,
            self.canary_stream,
        )

    @property
    def runners_bucket(self) -> BucketSpec:
        """Runner specs by id, with a little history for audits."""
        return BucketSpec(self._bucket("runners"), history=8, replicas=self.replicas)

    @property
    def runner_status_bucket(self) -> BucketSpec:
        """What the rank-table service observed of each Runner spec."""
        return BucketSpec(self._bucket("runner_status"), replicas=self.replicas)

    @property
    def nodes_bucket(self) -> BucketSpec:
        """Node inventory; an entry expires when its heartbeat stops."""
        return BucketSpec(self._bucket("nodes"), ttl_s=self.node_ttl_s, replicas=self.replicas)

    @property
    def buckets(self) -> tuple[BucketSpec, ...]:
        """All KV buckets."""
        return (self.runners_bucket, self.runner_status_bucket, self.nodes_bucket)

    @property
    def stream_names(self) -> tuple[str, ...]:
        """Every stream JetStream keeps for the installation, the buckets' included."""
        return (*(s.name for s in self.streams), *(b.stream_name for b in self.buckets))


ELECTION_S = 10.0
"""How long a write waits for its stream to answer: past a leader election (about 5 s on a
cluster that lost the server leading the stream)."""

UNANSWERED = (TimeoutError, NoRespondersError, NoStreamResponseError, ServiceUnavailableError)
"""What JetStream says while it cannot answer yet (no leader, no quorum, not started)."""


async def publish_acked(
    js: JetStreamContext,
    subject: str,
    payload: bytes,
    *,
    msg_id: str,
    headers: dict[str, str] | None = None,
    within: float = ELECTION_S,
) -> PubAck:
    """Publish to JetStream and wait for the ack, sending the same message again (the same
    `Nats-Msg-Id`, so it is stored once) while the stream does not answer, for up to
    `within` seconds.

    Raises:
        APIError: JetStream refused the message (at once).
        TimeoutError, NatsError: it did not answer within `within`.
    """
    deadline = time.monotonic() + within
    headers = {**(headers or {}), "Nats-Msg-Id": msg_id}
    while True:
        left = deadline - time.monotonic()
        try:
            return await js.publish(
                subject, payload, headers=headers, timeout=min(max(left, 0.1), 2.0)
            )
        except UNANSWERED:
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.25)
