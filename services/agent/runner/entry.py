"""The agent's doors into the runner's MLX code, opened only when used: a spawned runner
imports MLX in its own process, and the agent's process loads mlx-lm only once a model's
architecture is asked about, never to supervise."""

from __future__ import annotations

from multiprocessing.queues import Queue
from pathlib import Path

from rankscope.services.agent.runner.channel import ToAgent, ToRunner
from rankscope.services.agent.runner.config import RunnerConfig

__all__ = ["runner_main", "unsupported"]


def runner_main(
    config: RunnerConfig,
    telemetry: Queue[ToAgent],
    control: Queue[ToAgent],
    tasks: Queue[ToRunner],
) -> None:
    """Entry point of the spawned runner process."""
    from rankscope.services.agent.runner import process

    process.runner_main(config, telemetry, control, tasks)


def unsupported(path: Path) -> str | None:
    """Why this node's mlx-lm cannot split the model at `path`, if it cannot."""
    from rankscope.services.agent.runner import shard

    return shard.unsupported(path)
