"""Property-based requests generated from the gateway's own OpenAPI document: no 5xx, no
response that breaks its documented schema, no undocumented status code."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.gateway.conftest import Stack

pytestmark = [pytest.mark.nats, pytest.mark.slow, pytest.mark.timeout(300)]

SCHEMATHESIS = Path(sys.executable).parent / "schemathesis"


async def test_no_server_errors_and_no_schema_violations(stack_for: Any) -> None:
    stack: Stack = await stack_for()
    await stack.http.post(
        "/v1/runners",
        json={
            "runners": [
                {
                    "id": "llm",
                    "worker": {"model": {"id": "tiny"}},
                    "compute_info": {"num_accelerators": 2},
                    "num_replicas": 1,
                    "metadata": {"nLayers": 8, "modelBytes": "4Gi"},
                }
            ]
        },
    )
    run = await asyncio.create_subprocess_exec(
        str(SCHEMATHESIS),
        "run",
        str(stack.http.base_url).rstrip("/") + "/openapi.json",
        "--checks",
        "not_a_server_error,response_schema_conformance,status_code_conformance",
        "--request-timeout",
        "15",
        "--max-examples",
        "10",
        "--seed",
        "1",
        "--exclude-path-regex",
        "stream$",
        "--no-color",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await run.communicate()
    report = output.decode(errors="replace")
    assert run.returncode == 0, report[-6000:]
