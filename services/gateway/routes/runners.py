"""Runner specs in the Clarifai shape: list with paging, create, get, patch, delete."""

from __future__ import annotations

import asyncio
import time
import uuid
from enum import StrEnum
from typing import Annotated, Any

import msgspec
from fastapi import APIRouter, Depends, Query, Request

from rankscope.services.gateway.bodies import strict
from rankscope.services.gateway.bus import Bus
from rankscope.services.gateway.deps import Nats, reader, settings, writer
from rankscope.services.gateway.responses import Json, fail, schema_ref
from rankscope.shared.settings import Settings
from rankscope.shared.specs import SpecError, validate
from rankscope.shared.timestamps import now
from rankscope.shared.wire import Runner, RunnerSpecStatus, decode, encode
from rankscope.shared.wire.base import SnakeStruct

__all__ = ["router"]

router = APIRouter(tags=["runners"])


async def _settings(request: Request) -> Settings:
    return settings(request)


Configured = Annotated[Settings, Depends(_settings)]
OK = {"code": 10000, "description": "Ok"}
JUDGED_WAIT_S = 3.0
"""How long a create waits for the rank-table service to say what it made of a spec."""
PATCH_ATTEMPTS = 8
"""Writes of one patch tried before a 409: each that fails met a change written between
its read and its write, and applies the patch again to it."""


class PostRunnersRequest(SnakeStruct, kw_only=True, frozen=True):
    """Create runners (Clarifai `PostRunnersRequest`)."""

    runners: list[Runner]


class SpecNotJudged(SnakeStruct, kw_only=True, frozen=True):
    """A spec stored but not yet judged by the rank-table service."""

    runner_id: str
    revision: int
    accepted: None = None
    reason: str


class PatchAction(StrEnum):
    """How a patch applies: merge into, overwrite, or remove from the spec."""

    MERGE = "merge"
    OVERWRITE = "overwrite"
    REMOVE = "remove"


class PatchRunnerRequest(SnakeStruct, kw_only=True, frozen=True):
    """Change one runner: `runner` holds the fields to apply as `action` says."""

    runner: dict[str, Any]
    action: PatchAction = PatchAction.MERGE


class PatchRunnersRequest(SnakeStruct, kw_only=True, frozen=True):
    """Change runners (Clarifai `PatchRunnersRequest`): each of `runners` names its `id`
    and holds the fields to apply as `action` says."""

    runners: list[dict[str, Any]]
    action: PatchAction = PatchAction.MERGE


async def _body(request: Request) -> bytes:
    return await request.body()


def _check(runner: Runner, settings: Settings) -> None:
    try:
        validate(runner, max_replicas=settings.max_replicas)
    except SpecError as exc:
        raise fail(422, f"runner {runner.id!r}: {exc}") from None


def _with_status(runner: Runner, status: RunnerSpecStatus | None) -> Runner:
    if status is None:
        return runner
    return msgspec.structs.replace(runner, runner_metrics=status.runner_metrics)


async def _load(nats: Bus, runner_id: str) -> Runner:
    return (await _revision(nats, runner_id))[0]


async def _revision(nats: Bus, runner_id: str) -> tuple[Runner, int]:
    """The runner `runner_id` and its revision in the bucket; a 404 when there is none."""
    found = await nats.entry(nats.layout.runners_bucket.bucket, runner_id)
    if found is None:
        raise fail(404, f"runner {runner_id!r} not found")
    return decode(found[0], Runner), found[1]


async def _status(nats: Bus, runner_id: str) -> RunnerSpecStatus | None:
    raw = await nats.get(nats.layout.runner_status_bucket.bucket, runner_id)
    return decode(raw, RunnerSpecStatus) if raw else None


@router.get("/v1/runners", response_class=Json, dependencies=[Depends(reader)])
async def list_runners(
    nats: Nats,
    page: Annotated[int, Query(ge=1)] = 1,
    per_page: Annotated[int, Query(ge=1, le=1000)] = 128,
) -> Json:
    """Runner specs, sorted by id, `per_page` at a time from `page` 1; `runners` is always
    present, empty or not."""
    specs = await nats.values(nats.layout.runners_bucket.bucket)
    statuses = await nats.values(nats.layout.runner_status_bucket.bucket)
    ids = sorted(specs)[(page - 1) * per_page : page * per_page]
    runners = [
        _with_status(
            decode(specs[i], Runner),
            decode(statuses[i], RunnerSpecStatus) if i in statuses else None,
        )
        for i in ids
    ]
    return Json({"status": OK, "runners": runners})


