"""OpenAI-compatible chat completions, served by a ready instance of the requested model.

The completion id is the task's `commandId`, so a completion can be found in the timeline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from typing import Annotated, Any, Literal

import msgspec
from fastapi import APIRouter, Depends, HTTPException, Request
from nats.aio.msg import Msg
from sse_starlette import EventSourceResponse, ServerSentEvent

from rankscope.services.gateway.bodies import strict
from rankscope.services.gateway.bus import Bus, BusError
from rankscope.services.gateway.deps import Nats, writer
from rankscope.services.gateway.responses import SSE_PING_S, Json, fail, schema_ref
from rankscope.services.gateway.scatter import missing
from rankscope.shared.settings import Settings
from rankscope.shared.subjects import Subjects
from rankscope.shared.timestamps import later, now
from rankscope.shared.views import INSTANCES, InstancesQuery
from rankscope.shared.wire import (
    ChatMessage,
    GenerationRequest,
    InstanceState,
    RankState,
    TaskCreated,
    TaskEvent,
    TaskKind,
    TaskStatus,
    TaskStatusChanged,
    TokenChunk,
    WireError,
    decode,
    encode,
)
from rankscope.shared.wire.base import SnakeStruct

__all__ = ["ChatRequest", "router"]

log = logging.getLogger(__name__)
router = APIRouter(tags=["chat"])
GENERATION_TIMEOUT_S = 300.0
RANK_CHECK_S = 2.0
"""Seconds without output after which a chat checks that every rank of its instance lives."""
DISCONNECT_CHECK_S = 0.5
FAILURE_GRACE_S = 3.0
"""How long a chat whose task a rank reported failed waits for other ranks' reports."""
FINAL_CHUNK_GRACE_S = 5.0
"""How long the last chunk may trail the `Complete` status of its rank before it counts as
lost: both come from the same agent, the status batched with its telemetry."""


