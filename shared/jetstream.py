"""JetStream streams and KV buckets rankscope relies on, and an idempotent `ensure`.

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
    APIError,
    BadRequestError,
    NoStreamResponseError,
    NotFoundError,
    ServiceUnavailableError,
)

from rankscope.shared.settings import Settings
from rankscope.shared.subjects import Subjects
from rankscope.shared.wire.events import TASK_HORIZON_S

__all__ = [
    "DUPLICATE_WINDOW_S",
    "ELECTION_S",
    "Layout",
    "LayoutError",
    "StreamSpec",
    "ensure",
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


_STREAM_NAME_IN_USE = 10058
"""JetStream's error for a stream made again with another configuration."""
_NO_PEERS = 10005
"""JetStream's error for a stream whose replicas it cannot place: too few servers up."""
_NOT_CLUSTERED = 10074
"""JetStream's error for more than one copy on a server that is not in a cluster."""


ELECTION_S = 10.0
"""How long a write waits for its stream to answer: past a leader election (about 5 s on a
cluster that lost the server leading the stream)."""

_UNANSWERED = (TimeoutError, NoRespondersError, NoStreamResponseError, ServiceUnavailableError)
"""What JetStream says while it cannot answer yet (no leader, no quorum, not started)."""


ENSURE_PATIENCE_S = 60.0
"""How long `ensure` waits for JetStream to answer: a starting cluster elects its meta
leader, and each new stream its own leader, within seconds."""


class LayoutError(RuntimeError):
    """JetStream refused a stream rankscope needs (its store is too small for it), or did
    not answer at all."""


class _UnplacedError(Exception):
    """A stream JetStream cannot place on enough servers yet, in words."""


def _refused(layout: Layout, stream: StreamSpec | BucketSpec, error: APIError) -> Exception:
    name = stream.name if isinstance(stream, StreamSpec) else stream.stream_name
    if error.err_code == _NO_PEERS:
        return _UnplacedError(
            f"JetStream cannot place stream {name} on {stream.replicas} servers: "
            f"{error.description}; start more of the cluster's servers, or lower "
            "RANKSCOPE_REPLICAS"
        )
    if error.err_code == _NOT_CLUSTERED:
        return LayoutError(
            f"JetStream cannot keep {stream.replicas} copies of stream {name}: "
            f"{error.description}; set RANKSCOPE_REPLICAS=1 for one server"
        )
    reserved = stream.max_bytes if isinstance(stream, StreamSpec) else 0
    size = f"reserving {reserved:,} bytes" if reserved > 0 else "no reservation"
    whole = sum(max(s.max_bytes, 0) for s in layout.streams)
    hint = (
        "lower --telemetry-max-bytes"
        if stream == layout.runner_stream
        else f"lower --telemetry-max-bytes: rankscope's streams reserve {whole:,} bytes in "
        f"all, {layout.telemetry_max_bytes:,} of them telemetry"
    )
    return LayoutError(
        f"JetStream refused stream {name} ({size}): {error.description}; free space "
        f"in the server's store, or {hint}"
    )


async def ensure(
    js: JetStreamContext,
    layout: Layout,
    *,
    patience: float = ENSURE_PATIENCE_S,
    owner: bool = True,
) -> None:
    """Create every stream and bucket of `layout`, or update those whose limits differ;
    not as an `owner` (a role that may neither, nor read their state: an agent), wait
    until each exists.

    Safe to call from every service at start-up, concurrently and repeatedly. While
    JetStream does not answer yet (a cluster electing its leaders), or a stream an owner
    makes is not there yet, tries again for up to `patience` seconds.

    Raises:
        LayoutError: the server refused a stream (a store too small for its limits), or
            JetStream did not answer within `patience`.
    """
    deadline, told = time.monotonic() + patience, False
    while True:
        try:
            await (_ensure_once(js, layout) if owner else _exists(js, layout))
            return
        except (*_UNANSWERED, _UnplacedError, _AbsentError) as exc:
            if isinstance(exc, _UnplacedError | _AbsentError):
                reason = str(exc)
            else:
                reason = f"JetStream did not answer: {exc or type(exc).__name__}"
            if time.monotonic() >= deadline:
                raise LayoutError(f"after {patience:g}s: {reason}") from None
            if not told:
                log.warning("%s; trying again for up to %gs", reason, patience)
                told = True
            await asyncio.sleep(1.0)


class _AbsentError(Exception):
    """A stream its owners have not made yet."""


async def _exists(js: JetStreamContext, layout: Layout) -> None:
    """Check that every stream and bucket of `layout` is there, by name alone."""
    wanted = [(s.name, s.subjects[0]) for s in layout.streams] + [
        (b.stream_name, f"$KV.{b.bucket}.>") for b in layout.buckets
    ]
    for name, subject in wanted:
        try:
            found = await js.find_stream_name_by_subject(subject)
        except NotFoundError:
            found = None
        if found != name:
            raise _AbsentError(
                f"stream {name} is not there yet (the aggregator and the rank-table service "
                "make it)"
            )


async def _ensure_once(js: JetStreamContext, layout: Layout) -> None:
    made: list[str] = []
    changed: list[str] = []
    for stream in layout.streams:
        try:
            info = await js.stream_info(stream.name)
        except NotFoundError:
            try:
                await js.add_stream(stream.config())
            except ServiceUnavailableError:
                raise
            except APIError as exc:
                raise _refused(layout, stream, exc) from None
            made.append(stream.name)
            continue
        if await _update(js, layout, stream, info.config):
            changed.append(stream.name)
    for bucket in layout.buckets:
        try:
            info = await js.stream_info(bucket.stream_name)
        except NotFoundError:
            try:
                await js.create_key_value(bucket.config())
                made.append(bucket.bucket)
            except APIError as exc:
                if exc.err_code in (_NO_PEERS, _NOT_CLUSTERED):
                    raise _refused(layout, bucket, exc) from None
                if not isinstance(exc, BadRequestError) or exc.err_code != _STREAM_NAME_IN_USE:
                    raise
                # another service made it meanwhile, and already refused rollups on it
            info = await js.stream_info(bucket.stream_name)
        if await _update(js, layout, bucket, info.config) and bucket.bucket not in made:
            changed.append(bucket.bucket)
    # a line each, not one a stream: an installation's first start makes them all
    if made:
        log.info("made %d streams and buckets: %s", len(made), ", ".join(made))
    if changed:
        log.info("gave %d streams and buckets new limits: %s", len(changed), ", ".join(changed))


async def _update(
    js: JetStreamContext, layout: Layout, spec: StreamSpec | BucketSpec, current: StreamConfig
) -> bool:
    """Give an existing stream `spec`'s limits and copies, where they differ; whether they
    did."""
    if not spec.differs_from(current):
        return False
    try:
        await js.update_stream(spec.applied_to(current))
    except ServiceUnavailableError:
        raise
    except APIError as exc:
        raise _refused(layout, spec, exc) from None
    return True


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
        except _UNANSWERED:
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.25)
