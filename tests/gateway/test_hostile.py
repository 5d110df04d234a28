"""Generated hostile ids and bodies against the gateway: ids of any size and alphabet in
every route that takes one, bodies of any bytes and of sizes around the limit, with and
without a length. Each is a clear 4xx or an answer, never a 5xx, and the gateway keeps its
NATS connection: a valid request afterwards still works."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rankscope.services.gateway.app import MAX_BODY_BYTES
from rankscope.shared.subjects import MAX_TOKEN
from tests.gateway.conftest import Stack
from tests.gateway.test_api import SPEC

pytestmark = [pytest.mark.nats, pytest.mark.timeout(300)]

HOSTILE = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

_unicode = st.characters(codec="utf-8")  # any a client can send
ids = st.one_of(
    st.text(_unicode, min_size=1, max_size=300),  # control characters too
    st.text(alphabet=".*> \t=%/?#&\x00", min_size=1, max_size=2 * MAX_TOKEN),
    st.integers(MAX_TOKEN - 2, 6000).map(lambda n: "a" * n),
    st.text(
        st.characters(min_codepoint=0x80, codec="utf-8"),
        min_size=MAX_TOKEN // 12,
        max_size=400,
    ),
)
bodies = st.one_of(
    st.binary(max_size=4096),
    st.integers(MAX_BODY_BYTES - 2, MAX_BODY_BYTES + 2).map(lambda n: b"[" + b" " * (n - 1)),
)


async def _still_serving(stack: Stack) -> None:
    assert (await stack.http.get("/readyz")).status_code == 200
    assert (await stack.http.get("/v1/runners")).status_code == 200


def _clear(reply: Any, allowed: set[int]) -> None:
    assert reply.status_code in allowed, (reply.status_code, reply.text[:300])
    if reply.status_code >= 400:
        assert isinstance(reply.json()["detail"], str)


@pytest.fixture
async def stack(stack_for: Any) -> Stack:
    started: Stack = await stack_for()
    return started


@HOSTILE
@given(raw=ids)
async def test_any_id_in_any_route_is_an_answer_or_a_clear_4xx(stack: Stack, raw: str) -> None:
    http, path = stack.http, quote(raw, safe="")
    for method, url, body in (
        ("GET", f"/v1/runners/{path}", None),
        ("DELETE", f"/v1/runners/{path}", None),
        ("PATCH", f"/v1/runners/{path}", {"runner": {"priority": 1}, "action": "merge"}),
        ("GET", f"/v1/jobs/{path}/ranktable", None),
        ("GET", f"/v1/cluster/timeline?instanceId={path}&limit=5", None),
        ("GET", f"/v1/cluster/diagnosis/history?instanceId={path}", None),
    ):
        # 307: an id of slashes only leaves the collection's own path, with a trailing slash
        _clear(await http.request(method, url, json=body), {200, 307, 404, 405, 422})
    created = await http.post("/v1/runners", json={"runners": [{**SPEC, "id": raw}]})
    _clear(created, {200, 422})
    if created.status_code == 200:
        _clear(await http.delete(f"/v1/runners/{path}"), {200})
    await _still_serving(stack)


@HOSTILE
@given(body=bodies, chunked=st.booleans())
async def test_any_body_is_a_clear_4xx(stack: Stack, body: bytes, chunked: bool) -> None:
    async def streamed() -> AsyncIterator[bytes]:
        for start in range(0, len(body), 65536):
            yield body[start : start + 65536]

    content: Any = streamed() if chunked else body
    for method, url in (
        ("POST", "/v1/runners"),
        ("PATCH", "/v1/runners/llm"),
        ("POST", "/v1/chat/completions"),
    ):
        reply = await stack.http.request(
            method, url, content=content, headers={"Content-Type": "application/json"}
        )
        _clear(reply, {400, 404, 413, 422})
        content = streamed() if chunked else body
    await _still_serving(stack)