@router.post(
    "/v1/runners",
    response_class=Json,
    dependencies=[Depends(writer)],
    openapi_extra={"requestBody": schema_ref(PostRunnersRequest)},
)
async def create_runners(
    nats: Nats, configured: Configured, body: Annotated[bytes, Depends(_body)]
) -> Json:
    """Create Runner specs; each is checked before any is written. `placements` says what
    the rank-table service made of each: accepted and placed, or why not."""
    request = strict(body, PostRunnersRequest)
    if not request.runners:
        raise fail(422, "invalid body: `$.runners` is empty")
    stamp = now()
    created = [
        msgspec.structs.replace(
            r, id=r.id or f"runner-{uuid.uuid4().hex[:12]}", created_at=stamp, modified_at=stamp
        )
        for r in request.runners
    ]
    for runner in created:
        _check(runner, configured)
        if await nats.get(nats.layout.runners_bucket.bucket, runner.id) is not None:
            raise fail(409, f"runner {runner.id!r} already exists")
    revisions = []
    for runner in created:
        revision = await nats.create(nats.layout.runners_bucket.bucket, runner.id, encode(runner))
        if revision is None:  # created by a concurrent request since the check
            raise fail(409, f"runner {runner.id!r} already exists")
        revisions.append(revision)
    placements = await _judged(nats, [r.id for r in created], revisions)
    return Json({"status": OK, "runners": created, "placements": placements})


async def _judged(
    nats: Bus, ids: list[str], revisions: list[int]
) -> list[RunnerSpecStatus | SpecNotJudged]:
    """What the rank-table service made of each spec at its revision: accepted, placed,
    or why not, waiting up to `JUDGED_WAIT_S` for its word."""
    deadline = time.monotonic() + JUDGED_WAIT_S
    while True:
        found = await asyncio.gather(*(_status(nats, i) for i in ids))
        judged = all(
            s is not None and s.revision >= r for s, r in zip(found, revisions, strict=True)
        )
        if judged or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.1)
    return [
        status
        if status is not None and status.revision >= revision
        else SpecNotJudged(
            runner_id=runner_id,
            revision=revision,
            reason=f"stored, not judged within {JUDGED_WAIT_S:g}s (is the rank-table service "
            f"running?): GET /v1/runners/{runner_id} tells once it is",
        )
        for runner_id, revision, status in zip(ids, revisions, found, strict=True)
    ]


@router.get(
    "/v1/runners/{runner_id}",
    response_class=Json,
    dependencies=[Depends(reader)],
    responses={200: schema_ref(Runner)},
)
async def get_runner(runner_id: str, nats: Nats) -> Json:
    """One Runner spec with its observed metrics, and what placement made of it."""
    status = await _status(nats, runner_id)
    runner = _with_status(await _load(nats, runner_id), status)
    return Json({"status": OK, "runner": runner, "placement": status})


def _key(item: Any) -> bytes:
    """A list item as a set member: its JSON, keys sorted (items are JSON values)."""
    return msgspec.json.encode(item, order="sorted")


def _merge(base: Any, change: Any) -> Any:
    if isinstance(base, dict) and isinstance(change, dict):
        return {**base, **{k: _merge(base.get(k), v) for k, v in change.items()}}
    if isinstance(base, list) and isinstance(change, list):
        seen = {_key(item) for item in base}  # linear: a long list must not take minutes
        merged = list(base)
        for item in change:
            if (key := _key(item)) not in seen:
                seen.add(key)
                merged.append(item)
        return merged
    return change


def _remove(base: Any, change: Any) -> Any:
    if isinstance(base, dict) and isinstance(change, dict):
        kept = dict(base)
        for key, value in change.items():
            if key in kept and isinstance(value, dict | list) and value:
                kept[key] = _remove(kept[key], value)
            else:
                kept.pop(key, None)
        return kept
    if isinstance(base, list) and isinstance(change, list):
        dropped = {_key(item) for item in change}
        return [item for item in base if _key(item) not in dropped]
    return base


