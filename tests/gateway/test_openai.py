"""OpenAI's own client lists and retrieves the models a chat completion may name."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.gateway.conftest import Stack
from tests.gateway.test_api import SPEC

pytestmark = pytest.mark.nats


async def test_openai_s_client_lists_every_model_a_chat_may_name(stack_for: Any) -> None:
    stack: Stack = await stack_for()
    owned = {**SPEC, "id": "llm-b", "nodepool": {"id": "default", "user_id": "team-b"}}
    assert (await stack.http.post("/v1/runners", json={"runners": [SPEC, owned]})).is_success
    base = str(stack.http.base_url).rstrip("/")
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused")
    listed = [m async for m in client.models.list()]
    assert [(m.id, m.owned_by) for m in listed] == [
        ("llm", "rankscope"),
        ("llm-b", "team-b"),
        ("tiny", "rankscope"),  # the model both specs serve, as a chat may name it too
    ]
    assert all(m.object == "model" and m.created > 1_700_000_000 for m in listed)
    assert (await client.models.retrieve("llm-b")).owned_by == "team-b"
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("nope")
    await client.close()
