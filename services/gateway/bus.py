"""Everything the gateway asks of NATS, each call under a deadline."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Iterable
from datetime import datetime
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from rankscope.services.gateway.scatter import merge, with_missing
from rankscope.shared.buckets import follow_bucket
from rankscope.shared.connection import REACH_CHECK_S, Reachability
from rankscope.shared.headers import ERROR_CODE_HEADER, ERROR_HEADER, VERSION_HEADER
from rankscope.shared.jetstream import Layout, publish_acked
from rankscope.shared.partitions import partition_of
from rankscope.shared.replay import follow
from rankscope.shared.subjects import token, untoken
from rankscope.shared.timestamps import later, now, parse_ts
from rankscope.shared.views import Request, View
from rankscope.shared.wire import (
    TASK_HORIZON_S,
    EvidenceRequest,
    Finding,
    MemorySampled,
    NodeDiagnostics,
    NodeEvidence,
    PlacementQuery,
    RankTableStream,
    TaskCreated,
    TaskKind,
    WireError,
    decode,
    encode,
)
from rankscope.shared.wire.base import CamelStruct
from rankscope.shared.wire.fr import FrLoad

__all__ = ["EVIDENCE_WAIT_S", "Bus", "BusError", "last_words"]

EVIDENCE_WAIT_S = 5.0
"""How long an agent may take to capture its runners' stacks and memory."""


def last_words(published: Iterable[Finding]) -> list[Finding]:
    """The last word of each incident among `published` (in the order published), oldest
    incident first."""
    incidents: dict[str, Finding] = {}
    for finding in published:
        incidents[finding.key] = finding
    return sorted(incidents.values(), key=lambda f: f.since)