class Message(SnakeStruct, kw_only=True, frozen=True):
    """A chat message."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str


class ChatRequest(SnakeStruct, kw_only=True, frozen=True):
    """What OpenAI clients send; `model` is a Runner spec id or a model id. Every field of
    OpenAI's request is known; those rankscope cannot honour are refused by name
    (`unsupported`) unless they ask for what it does anyway."""

    model: str
    messages: list[Message]
    stream: bool = False
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] = 0.0
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    n: Annotated[int, msgspec.Meta(ge=1)] = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] = 0.0
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    stream_options: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    user: str | None = None


def unsupported(request: ChatRequest) -> str | None:
    """Why rankscope cannot do what `request` asks, naming the field, or None."""
    asked = {
        "n": request.n != 1,
        "stop": bool(request.stop),
        "seed": request.seed is not None and request.temperature > 0,
        "frequency_penalty": request.frequency_penalty != 0,
        "presence_penalty": request.presence_penalty != 0,
        "logit_bias": bool(request.logit_bias),
        "logprobs": request.logprobs or request.top_logprobs is not None,
        "tools": bool(request.tools) or request.tool_choice not in (None, "none"),
        "functions": bool(request.functions) or request.function_call not in (None, "none"),
        "response_format": (request.response_format or {"type": "text"}).get("type") != "text",
    }
    refused = [field for field, asks in asked.items() if asks]
    if not refused:
        return None
    return (
        f"not supported by rankscope's runners: `{'`, `'.join(refused)}` "
        "(one greedy or sampled completion of plain text, temperature and top_p only)"
    )


async def _body(request: Request) -> bytes:
    return await request.body()


async def _instance(nats: Bus, model: str) -> InstanceState:
    states: list[InstanceState] = await nats.ask(INSTANCES)
    serving = [s for s in states if model in (s.runnerSpecId, s.modelId)]
    if not serving and (away := missing()):
        raise fail(503, f"no instance of {model!r} in the partitions that answered; "
                        f"partition {', '.join(map(str, away))} did not")  # fmt: skip
    if not serving:
        raise fail(404, f"no instance serves model {model!r}")
    ready = [s for s in serving if s.ready]
    if not ready:
        raise fail(503, f"no ready instance of {model!r} yet ({len(serving)} starting)")
    return ready[0]


async def _chunks(
    nats: Bus, task: TaskCreated, nodes: Mapping[str, str], speaker: str
) -> AsyncGenerator[TokenChunk, None]:
    """Submit the task and yield its output chunks, as node `speaker` (the node of the
    instance's last rank) sends them, in order until the last.

    Output travels on core NATS, which does not resend: a chunk lost on the way (or one
    that cannot be decoded) ends the answer with a 502 naming the missing `seq`s, never a
    reply with a hole in its text; so does a last chunk still missing
    `FINAL_CHUNK_GRACE_S` after the speaker reported the task complete. A rank that
    reports the task failed or timed out ends it with a 502 saying why (with every other
    rank that reports a failure within `FAILURE_GRACE_S`: the first to report is not
    always the one at fault), without waiting out the deadline."""
    assert task.commandId is not None
    subjects = nats.layout.subjects
    output = subjects.output(task.commandId, speaker)
    speaker_status = subjects.task_status(task.instanceId, speaker)
    arrived: asyncio.Queue[Msg] = asyncio.Queue()
    subscriptions = [
        await nats.nc.subscribe(output, cb=arrived.put),
        await nats.nc.subscribe(subjects.task_statuses(task.instanceId), cb=arrived.put),
    ]
    finished = False
    try:
        await nats.submit(task, nodes.values())
        deadline, expected, completed = time.monotonic() + GENERATION_TIMEOUT_S, 0, False
        failures: list[TaskStatusChanged] = []
        while True:
            try:
                left = deadline - time.monotonic()
                msg = await asyncio.wait_for(arrived.get(), min(left, RANK_CHECK_S))
            except TimeoutError:
                if time.monotonic() < deadline:
                    await _ranks_alive(nats, task.instanceId)
                    continue
                if failures:
                    raise _failure(failures, await _dropped(nats, task.instanceId)) from None
                if completed:
                    raise fail(
                        502,
                        f"output chunks from {expected} on of {task.commandId} were lost on "
                        "the way; the generation itself finished (see the timeline)",
                    ) from None
                raise fail(504, f"no output within {GENERATION_TIMEOUT_S:g}s") from None
            if msg.subject != output:
                status = _status_of(msg, task.taskId, nodes, subjects)
                if status is None:
                    continue
                if status.taskStatus is TaskStatus.FAILED and status.refused:
                    raise _failure([status])  # every rank refuses it alike: no need to wait
                if status.taskStatus in (TaskStatus.FAILED, TaskStatus.TIMED_OUT):
                    failures.append(status)
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
                elif status.taskStatus is TaskStatus.COMPLETE and msg.subject == speaker_status:
                    completed = True
                    deadline = min(deadline, time.monotonic() + FINAL_CHUNK_GRACE_S)
                continue
            try:
                chunk = decode(msg.data, TokenChunk)
            except WireError as exc:
                log.warning("undecodable output chunk of %s: %s", task.commandId, exc)
                continue  # its seq will be missing
            if chunk.seq < expected:
                continue  # seen already
            if chunk.seq > expected:
                lost = f"{expected}" if chunk.seq == expected + 1 else f"{expected}-{chunk.seq - 1}"
                raise fail(
                    502,
                    f"output chunks {lost} of {task.commandId} were lost on the way; "
                    "the generation itself may have finished (see the timeline)",
                )
            expected += 1
            if chunk.finishReason is not None:
                finished = True
            yield chunk
            if finished:
                return
    finally:
        if not finished:  # the client left, a rank failed, the deadline passed: nobody
            # is waiting for the rest, so no rank goes on generating it
            _cancel(nats, task)
        for subscription in subscriptions:
            await subscription.unsubscribe()


_cancelling: set[asyncio.Task[None]] = set()


def _cancel(nats: Bus, task: TaskCreated) -> None:
    """Ask every rank to stop `task`, in a task of its own: a closing stream must not wait
    for it, nor be able to cancel it half way."""
    sending = asyncio.get_running_loop().create_task(nats.cancel(task.instanceId, task.taskId))
    _cancelling.add(sending)
    sending.add_done_callback(_settled)


def _settled(sending: asyncio.Task[None]) -> None:
    _cancelling.discard(sending)
    if not sending.cancelled() and sending.exception() is not None:
        log.warning("could not cancel a task: %s", sending.exception())


async def _ranks_alive(nats: Bus, instance_id: str) -> None:
    """A 502 naming the ranks that dropped out of the generation (or the instance gone)."""
    dropped = await _dropped(nats, instance_id)
    if dropped:
        raise fail(502, _lost(dropped))


async def _dropped(nats: Bus, instance_id: str) -> list[RankState]:
    """The ranks of a generating instance that are lost, or no longer ready or serving (one
    killed and already restarting is not running the task either): those that failed on
    their own first, those that only gave up on a failed peer after them. A 502 when the
    instance is gone; none when the aggregator cannot tell now (the deadline still holds)."""
    try:
        # of the instance's partition alone: an instance missing from the answer is gone
        states: list[InstanceState] = await nats.ask(
            INSTANCES, InstancesQuery(instanceId=instance_id)
        )
    except (BusError, WireError):
        return []
    state = next((s for s in states if s.instanceId == instance_id), None)
    if state is None:
        raise fail(502, f"instance {instance_id} was released while generating")
    return sorted((r for r in state.ranks if r.lost or not r.ready), key=lambda r: r.gaveUp)


def _lost(dropped: list[RankState]) -> str:
    return "lost while generating: " + ", ".join(
        f"rank {r.deviceRank} on {r.nodeId} ({r.statusKind or 'no status'}"
        + (", gave up on a peer)" if r.gaveUp else ")")
        for r in dropped
    )


def _status_of(
    msg: Msg, task_id: str, nodes: Mapping[str, str], subjects: Subjects
) -> TaskStatusChanged | None:
    """A rank's status of task `task_id`, if that is what `msg` holds and it came from the
    node its rank runs on (`nodes`: by runner id); no node speaks for another's rank."""
    try:
        event = decode(msg.data, TaskEvent)
    except WireError:
        return None  # the status stream's readers count it; this reply does not need it
    if not isinstance(event, TaskStatusChanged) or event.taskId != task_id:
        return None
    node = nodes.get(event.runnerId or "")
    if node is None or msg.subject != subjects.task_status(event.instanceId, node):
        return None
    return event


def _failure(failures: list[TaskStatusChanged], dropped: Sequence[RankState] = ()) -> HTTPException:
    """The answer to a task the ranks reported failed: a 422 when they refused it as asked
    (the request is at fault), else a 502 naming first the `dropped` ranks that said
    nothing of it (a rank killed cannot), then those that did."""
    if all(f.refused for f in failures):
        return fail(422, failures[0].detail or "the ranks refused the request")
    reported = {f.runnerId for f in failures}
    silent = [r for r in dropped if r.runnerId not in reported]
    return fail(502, "; ".join(([_lost(silent)] if silent else []) + [_failed(failures)]))


def _failed(failures: list[TaskStatusChanged]) -> str:
    """The ranks that reported the task failed, and why, in the order they did."""
    return "the task failed on " + "; on ".join(
        f"{f.runnerId or 'a rank'}: {f.detail or f.taskStatus.value}" for f in failures
    )


@router.post(
    "/v1/chat/completions",
    response_class=Json,
    dependencies=[Depends(writer)],
    openapi_extra={"requestBody": schema_ref(ChatRequest)},
)
async def chat_completions(
    http: Request, nats: Nats, body: Annotated[bytes, Depends(_body)]
) -> object:
    """Generate a reply; with `stream: true`, as server-sent chunks ending in `[DONE]`.
    A client that goes away cancels the generation on every rank."""
    request = strict(body, ChatRequest)
    if not request.messages:
        raise fail(422, "invalid body: `$.messages` is empty")
    if (why := unsupported(request)) is not None:
        raise fail(422, why)
    limit = _token_limit(request, http.app.state.settings)
    instance = await _instance(nats, request.model)
    completion = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    task = TaskCreated(
        at=now(),
        deadline=later(GENERATION_TIMEOUT_S),
        taskId=f"task-{uuid.uuid4().hex[:16]}",
        instanceId=instance.instanceId,
        taskKind=TaskKind.TEXT_GENERATION,
        commandId=completion,
        modelId=instance.modelId,
        request=GenerationRequest(
            messages=[ChatMessage(role=m.role, content=m.content) for m in request.messages],
            maxTokens=limit,
            temperature=request.temperature,
            topP=request.top_p,
        ),
    )
    created = int(time.time())
    speaker = max(instance.ranks, key=lambda rank: rank.deviceRank).nodeId
    nodes = {rank.runnerId: rank.nodeId for rank in instance.ranks}
    if request.stream:
        return EventSourceResponse(
            _stream(nats, task, nodes, speaker, request.model, created),
            ping=SSE_PING_S,
            sep="\n",
        )
    answer = asyncio.create_task(_collect(_chunks(nats, task, nodes, speaker)))
    while not answer.done():
        await asyncio.wait({answer}, timeout=DISCONNECT_CHECK_S)
        if not answer.done() and await http.is_disconnected():
            answer.cancel()  # its generator's cleanup cancels the task on every rank
            with contextlib.suppress(asyncio.CancelledError):
                await answer
            return Json({"detail": "the client closed the request"}, status_code=499)
    text, last = answer.result()
    prompt, produced = last.promptTokens or 0, last.completionTokens or 0
    return Json(
        {
            "id": completion,
            "object": "chat.completion",
            "created": created,
            "model": request.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": last.finishReason,
                }
            ],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": produced,
                "total_tokens": prompt + produced,
            },
        }
    )


