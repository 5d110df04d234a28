"""OpenAI-compatible chat completions, served by a ready instance of the requested model.

The completion id is the task's `commandId`, so a completion can be found in the timeline.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Request
from nats.aio.msg import Msg
from starlette.responses import StreamingResponse

from services.gateway.bodies import strict
from services.gateway.bus import Bus
from services.gateway.deps import bus, writer
from services.gateway.responses import Json, fail, schema_ref
from shared.timestamps import now
from shared.wire import (
    ChatMessage,
    GenerationRequest,
    InstanceState,
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
from shared.wire.base import SnakeStruct

__all__ = ["ChatRequest", "router"]

log = logging.getLogger(__name__)
router = APIRouter(tags=["chat"])
Nats = Annotated[Bus, Depends(bus)]
GENERATION_TIMEOUT_S = 300.0
FINAL_CHUNK_GRACE_S = 5.0
"""How long the last chunk may trail the `Complete` status of its rank before it counts as
lost: both come from the same agent, the status batched with its telemetry."""


class Message(SnakeStruct, kw_only=True, frozen=True):
    """A chat message."""

    role: str
    content: str


class ChatRequest(SnakeStruct, kw_only=True, frozen=True):
    """What OpenAI clients send; `model` is a Runner spec id or a model id."""

    model: str
    messages: list[Message]
    stream: bool = False
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 0.0
    user: str | None = None


async def _body(request: Request) -> bytes:
    return await request.body()


async def _instance(nats: Bus, model: str) -> InstanceState:
    states = decode(await nats.query("instances"), list[InstanceState])
    serving = [s for s in states if model in (s.runnerSpecId, s.modelId)]
    if not serving:
        raise fail(404, f"no instance serves model {model!r}")
    ready = [s for s in serving if s.ready]
    if not ready:
        raise fail(503, f"no ready instance of {model!r} yet ({len(serving)} starting)")
    return ready[0]


async def _chunks(nats: Bus, task: TaskCreated, speaker: str) -> AsyncIterator[TokenChunk]:
    """Submit the task and yield its output chunks, as node `speaker` (the node of the
    instance's last rank) sends them, in order until the last.

    Output travels on core NATS, which does not resend: a chunk lost on the way (or one
    that cannot be decoded) ends the answer with a 502 naming the missing `seq`s, never a
    reply with a hole in its text; so does a last chunk still missing
    `FINAL_CHUNK_GRACE_S` after the speaker reported the task complete. A rank that
    reports the task failed or timed out ends it with a 502 saying why, without waiting
    out the deadline."""
    assert task.commandId is not None
    subjects = nats.layout.subjects
    output = subjects.output(task.commandId, speaker)
    speaker_status = subjects.task_status(task.instanceId, speaker)
    arrived: asyncio.Queue[Msg] = asyncio.Queue()
    subscriptions = [
        await nats.nc.subscribe(output, cb=arrived.put),
        await nats.nc.subscribe(subjects.task_statuses(task.instanceId), cb=arrived.put),
    ]
    try:
        await nats.publish(subjects.tasks(task.instanceId), encode(task), task.taskId)
        deadline, expected, completed = time.monotonic() + GENERATION_TIMEOUT_S, 0, False
        while True:
            try:
                msg = await asyncio.wait_for(arrived.get(), deadline - time.monotonic())
            except TimeoutError:
                if completed:
                    raise fail(
                        502,
                        f"output chunks from {expected} on of {task.commandId} were lost on "
                        "the way; the generation itself finished (see the timeline)",
                    ) from None
                raise fail(504, f"no output within {GENERATION_TIMEOUT_S:g}s") from None
            if msg.subject != output:
                if _completed(msg, task.taskId) and msg.subject == speaker_status:
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
            yield chunk
            if chunk.finishReason is not None:
                return
    finally:
        for subscription in subscriptions:
            await subscription.unsubscribe()


def _completed(msg: Msg, task_id: str) -> bool:
    """Whether `msg` is a rank reporting task `task_id` complete; a 502 when it reports
    it failed or timed out."""
    try:
        event = decode(msg.data, TaskEvent)
    except WireError:
        return False  # the status stream's readers count it; this reply does not need it
    if not isinstance(event, TaskStatusChanged) or event.taskId != task_id:
        return False
    if event.taskStatus in (TaskStatus.FAILED, TaskStatus.TIMED_OUT):
        reason = event.detail or event.taskStatus.value
        raise fail(502, f"the task failed on {event.runnerId or 'a rank'}: {reason}")
    return event.taskStatus is TaskStatus.COMPLETE


@router.post(
    "/v1/chat/completions",
    response_class=Json,
    dependencies=[Depends(writer)],
    openapi_extra={"requestBody": schema_ref(ChatRequest)},
)
async def chat_completions(nats: Nats, body: Annotated[bytes, Depends(_body)]) -> object:
    """Generate a reply; with `stream: true`, as server-sent chunks ending in `[DONE]`."""
    request = strict(body, ChatRequest)
    if not request.messages:
        raise fail(422, "invalid body: `$.messages` is empty")
    instance = await _instance(nats, request.model)
    completion = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    limit = request.max_completion_tokens or request.max_tokens or 128
    task = TaskCreated(
        at=now(),
        taskId=f"task-{uuid.uuid4().hex[:16]}",
        instanceId=instance.instanceId,
        taskKind=TaskKind.TEXT_GENERATION,
        commandId=completion,
        modelId=instance.modelId,
        request=GenerationRequest(
            messages=[ChatMessage(role=m.role, content=m.content) for m in request.messages],
            maxTokens=max(limit, 1),
            temperature=request.temperature,
        ),
    )
    created = int(time.time())
    speaker = max(instance.ranks, key=lambda rank: rank.deviceRank).nodeId
    if request.stream:
        return StreamingResponse(
            _stream(nats, task, speaker, request.model, created), media_type="text/event-stream"
        )
    text, last = "", None
    async for chunk in _chunks(nats, task, speaker):
        text, last = text + chunk.text, chunk
    assert last is not None
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


async def _stream(
    nats: Bus, task: TaskCreated, speaker: str, model: str, created: int
) -> AsyncIterator[bytes]:
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
    yield b"data: " + encode(first) + b"\n\n"
    try:
        async for chunk in _chunks(nats, task, speaker):
            delta = {"content": chunk.text} if chunk.text else {}
            piece = {
                **base,
                "choices": [{"index": 0, "delta": delta, "finish_reason": chunk.finishReason}],
            }
            yield b"data: " + encode(piece) + b"\n\n"
    except HTTPException as exc:  # the status line is sent: the error goes in the stream
        error = {"message": exc.detail, "type": "server_error", "code": exc.status_code}
        yield b"data: " + encode({"error": error}) + b"\n\n"
        return
    yield b"data: [DONE]\n\n"
