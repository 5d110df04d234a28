"""OpenAI's model list: what `model` a chat completion may name, so `client.models.list()`
and chat UIs can pick one. Each Runner spec is a model (its id), and so is the model it
serves (`worker.model.id`), as the chat route takes either."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from rankscope.services.gateway.bus import Bus
from rankscope.services.gateway.deps import Nats, reader
from rankscope.services.gateway.responses import Json, fail
from rankscope.shared.timestamps import to_epoch
from rankscope.shared.wire import Runner, decode

__all__ = ["router"]

router = APIRouter(tags=["chat"])


def _created(runner: Runner) -> int:
    try:
        return int(to_epoch(runner.created_at or ""))
    except ValueError:
        return 0


async def _models(nats: Bus) -> dict[str, dict[str, Any]]:
    """OpenAI `model` objects by id, from the Runner specs."""
    models: dict[str, dict[str, Any]] = {}
    for raw in (await nats.values(nats.layout.runners_bucket.bucket)).values():
        runner = decode(raw, Runner)
        cluster = runner.nodepool.compute_cluster if runner.nodepool else None
        owner = (cluster.user_id if cluster else "") or "rankscope"
        served = runner.worker.model.id if runner.worker and runner.worker.model else ""
        for model_id in (runner.id, served):
            if model_id and model_id not in models:
                models[model_id] = {
                    "id": model_id,
                    "object": "model",
                    "created": _created(runner),
                    "owned_by": owner,
                }
    return models


@router.get("/v1/models", response_class=Json, dependencies=[Depends(reader)])
async def list_models(nats: Nats) -> Json:
    """Every model a chat completion may name (OpenAI `GET /v1/models`), by id."""
    models = await _models(nats)
    return Json({"object": "list", "data": [models[m] for m in sorted(models)]})


@router.get("/v1/models/{model_id}", response_class=Json, dependencies=[Depends(reader)])
async def get_model(model_id: str, nats: Nats) -> Json:
    """One model (OpenAI `GET /v1/models/{model}`); 404 for one no spec names."""
    found = (await _models(nats)).get(model_id)
    if found is None:
        raise fail(404, f"no model {model_id!r}")
    return Json(found)
