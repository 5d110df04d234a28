"""The benchmarks import what exists: mypy does not read `bench/`, so a name moved in
`shared/` or `services/` would break a benchmark unseen until someone runs it."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _missing(source: str) -> list[str]:
    """The `from rankscope... import name` of `source` that do not resolve."""
    missing = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("rankscope"):
            continue
        module = importlib.import_module(node.module or "")
        package = hasattr(module, "__path__")  # a submodule of it is imported by name too
        missing += [
            f"{node.module}.{alias.name}"
            for alias in node.names
            if not hasattr(module, alias.name)
            and not (package and importlib.util.find_spec(f"{node.module}.{alias.name}"))
        ]
    return missing


@pytest.mark.parametrize("bench", sorted(p.name for p in BENCH.glob("*.py")))
def test_every_name_a_benchmark_imports_from_rankscope_exists(bench: str) -> None:
    assert _missing((BENCH / bench).read_text()) == []


def test_the_check_finds_a_moved_name() -> None:
    assert _missing("from rankscope.shared.jetstream import Layout, ensure\n") == [
        "rankscope.shared.jetstream.ensure"
    ]
