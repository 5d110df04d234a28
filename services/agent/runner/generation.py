"""One text generation across the pipeline, recorded phase by phase.

Every rank runs the same loop on the same tokens (the pipeline all-gathers the last
hidden state), so every rank samples the same token and stops at the same step; the last
stage speaks for the instance and sends the text.

No barrier fences prefill or decode: the task agreement meets every rank right before
prefill, and the pipeline's own transfers hold each rank to its neighbours' pace, so a
rank left waiting for a peer waits in `prefill_pipeline` or `decode_stream`, under the
same collective deadline. (A decode barrier also waited behind the step mlx-lm queues one
token ahead: a whole step before the first token could be sent.)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from rankscope.services.agent.runner.config import RunnerConfig
from rankscope.services.agent.runner.recorder import Recorder
from rankscope.services.agent.runner.shard import LoadedShard
from rankscope.services.agent.runner.watchdog import Watchdog
from rankscope.shared.wire import Attrs, Phase, TaskCreated

__all__ = ["CANCEL_CHECK_EVERY", "PREFILL_CHUNK", "STREAM", "Generation", "RefusedError", "barrier"]


class RefusedError(ValueError):
    """A task that cannot run as asked (a prompt past the model's context): the same on
    every rank, found before any collective."""


PREFILL_CHUNK = 2048
"""Prompt tokens prefilled in one step (mlx-lm's default): each chunk through every rank is
progress, recorded and renewing the collective deadline, however long the prompt."""

CANCEL_CHECK_EVERY = 4
"""Tokens between votes on a cancel; a vote's count is read at the next one, so every rank
stops at the same step, at most twice this many tokens after the cancel arrived."""


STREAM = generation_stream
"""The stream of every collective a runner runs. mlx-lm generates on it, and collectives
on two streams run concurrently and mix their bytes on the ring (a step still in flight
after an early stop would pair with the next task agreement)."""


def barrier(group: Any) -> None:
    """Wait until every rank gets here."""
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=STREAM))


class Generation:
    """Runs text-generation tasks for one rank.

    Args:
        config: the rank.
        shard: the loaded model slice and tokenizer.
        group: the ring group.
        recorder: where phases go.
        watchdog: deadlines for blocking steps.
        cancelled: whether this rank has seen a cancel for a task id.
    """

    def __init__(
        self,
        *,
        config: RunnerConfig,
        shard: LoadedShard,
        group: Any,
        recorder: Recorder,
        watchdog: Watchdog,
        cancelled: Callable[[str], bool],
    ) -> None:
        self._config = config
        self._shard = shard
        self._group = group
        self._recorder = recorder
        self._watchdog = watchdog
        self._cancelled = cancelled
        self.step = 0

    def _attrs(self, **extra: int | float | str) -> Attrs:
        rank = self._config.assignment
        return {
            "step": self.step,
            "rank": rank.deviceRank,
            "world_size": rank.worldSize,
            "src": rank.deviceRank - 1,
            "dst": rank.deviceRank + 1,
            **extra,
        }

    def _vote(self, task_id: str) -> mx.array:
        """Start a vote on cancelling `task_id`; its count is read a round later, when the
        steps queued after it have run, so reading it never stalls the pipeline."""
        local = self._cancelled(task_id)
        votes = mx.distributed.all_sum(
            mx.array(1 if local else 0), group=self._group, stream=STREAM
        )
        mx.async_eval(votes)  # type: ignore[no-untyped-call]
        return votes

    def _agreed(self, votes: mx.array | None) -> bool:
        if votes is None:
            return False
        with self._watchdog.guard("cancel_check", self._config.timeouts.collective):
            return bool(votes.item())

    def run(self, task: TaskCreated) -> str:
        """Generate for `task`; returns the finish reason (`stop`, `length`, `cancelled`)."""
        request = task.request
        assert request is not None

        def record(
            phase: Phase,
            event: str,
            *,
            attrs: Attrs | None = None,
            memory: bool = False,
            batch: bool = False,
        ) -> None:
            self._recorder.record(
                phase,
                event,
                attrs=attrs,
                memory=memory,
                batch=batch,
                task_id=task.taskId,
                command_id=task.commandId,
            )

        tokenizer, timeouts = self._shard.tokenizer, self._config.timeouts
        record(Phase.PROMPT_BUILD, "start")
        if request.messages:
            messages = [{"role": m.role, "content": m.content} for m in request.messages]
            prompt = tokenizer.apply_chat_template(  # type: ignore[no-untyped-call]
                messages, add_generation_prompt=True
            )
        else:
            prompt = tokenizer.encode(request.prompt or "")
        limit, context = request.maxTokens, self._shard.context_length
        if context is not None and len(prompt) >= context:
            raise RefusedError(
                f"the prompt is {len(prompt):,} tokens; the model's context is {context:,} "
                "(prompt and reply together)"
            )
        if context is not None:  # never past the model's context, whatever was asked
            limit = max(min(limit, context - len(prompt)), 1)
        record(Phase.KV_CACHE_LOOKUP, "fresh_cache", attrs={"prompt_tokens": len(prompt)})
        cache = make_prompt_cache(self._shard.model)
        sampler = (
            make_sampler(temp=request.temperature, top_p=request.topP)
            if request.temperature > 0
            else None
        )

        def prefilled(done: int, total: int) -> None:
            if done < total:  # a chunk of the prompt went through every rank
                self._watchdog.advance()
                record(
                    Phase.PREFILL_PIPELINE,
                    "prefill_chunk",
                    attrs={"prompt_tokens": total, "processed": done},
                    batch=True,
                )

        tokens = generate_step(
            mx.array(prompt),
            self._shard.model,
            max_tokens=limit,
            sampler=sampler,
            prompt_cache=cache,
            prefill_step_size=PREFILL_CHUNK,
            prompt_progress_callback=prefilled,
        )
        self.step += 1
        record(
            Phase.PREFILL_PIPELINE,
            "eval",
            attrs=self._attrs(prompt_tokens=len(prompt)),
            memory=True,
        )
        with self._watchdog.guard("prefill_pipeline", timeouts.collective):
            first = next(tokens, None)
        record(
            Phase.DECODE_WAIT_FIRST_TOKEN,
            "first_token",
            attrs={"prompt_tokens": len(prompt), "max_tokens": limit},
        )
        detokenizer = tokenizer.detokenizer
        detokenizer.reset()
        produced, finish, started = 0, "length", time.perf_counter()
        command = task.commandId or task.taskId
        votes: mx.array | None = None
        current = first
        while current is not None:
            token = int(cast(int, current[0]))
            if token in tokenizer.eos_token_ids:
                finish = "stop"
                break
            produced += 1
            detokenizer.add_token(token)
            segment = detokenizer.last_segment  # reading it consumes it
            if self._config.is_last_stage and segment:
                self._recorder.output(command, segment)
            if produced % CANCEL_CHECK_EVERY == 0:
                if self._agreed(votes):
                    record(Phase.CANCEL_OBSERVED, "agreed", attrs=self._attrs(tokens=produced))
                    finish = "cancelled"
                    break
                votes = self._vote(task.taskId)
            self.step += 1
            record(
                Phase.DECODE_STREAM,
                "token",
                attrs=self._attrs(token_index=produced),
                batch=True,
            )
            with self._watchdog.guard("decode_stream", timeouts.collective):
                current = next(tokens, None)
        record(Phase.PARSER, "finalize")
        detokenizer.finalize()
        elapsed = time.perf_counter() - started
        if self._config.is_last_stage:
            self._recorder.output(
                command, detokenizer.last_segment, finish, (len(prompt), produced)
            )
        record(
            Phase.COMPLETION,
            finish,
            memory=True,
            attrs={
                "tokens": produced,
                "tokens_per_second": round(produced / elapsed, 2) if elapsed > 0 else 0.0,
            },
        )
        return finish
