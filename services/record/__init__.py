"""`rankscope record`: the flight recorder for MLX and torch.distributed programs rankscope
did not start.

From inside an MLX program, when no launcher passes `rankscope record`'s environment on::

    from rankscope.services.record import start, step

    start(job="train-7")            # before mx.distributed.init()
    with step("forward"):           # optional: named steps on the rank's timeline
        ...
"""

from __future__ import annotations

import os

from rankscope.services.record.hook import step
from rankscope.shared.recording import Handoff

__all__ = ["start", "step"]


def start(job: str | None = None, node: str | None = None) -> None:
    """Record this process from its `mx.distributed.init()` on (call it before that):
    `job` names the job every rank must share (else rank 0 draws one), `node` this
    machine (else its host name)."""
    import mlx.core as mx

    from rankscope.services.record import hook

    if job:
        os.environ[Handoff.JOB] = job
    if node:
        os.environ[Handoff.NODE] = node
    hook.install(mx)
