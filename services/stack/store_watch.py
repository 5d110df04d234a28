"""Whether the embedded nats-server's store broke on a full disk, and whether the disk has
room again: JetStream does not come back from a failed write by itself, a restart does."""

from __future__ import annotations

import shutil
from pathlib import Path

__all__ = ["ROOM_BYTES", "StoreWatch"]

ROOM_BYTES = 64 << 20
"""Free bytes on the store's disk after which a broken store is worth a restart."""

_BROKEN = ("Critical write error", "no space left on device", "JetStream out of resources")
"""What the server logs when a write to its store failed for want of room."""


class StoreWatch:
    """Reads the server's log as it grows for a failed write of its store."""

    def __init__(self, log_path: Path, store_dir: Path) -> None:
        self._log = log_path
        self._store = store_dir
        self._read = 0
        self.broken: str | None = None
        """The log line that said the store broke, until `mended`."""

    def look(self) -> str | None:
        """The line that says the store broke, if one was logged (now or before)."""
        if self.broken is None:
            try:
                with self._log.open("rb") as log:
                    log.seek(self._read if self._read <= self._log.stat().st_size else 0)
                    fresh = log.read()
                    self._read = log.tell()
            except OSError:
                return None
            for line in fresh.decode(errors="replace").splitlines():
                if any(mark in line for mark in _BROKEN):
                    self.broken = line.strip()[-300:]
                    break
        return self.broken

    def has_room(self) -> bool:
        """Whether the store's disk has room again."""
        try:
            return shutil.disk_usage(self._store).free >= ROOM_BYTES
        except OSError:
            return False

    def mended(self) -> None:
        """The server was restarted: what it logged before is read, and counts no more."""
        self.broken = None
        try:
            self._read = self._log.stat().st_size
        except OSError:
            self._read = 0
