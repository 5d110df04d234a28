"""The web page as headless Chromium renders it, for end-to-end tests: its DOM once its
scripts ran, and a screenshot kept under `artifacts/`."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["ARTIFACTS", "browse", "shown"]

ARTIFACTS = Path(__file__).parent.parent / "artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def browse(url: str, screenshot: Path, page: str = "/") -> str:
    """The `page` of `url` as headless Chromium renders it after its scripts ran; saves a
    screenshot."""
    assert CHROMIUM, "headless Chromium is needed (Debian package chromium; .ci/run installs it)"
    screenshot.parent.mkdir(exist_ok=True)
    flags = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tempfile.mkdtemp()}",
        "--window-size=1400,820",
        "--virtual-time-budget=5000",
    ]
    subprocess.run(
        [*flags, f"--screenshot={screenshot}", url + page],
        check=True,
        capture_output=True,
        timeout=60,
    )
    for _ in range(3):  # as an operator reloads a page whose first refresh did not finish
        dom = subprocess.run(
            [*flags, "--dump-dom", url + page],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        if "ranks ·" in dom:
            break
    return dom


def shown(page: str) -> str:
    """What the page says it did (its status line) and which findings it shows."""
    parts = (
        re.search(f'id="{part}"[^>]*>(.*?)</(span|section)>', page, re.S)
        for part in ("status", "findings")
    )
    return " | ".join(p.group(1)[:2000] if p else "(missing)" for p in parts)
