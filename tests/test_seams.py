"""Services meet only through the contract: no service imports another. What two of them
share (wire shapes, headers, time helpers, spec validation, telemetry publishing) lives in
`shared/`; only the CLI and `rankscope up` (`services/stack`) compose services."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SERVICES = Path(__file__).parent.parent / "services"
COMPOSERS = ("stack",)
"""Packages that compose services (and so may import them)."""
SERVICE_NAMES = tuple(
    sorted(
        p.name
        for p in SERVICES.iterdir()
        if (p / "__init__.py").is_file() and p.name not in COMPOSERS
    )
)


def _imports(source: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def _crossing(service: str, sources: dict[str, str]) -> list[str]:
    """The imports of another service among `sources` (path: text) of `service`."""
    others = [f"rankscope.services.{name}" for name in SERVICE_NAMES if name != service]
    return sorted(
        f"{path}: {imported}"
        for path, source in sources.items()
        for imported in _imports(source)
        if any(imported == other or imported.startswith(other + ".") for other in others)
    )


def test_every_service_package_is_checked() -> None:
    assert set(SERVICE_NAMES) >= {"agent", "aggregator", "client", "gateway", "ranktable", "record"}


def test_the_check_finds_a_crossing_import() -> None:
    planted = {
        "services/record/x.py": "from rankscope.services.agent.agent import Agent\n",
        "services/record/y.py": "import rankscope.services.gateway\n",
        "services/record/z.py": "from rankscope.shared.telemetry import TelemetryPublisher\n",
    }
    assert _crossing("record", planted) == [
        "services/record/x.py: rankscope.services.agent.agent",
        "services/record/y.py: rankscope.services.gateway",
    ]


@pytest.mark.parametrize("service", SERVICE_NAMES)
def test_no_service_imports_another(service: str) -> None:
    sources = {
        str(module.relative_to(SERVICES.parent)): module.read_text()
        for module in (SERVICES / service).rglob("*.py")
    }
    assert _crossing(service, sources) == []


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
