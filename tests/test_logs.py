"""Logs are readable lines by default and one JSON object per line on request."""

from __future__ import annotations

import json
import logging

import pytest

from rankscope.shared import logs


@pytest.fixture(autouse=True)
def _restore_root() -> object:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield None
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_lines(capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure("json", "info")
    logging.getLogger("rankscope.test").info("ranks %d", 2, extra={"nodeId": "node-a"})
    record = json.loads(capsys.readouterr().err)
    assert record["msg"] == "ranks 2"
    assert record["level"] == "info"
    assert record["logger"] == "rankscope.test"
    assert record["nodeId"] == "node-a"
    assert record["ts"].endswith("Z")


def test_text_lines_carry_extras_and_respect_level(capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure("text", "warning")
    log = logging.getLogger("rankscope.test")
    log.info("hidden")
    log.warning("lost node", extra={"nodeId": "node-b"})
    err = capsys.readouterr().err
    assert "hidden" not in err
    assert "WARNING rankscope.test: lost node nodeId=node-b" in err


def test_json_survives_values_it_cannot_encode(capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure("json", "info")
    logging.getLogger("rankscope.test").info("odd", extra={"thing": object()})
    assert json.loads(capsys.readouterr().err)["thing"].startswith("<object")
