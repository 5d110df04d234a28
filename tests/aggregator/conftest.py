"""Fixtures of the aggregator tests."""

from __future__ import annotations

import pytest
from nats.aio.client import Client

from rankscope.shared.jetstream import Layout
from rankscope.shared.provision import ensure


@pytest.fixture
async def js_ready(nc: Client, layout: Layout) -> Layout:
    await ensure(nc.jetstream(), layout)
    return layout