class BusError(Exception):
    """A request the services behind the gateway did not answer; `status` is HTTP's."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


class Bus:
    """The gateway's NATS connection and the buckets and streams it reads and writes."""

    def __init__(
        self, *, nc: Client, layout: Layout, timeout: float, local_node: str, partitions: int = 1
    ) -> None:
        self.nc = nc
        self.partitions = partitions
        """How many partitions the aggregators split the instances into (each asked)."""
        self.local_node = local_node
        """The node this gateway runs on: `localNodeId` of its answers (there is no master)."""
        self.js: JetStreamContext = nc.jetstream(timeout=timeout)
        self.layout = layout
        self.timeout = timeout
        self.reach = Reachability(nc, timeout=REACH_CHECK_S)
        self.lost: str | None = None
        """Why the connection closed for good, once it has (the gateway is exiting)."""
        self._kv: dict[str, KeyValue] = {}
        self._asking: dict[tuple[str, bytes], asyncio.Task[bytes]] = {}
        """Queries in flight by subject and body: an identical one joins the one in flight
        (a roomful of browsers polling one timeline costs one request, one answer's bytes)."""

    @property
    def connected(self) -> bool:
        """Whether the NATS connection is up."""
        return bool(self.nc.is_connected)

    async def query(self, view: View[Request], request: Request | None = None) -> bytes:
        """Ask the aggregators for a view; its JSON as bytes. With partitions, every one is
        asked at once and the answers merged; a partition that does not answer leaves a
        partial answer that names it (`scatter.with_missing`).

        Raises:
            BusError: 503 when no partition answers in time (saying so when NATS itself
                does not), else the aggregators' own status.
        """
        asking = view.request() if request is None else request
        if self.partitions == 1:
            subject = self.layout.subjects.query(view.name)
            return await self._ask(subject, asking, "the aggregator")
        count = self.partitions
        instance = getattr(asking, "instanceId", None)
        asked = (
            [partition_of(token(instance), count)]  # one instance: its partition alone
            if isinstance(instance, str) and instance
            else range(count)
        )
        results = await asyncio.gather(
            *(
                self._ask(
                    self.layout.subjects.query(view.name, i, count),
                    asking,
                    f"the aggregator of partition {i}/{count}",
                )
                for i in asked
            ),
            return_exceptions=True,
        )
        answers: list[bytes] = []
        missing: dict[int, str] = {}
        refused: list[BusError] = []
        for i, result in zip(asked, results, strict=True):
            if isinstance(result, bytes):
                answers.append(result)
            elif isinstance(result, BusError) and result.status >= 500:
                missing[i] = result.detail
            elif isinstance(result, BusError):
                refused.append(result)
            else:
                raise result
        if isinstance(asking, PlacementQuery) and asking.runnerId is not None:
            return self._one_placement(answers, missing, refused)
        if refused:
            raise refused[0]  # a bad query: every partition says the same
        if not answers:
            raise BusError(503, "; ".join(missing.values()))
        if len(answers) == len(asked) == 1:
            return answers[0]  # one instance's partition: its answer is the whole answer
        return with_missing(merge(view, asking, answers), missing)

    @staticmethod
    def _one_placement(
        answers: list[bytes], missing: dict[int, str], refused: list[BusError]
    ) -> bytes:
        """One runner's placement: from the partition that holds it (the others: 404)."""
        if answers:
            return answers[0]
        for refusal in refused:
            if refusal.status != 404:
                raise refusal
        if missing:
            shown = ", ".join(f"{i}" for i in missing)
            raise BusError(
                503,
                f"{refused[0].detail if refused else 'not found'} in the partitions that "
                f"answered; partition {shown} did not: {'; '.join(missing.values())}",
            )
        raise refused[0]

    async def ask(self, view: View[Request], request: Request | None = None) -> Any:
        """A view's answer, decoded as the view says (`query`'s errors, and `WireError`
        when the aggregators answered nonsense)."""
        return decode(await self.query(view, request), view.answer)

    async def _ask(self, subject: str, request: CamelStruct, who: str) -> bytes:
        """The answer to a query, shared with every identical query asked while it is in
        flight; a caller that goes away leaves it to the others."""
        key = (subject, encode(request))
        asking = self._asking.get(key)
        if asking is None:
            asking = self._asking[key] = asyncio.create_task(self._request(*key, who))
            asking.add_done_callback(functools.partial(self._answered, key))
        return await asyncio.shield(asking)

    def _answered(self, key: tuple[str, bytes], task: asyncio.Task[bytes]) -> None:
        if self._asking.get(key) is task:
            del self._asking[key]
        if not task.cancelled():
            task.exception()  # seen: every caller may have gone

    async def _request(self, subject: str, body: bytes, who: str) -> bytes:
        try:
            reply = await self.nc.request(subject, body, timeout=self.timeout)
        except NoRespondersError:
            raise BusError(503, f"{who} is not running, or still rebuilding its views") from None
        except (NatsError, TimeoutError):
            if not await self.reach.check():
                raise BusError(503, self.reach.why()) from None
            raise BusError(503, f"{who} did not answer within {self.timeout:g}s") from None
        code = (reply.headers or {}).get(ERROR_CODE_HEADER)
        if code is not None:
            detail = (reply.headers or {}).get(ERROR_HEADER, "")
            raise BusError(int(code) if code.isdigit() else 500, detail)
        return bytes(reply.data)

    async def node(self, node_id: str) -> NodeDiagnostics:
        """One agent's live view of its node.

        Raises:
            BusError: 404 when no agent of that node listens, 503 when it does not answer
                in time, 502 when its answer does not decode.
        """
        subject = self.layout.subjects.node_diagnostics(node_id)
        try:
            reply = await self.nc.request(subject, b"", timeout=self.timeout)
        except NoRespondersError:
            raise BusError(404, f"no agent of node {node_id!r} is listening") from None
        except (NatsError, TimeoutError):
            if not await self.reach.check():
                raise BusError(503, self.reach.why()) from None
            raise BusError(
                503, f"the agent of node {node_id!r} did not answer within {self.timeout:g}s"
            ) from None
        try:
            answer: NodeDiagnostics = decode(reply.data, NodeDiagnostics)
        except WireError as exc:
            raise BusError(502, f"the agent of node {node_id!r} answered nonsense: {exc}") from None
        return answer

    async def evidence(self, node_id: str, runner_ids: list[str]) -> NodeEvidence:
        """The stacks, process state and memory of runners of one node, captured now
        (within `EVIDENCE_WAIT_S`).

        Raises:
            BusError: as `node`.
        """
        subject = self.layout.subjects.node_evidence(node_id)
        asked = encode(EvidenceRequest(runnerIds=runner_ids))
        try:
            reply = await self.nc.request(subject, asked, timeout=EVIDENCE_WAIT_S)
            captured: NodeEvidence = decode(reply.data, NodeEvidence)
        except NoRespondersError:
            raise BusError(404, f"no agent of node {node_id!r} is listening") from None
        except (NatsError, TimeoutError):
            raise BusError(
                503, f"the agent of node {node_id!r} captured nothing within {EVIDENCE_WAIT_S:g}s"
            ) from None
        except WireError as exc:
            raise BusError(502, f"the agent of node {node_id!r} answered nonsense: {exc}") from None
        return captured

    async def submit(self, task: TaskCreated, nodes: Iterable[str]) -> None:
        """Submit `task` to every rank of its instance, on `nodes`: each node's copy whole,
        then the task without its request on the tasks stream, which orders it among the
        instance's tasks (its ranks wait for it there and read their copy then).

        Raises:
            BusError: 503 when JetStream did not take it.
        """
        subjects = self.layout.subjects
        await asyncio.gather(
            *(
                self.publish(
                    subjects.task_input(node, task.instanceId, task.taskId),
                    encode(task),
                    f"{task.taskId}:{token(node)}",
                )
                for node in sorted(set(nodes))
            )
        )
        ordered = msgspec.structs.replace(task, request=None)
        await self.publish(subjects.tasks(task.instanceId), encode(ordered), task.taskId)

    async def cancel(self, instance_id: str, task_id: str) -> None:
        """Ask every rank of an instance to stop a task.

        Raises:
            BusError: 503 when JetStream did not take the request.
        """
        cancel = TaskCreated(
            at=now(),
            deadline=later(TASK_HORIZON_S),
            taskId=f"cancel-{task_id}",
            instanceId=instance_id,
            taskKind=TaskKind.CANCEL_TASK,
            targetTaskId=task_id,
        )
        await self.publish(self.layout.subjects.tasks(instance_id), encode(cancel), cancel.taskId)

    async def kv(self, bucket: str) -> KeyValue:
        """A KV bucket handle (cached)."""
        if bucket not in self._kv:
            try:
                self._kv[bucket] = await self.js.key_value(bucket)
            except (NatsError, TimeoutError) as exc:
                raise BusError(503, f"NATS bucket {bucket} unavailable: {exc}") from None
        return self._kv[bucket]

    async def get(self, bucket: str, key: str) -> bytes | None:
        """A value, or None when the key does not exist."""
        found = await self.entry(bucket, key)
        return None if found is None else found[0]

    async def entry(self, bucket: str, key: str) -> tuple[bytes, int] | None:
        """A value and its revision, or None when the key does not exist."""
        store = await self.kv(bucket)
        try:
            entry = await store.get(token(key))
        except KeyNotFoundError:
            return None
        except (NatsError, TimeoutError) as exc:
            raise BusError(503, f"NATS read failed: {exc}") from None
        return entry.value or b"", entry.revision or 0

    async def values(self, bucket: str) -> dict[str, bytes]:
        """Every value of a bucket by key."""
        found: dict[str, bytes] = {}

        async def keep(entry: KeyValue.Entry) -> None:
            if entry.operation is None and entry.value is not None:
                found[untoken(entry.key)] = entry.value

        try:
            follower = await follow_bucket(self.js, bucket, keep)
            try:
                await asyncio.wait_for(follower.caught_up.wait(), self.timeout)
            finally:
                await follower.stop()
        except (NatsError, TimeoutError) as exc:
            raise BusError(503, f"NATS read failed: {exc or type(exc).__name__}") from None
        return found

    async def put(self, bucket: str, key: str, value: bytes) -> int:
        """Write a value; its revision."""
        try:
            return await (await self.kv(bucket)).put(token(key), value)
        except (NatsError, TimeoutError) as exc:
            raise BusError(503, f"NATS write failed: {exc}") from None

    async def create(self, bucket: str, key: str, value: bytes) -> int | None:
        """Write a value only if the key holds none (atomically); its revision, or None
        when the key exists."""
        try:
            return await (await self.kv(bucket)).create(token(key), value)
        except KeyWrongLastSequenceError:
            return None
        except (NatsError, TimeoutError) as exc:
            raise BusError(503, f"NATS write failed: {exc}") from None

    async def update(self, bucket: str, key: str, value: bytes, revision: int) -> int | None:
        """Write a value only if the key is still at `revision` (atomically); its new
        revision, or None when it changed meanwhile (or was deleted)."""
        try:
            return await (await self.kv(bucket)).update(token(key), value, last=revision)
        except KeyWrongLastSequenceError:
            return None
        except (NatsError, TimeoutError) as exc:
            raise BusError(503, f"NATS write failed: {exc}") from None

    async def delete(self, bucket: str, key: str) -> None:
        """Delete a value."""
        try:
            await (await self.kv(bucket)).delete(token(key))
        except (NatsError, TimeoutError) as exc:
            raise BusError(503, f"NATS write failed: {exc}") from None

    async def publish(self, subject: str, payload: bytes, msg_id: str) -> None:
        """Publish to JetStream and wait for the ack (through a leader election)."""
        try:
            await publish_acked(self.js, subject, payload, msg_id=msg_id)
        except (NatsError, TimeoutError) as exc:
            raise BusError(503, f"NATS publish failed: {exc}") from None

    async def fr_load(self, job_id: str) -> FrLoad | None:
        """The newest Flight Recorder dumps loaded as `job_id`, or None."""
        try:
            raw = await self.js.get_last_msg(
                self.layout.fr_stream.name, self.layout.subjects.fr_load(job_id)
            )
        except NotFoundError:
            return None
        except (NatsError, TimeoutError) as exc:
            raise BusError(503, f"NATS read failed: {exc}") from None
        try:
            return decode(raw.data or b"", FrLoad)
        except WireError:
            return None  # the gateway checked it as it came: a stream of another release

    async def ranktable(self, job_id: str) -> tuple[int, RankTableStream] | None:
        """The latest rank table of a job and its version, or None."""
        try:
            raw = await self.js.get_last_msg(
                self.layout.ranktable_stream.name, self.layout.subjects.ranktable(job_id)
            )
        except NotFoundError:
            return None
        except (NatsError, TimeoutError) as exc:
            raise BusError(503, f"NATS read failed: {exc}") from None
        version = int((raw.headers or {}).get(VERSION_HEADER, "0"))
        return version, decode(raw.data or b"", RankTableStream)

    async def findings(
        self, *, since: str | None, instance_id: str | None, limit: int
    ) -> list[Finding]:
        """The last word of each incident (open or cleared, by its id) published from
        `since` on, of one instance or all, oldest first; the newest `limit` of them.

        Raises:
            BusError: 503 when the diagnosis stream cannot be read in time.
        """
        return last_words(await self.published(since=since, instance_id=instance_id))[-limit:]

    async def published(
        self, *, since: str | None = None, instance_id: str | None = None
    ) -> list[Finding]:
        """The findings in the diagnosis stream from `since` on, of one instance or all."""
        subjects = self.layout.subjects
        subject = subjects.diagnosis(instance_id) if instance_id else subjects.diagnosis_all()
        found: list[Finding] = []
        start = parse_ts(since) if since else None

        async def keep(msg: Msg) -> None:
            if start is not None and msg.metadata.timestamp < start:
                return  # a server may start a consumer by time before it, never after
            with contextlib.suppress(WireError):  # the aggregator wrote it; nothing else may
                found.append(decode(msg.data, Finding))

        try:
            follower = await follow(self.js, subject, keep, start_time=start)
            try:
                await asyncio.wait_for(follower.caught_up.wait(), self.timeout)
            finally:
                await follower.stop()
        except (NatsError, TimeoutError) as exc:
            raise BusError(503, f"the diagnosis stream could not be read: {exc}") from None
        return found

    async def memory_samples(
        self, *, instance_id: str | None, since: datetime, limit: int
    ) -> list[MemorySampled]:
        """The memory samples stored from `since` on, of one instance or all.

        Raises:
            BusError: 503 when the runner stream cannot be read in time; 413 when there
                are more than `limit` of them.
        """
        found: list[MemorySampled] = []
        full = asyncio.Event()

        async def keep(msg: Msg) -> None:
            if msg.metadata.timestamp < since or full.is_set():
                return  # a server may start a consumer by time before it, never after
            try:
                found.append(decode(msg.data, MemorySampled))
            except WireError:
                return  # the aggregator dead-letters it
            if len(found) > limit:
                full.set()

        subject = self.layout.subjects.memory_of_instance(instance_id)
        try:
            follower = await follow(self.js, subject, keep, start_time=since)
            try:
                done = asyncio.ensure_future(follower.caught_up.wait())
                over = asyncio.ensure_future(full.wait())
                await asyncio.wait(
                    {done, over}, timeout=self.timeout, return_when="FIRST_COMPLETED"
                )
                done.cancel()
                over.cancel()
                if not follower.caught_up.is_set() and not full.is_set():
                    raise TimeoutError
            finally:
                await follower.stop()
        except (NatsError, TimeoutError) as exc:
            raise BusError(503, f"the runner stream could not be read: {exc}") from None
        if full.is_set():
            raise BusError(
                413, f"more than {limit} memory samples: ask for a shorter span or one instance"
            )
        return found

    async def jobs(self) -> list[str]:
        """Every job that has a rank table."""
        prefix = self.layout.subjects.ranktable("x")[:-1]
        try:
            info = await self.js.stream_info(
                self.layout.ranktable_stream.name,
                subjects_filter=self.layout.subjects.ranktable_all(),
            )
        except (NatsError, TimeoutError) as exc:
            raise BusError(503, f"NATS read failed: {exc}") from None
        return sorted(untoken(s[len(prefix) :]) for s in (info.state.subjects or {}))
