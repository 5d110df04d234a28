"""docs/ARCHITECTURE.md names every module where it is: one added, moved or removed
without the list following fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ARCHITECTURE.md"
GENERATED = "services/ranktable/grpcapi/"


def _modules() -> set[str]:
    found = set()
    for room in ("services", "shared"):
        for path in (ROOT / room).rglob("*.py"):
            name = path.relative_to(ROOT).as_posix()
            if path.name != "__init__.py" and not name.startswith(GENERATED):
                found.add(name)
    return found


def _named() -> set[str]:
    return set(re.findall(r"`((?:services|shared)/[\w/]+\.py)`", DOC.read_text()))


def test_every_module_is_named_in_the_architecture() -> None:
    missing = sorted(_modules() - _named())
    assert not missing, f"docs/ARCHITECTURE.md does not name {missing}"


def test_every_module_the_architecture_names_exists() -> None:
    gone = sorted(_named() - _modules())
    assert not gone, f"docs/ARCHITECTURE.md names modules that are not there: {gone}"
