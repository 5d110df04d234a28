"""Services meet only through the contract: no service imports another. What two of them
share (wire shapes, headers, time helpers, spec validation) lives in `shared/`; only the
CLI and `rankscope up` compose services."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SERVICES = Path(__file__).parent.parent / "services"
SERVICE_NAMES = ("agent", "aggregator", "gateway", "ranktable")


def _imports(module: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


@pytest.mark.parametrize("service", SERVICE_NAMES)
def test_no_service_imports_another(service: str) -> None:
    others = {f"services.{name}" for name in SERVICE_NAMES if name != service}
    crossing = sorted(
        f"{module.relative_to(SERVICES.parent)}: {imported}"
        for module in (SERVICES / service).rglob("*.py")
        for imported in _imports(module)
        if any(imported == other or imported.startswith(other + ".") for other in others)
    )
    assert crossing == []


SUBJECT_BUILT = re.compile(
    r"\{[\w.]*\b(?:prefix|p|subject_prefix)\}\."
    r"(?:runner|placement|tasks|ranktable|diagnosis|node|query|output|deadletter|canary|>|\*)"
    r"|_all\(\)\["
)
"""A subject made by hand: a prefix and a subject root, or a builder's pattern cut up."""


def test_every_subject_is_built_in_shared_subjects() -> None:
    built_elsewhere = sorted(
        f"{module.relative_to(SERVICES.parent)}:{number}"
        for root in (SERVICES, SERVICES.parent / "shared")
        for module in root.rglob("*.py")
        if module.name != "subjects.py"
        for number, line in enumerate(module.read_text().splitlines(), 1)
        if re.search(SUBJECT_BUILT, line)
    )
    assert built_elsewhere == []
