"""One incident as one file to hand over: a gzipped tar of everything rankscope holds of
it, built from what NATS stores (so any gateway builds it, after a restart of anything)."""

from __future__ import annotations

import io
import json
import tarfile
import time
from dataclasses import dataclass, field
from typing import Any

from rankscope.shared.wire import encode

__all__ = ["Bundle"]


@dataclass
class Bundle:
    """The files of one incident's bundle, and what it could not hold."""

    incident_id: str
    files: dict[str, Any] = field(default_factory=dict)
    lacking: list[str] = field(default_factory=list)

    def add(self, name: str, content: Any) -> None:
        """A JSON file (a Struct, or JSON-able builtins)."""
        self.files[name] = content

    def lacks(self, why: str) -> None:
        """Say what the bundle does not hold, and why."""
        self.lacking.append(why)

    def archive(self) -> bytes:
        """The gzipped tar, its README first."""
        readme = [
            f"rankscope incident {self.incident_id}",
            "",
            *(f"{name}" for name in sorted(self.files)),
        ]
        if self.lacking:
            readme += ["", "not held:", *(f"- {why}" for why in self.lacking)]
        written = io.BytesIO()
        with tarfile.open(fileobj=written, mode="w:gz") as tar:
            entries = {"README.txt": "\n".join(readme).encode() + b"\n"}
            entries |= {name: _json(content) for name, content in self.files.items()}
            for name, data in entries.items():
                info = tarfile.TarInfo(f"incident-{self.incident_id}/{name}")
                info.size, info.mtime = len(data), int(time.time())
                tar.addfile(info, io.BytesIO(data))
        return written.getvalue()


def _json(content: Any) -> bytes:
    if isinstance(content, bytes):
        return content
    return json.dumps(json.loads(encode(content)), indent=2).encode()