async def _patched(
    nats: Bus, configured: Settings, runner_id: str, change: dict[str, Any], action: PatchAction
) -> tuple[Runner, int]:
    """The runner `runner_id` with `change` applied as `action` says, checked, not stored,
    and the revision it was applied to.

    Raises:
        HTTPException: 404 for an unknown runner, 422 for a change that breaks it.
    """
    if "id" in change and change["id"] != runner_id:
        raise fail(422, f"invalid body: the id of {runner_id!r} cannot change")
    stored, revision = await _revision(nats, runner_id)
    current = msgspec.to_builtins(stored)
    if action is PatchAction.MERGE:
        changed = _merge(current, change)
    elif action is PatchAction.OVERWRITE:
        changed = {**current, **change}
    else:
        changed = _remove(current, change)
    changed.update(id=runner_id, created_at=current.get("created_at"), modified_at=now())
    runner = strict(msgspec.json.encode(changed), Runner)
    _check(runner, configured)
    return runner, revision


async def _patch(
    nats: Bus,
    configured: Settings,
    change: dict[str, Any],
    action: PatchAction,
    first: tuple[Runner, int],
) -> Runner:
    """Store `first` (a change applied to its revision); when the spec changed meanwhile,
    apply the change again to what it is now, so that concurrent changes all hold.

    Raises:
        HTTPException: 409 when it kept changing, besides `_patched`'s.
    """
    runner, revision = first
    for _ in range(PATCH_ATTEMPTS):
        bucket = nats.layout.runners_bucket.bucket
        if await nats.update(bucket, runner.id, encode(runner), revision) is not None:
            return runner
        runner, revision = await _patched(nats, configured, runner.id, change, action)
    raise fail(409, f"runner {runner.id!r} kept changing while it was patched; try again")


@router.patch(
    "/v1/runners/{runner_id}",
    response_class=Json,
    dependencies=[Depends(writer)],
    openapi_extra={"requestBody": schema_ref(PatchRunnerRequest)},
)
async def patch_runner(
    runner_id: str, nats: Nats, configured: Configured, body: Annotated[bytes, Depends(_body)]
) -> Json:
    """Change a Runner spec: `merge` (dicts merged, lists extended), `overwrite` (given
    fields replaced), or `remove` (given keys and list items taken out). Concurrent
    changes of one spec all hold: none is lost to another written in between."""
    request = strict(body, PatchRunnerRequest)
    first = await _patched(nats, configured, runner_id, request.runner, request.action)
    runner = await _patch(nats, configured, request.runner, request.action, first)
    return Json({"status": OK, "runner": runner})


@router.patch(
    "/v1/runners",
    response_class=Json,
    dependencies=[Depends(writer)],
    openapi_extra={"requestBody": schema_ref(PatchRunnersRequest)},
)
async def patch_runners(
    nats: Nats, configured: Configured, body: Annotated[bytes, Depends(_body)]
) -> Json:
    """Change several Runner specs as Clarifai's `PatchRunners` does; each is checked
    before any is written."""
    request = strict(body, PatchRunnersRequest)
    if not request.runners:
        raise fail(422, "invalid body: `$.runners` is empty")
    checked = []
    for index, change in enumerate(request.runners):
        runner_id = change.get("id")
        if not isinstance(runner_id, str) or not runner_id:
            raise fail(422, f"invalid body: `$.runners[{index}].id` names no runner")
        checked.append(await _patched(nats, configured, runner_id, change, request.action))
    changed = [
        await _patch(nats, configured, change, request.action, first)
        for change, first in zip(request.runners, checked, strict=True)
    ]
    return Json({"status": OK, "runners": changed})


@router.delete("/v1/runners/{runner_id}", response_class=Json, dependencies=[Depends(writer)])
async def delete_runner(runner_id: str, nats: Nats) -> Json:
    """Delete a Runner spec; its instances are released."""
    await _load(nats, runner_id)
    await nats.delete(nats.layout.runners_bucket.bucket, runner_id)
    return Json({"status": OK})
