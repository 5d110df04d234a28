"""The modules docs/ARCHITECTURE.md calls pure read no clock and do no I/O: every input,
the time included, is an argument. Checked on their syntax trees; shown to fail on planted
sources that read a clock, take one to read later, import a network or process module, or
open a file."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ARCHITECTURE.md"
FORBIDDEN_MODULES = frozenset(
    {"time", "asyncio", "socket", "subprocess", "threading", "nats", "httpx", "urllib", "psutil"}
)
"""Clocks, event loops, networks and processes."""
FORBIDDEN_CALLS = frozenset({"open", "now", "utcnow", "today", "monotonic", "perf_counter"})
"""Files, and the clocks a module can read without importing `time` (`datetime.now`,
`rankscope.shared.timestamps.now`)."""
CLOCK = "Callable[[], float]"
"""How a clock handed in reads: a pure module is told the time, not given a clock."""


def pure_modules() -> list[str]:
    """The modules the architecture calls pure: a room's `Pure:` list, and any module
    whose line says it is."""
    text = DOC.read_text()
    found = set(re.findall(r"- `((?:services|shared)/[\w/]+\.py)` — pure", text))
    for room, listed in re.findall(
        r"`((?:services|shared)/\w+/)` — [^\n]*? Pure: ((?:`[\w/]+\.py`(?: \([^)]*\))?,?\s*)+)",
        text,
    ):
        found |= {room + name for name in re.findall(r"`([\w/]+\.py)`", listed)}
    return sorted(found)


def impurities(source: str) -> list[str]:
    """What in `source` reads a clock or does I/O, one line each."""
    said = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
            if (node.module or "").endswith("timestamps"):
                names += [alias.name for alias in node.names if alias.name == "now"]
        elif isinstance(node, ast.arg) and node.annotation is not None:
            if ast.unparse(node.annotation).strip("'\"") == CLOCK:
                said.append(f"line {node.lineno}: takes a clock ({node.arg})")
            continue
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in FORBIDDEN_CALLS:
                said.append(f"line {node.lineno}: calls {ast.unparse(func)}()")
            continue
        else:
            continue
        for name in names:
            if name.split(".")[0] in FORBIDDEN_MODULES or name == "now":
                said.append(f"line {node.lineno}: imports {name}")
    return said


def test_the_architecture_names_the_pure_modules() -> None:
    modules = pure_modules()
    assert "services/aggregator/diagnosis.py" in modules
    assert "services/ranktable/recorded.py" in modules
    assert "services/fr/verdict.py" in modules
    assert all((ROOT / m).exists() for m in modules)


@pytest.mark.parametrize("module", pure_modules())
def test_a_pure_module_reads_no_clock_and_does_no_io(module: str) -> None:
    assert impurities((ROOT / module).read_text()) == []


@pytest.mark.parametrize(
    ("planted", "said"),
    [
        ("import time\nx = time.monotonic()", "line 1: imports time"),
        ("from datetime import datetime\nx = datetime.now()", "line 2: calls datetime.now()"),
        ("from rankscope.shared.timestamps import now", "line 1: imports now"),
        ("import asyncio", "line 1: imports asyncio"),
        ("from nats.aio.client import Client", "line 1: imports nats.aio.client"),
        ("data = open('x').read()", "line 1: calls open()"),
        ("def f(clock: Callable[[], float]) -> None: ...", "line 1: takes a clock (clock)"),
    ],
)
def test_the_check_fails_on_a_clock_or_io(planted: str, said: str) -> None:
    assert said in impurities(planted)