def _token_limit(request: ChatRequest, settings: Settings) -> int:
    """The tokens to generate: as asked, within `chat_max_tokens`; a 422 above it."""
    field, asked = (
        ("max_completion_tokens", request.max_completion_tokens)
        if request.max_completion_tokens is not None
        else ("max_tokens", request.max_tokens)
    )
    if asked is None:
        return min(settings.chat_default_tokens, settings.chat_max_tokens)
    if asked < 1:
        raise fail(422, f"invalid body: `$.{field}` must be at least 1, not {asked}")
    if asked > settings.chat_max_tokens:
        raise fail(
            422,
            f"invalid body: `$.{field}` {asked:,} is over this gateway's limit of "
            f"{settings.chat_max_tokens:,} tokens (RANKSCOPE_CHAT_MAX_TOKENS)",
        )
    return asked


async def _collect(chunks: AsyncGenerator[TokenChunk, None]) -> tuple[str, TokenChunk]:
    """The whole text and the last chunk."""
    text, last = "", None
    try:
        async for chunk in chunks:
            text, last = text + chunk.text, chunk
    finally:
        await chunks.aclose()
    assert last is not None
    return text, last


async def _stream(
    nats: Bus,
    task: TaskCreated,
    nodes: Mapping[str, str],
    speaker: str,
    model: str,
    created: int,
) -> AsyncIterator[ServerSentEvent]:
    base = {
        "id": task.commandId,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
    }
    first = {
        **base,
        "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        ],
    }
    yield ServerSentEvent(data=encode(first).decode())
    chunks = _chunks(nats, task, nodes, speaker)
    try:
        async for chunk in chunks:
            delta = {"content": chunk.text} if chunk.text else {}
            piece = {
                **base,
                "choices": [{"index": 0, "delta": delta, "finish_reason": chunk.finishReason}],
            }
            yield ServerSentEvent(data=encode(piece).decode())
    except HTTPException as exc:  # the status line is sent: the error goes in the stream
        error = {"message": exc.detail, "type": "server_error", "code": exc.status_code}
        yield ServerSentEvent(data=encode({"error": error}).decode())
        return
    finally:
        await chunks.aclose()  # a client gone mid-stream cancels the task on every rank
    yield ServerSentEvent(data="[DONE]")
