"""Model shapes asked of the nodes: the rank-table service holds no model, so the agents,
which load them, read a model's layer count and size where it lives."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError

from rankscope.shared.model_shape import ModelShape, Unsupported
from rankscope.shared.subjects import Subjects
from rankscope.shared.wire import ModelShapeAnswer, ModelShapeRequest, WireError, decode, encode

__all__ = ["ASK_TIMEOUT_S", "ModelShapes"]

log = logging.getLogger(__name__)

ASK_TIMEOUT_S = 3.0
"""How long a node may take to read a model's shape (its config and file sizes)."""


class ModelShapes:
    """The shape of each model path, from the first node that could read it, kept.

    Args:
        nc: NATS connection (request/reply to the agents).
        subjects: subject builders.
        timeout: seconds each node may take to answer.
    """

    def __init__(self, nc: Client, subjects: Subjects, *, timeout: float = ASK_TIMEOUT_S) -> None:
        self._nc = nc
        self._subjects = subjects
        self._timeout = timeout
        self._known: dict[str, ModelShape] = {}

    def known(self, path: str) -> ModelShape | None:
        """The shape of `path` if a node has told it."""
        return self._known.get(path)

    def learn(self, path: str, shape: ModelShape) -> None:
        """Remember a shape told before (by the placements of a previous run)."""
        self._known.setdefault(path, shape)

    async def _ask(self, node_id: str, path: str) -> ModelShape | Unsupported | str:
        subject = self._subjects.node_model(node_id)
        try:
            reply = await self._nc.request(
                subject, encode(ModelShapeRequest(modelPath=path)), timeout=self._timeout
            )
            answer = decode(reply.data, ModelShapeAnswer)
        except NoRespondersError:
            return f"{node_id}: no agent listening"
        except (TimeoutError, NatsError):
            return f"{node_id}: no answer within {self._timeout:g}s"
        except WireError as exc:
            return f"{node_id}: an answer that does not decode ({exc})"
        if answer.unsupported is not None:
            return Unsupported(f"{answer.unsupported} (as read on {node_id})")
        if answer.nLayers is None or answer.modelBytes is None:
            return f"{node_id}: {answer.error or 'no shape given'}"
        return ModelShape(
            n_layers=answer.nLayers,
            model_bytes=answer.modelBytes,
            kv_shared_layers=answer.kvSharedLayers,
        )

    async def ask(self, path: str, nodes: Sequence[str]) -> ModelShape | Unsupported | str:
        """Ask every node in `nodes` at once for the shape of `path`; the first shape
        told (kept for next time), a node's word that it cannot run anywhere, or why no
        node could tell it."""
        if not nodes:
            return "no live node to read it"
        pending = {asyncio.ensure_future(self._ask(n, path)) for n in nodes}
        problems: list[str] = []
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    found = task.result()
                    if isinstance(found, Unsupported):
                        return found
                    if isinstance(found, ModelShape):
                        self._known[path] = found
                        log.info("model %s: %d layers, %d bytes", path, found.n_layers,
                                 found.model_bytes)  # fmt: skip
                        return found
                    problems.append(found)
        finally:
            for task in pending:
                task.cancel()
        return "; ".join(sorted(problems))
