"""The streams and buckets of an installation made, or checked as they are: `ensure`, idempotent,
patient while a cluster elects its leaders, and plain about what JetStream refused."""

from __future__ import annotations

import asyncio
import logging
import time

from nats.js import JetStreamContext
from nats.js.api import StreamConfig
from nats.js.errors import APIError, BadRequestError, NotFoundError, ServiceUnavailableError

from rankscope.shared.jetstream import UNANSWERED, BucketSpec, Layout, StreamSpec

__all__ = ["ENSURE_PATIENCE_S", "LayoutError", "ensure"]

log = logging.getLogger(__name__)

_STREAM_NAME_IN_USE = 10058
"""JetStream's error for a stream made again with another configuration."""
_NO_PEERS = 10005
"""JetStream's error for a stream whose replicas it cannot place: too few servers up."""
_NOT_CLUSTERED = 10074
"""JetStream's error for more than one copy on a server that is not in a cluster."""


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
        except (*UNANSWERED, _UnplacedError, _AbsentError) as exc:
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
