"""Facts about this machine that an agent reports in its heartbeat."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

__all__ = ["hostname", "memory_bytes"]


def hostname() -> str:
    """The short host name."""
    return socket.gethostname().split(".")[0]


def memory_bytes() -> tuple[int, int]:
    """Total and available physical memory in bytes."""
    if sys.platform == "linux":
        fields: dict[str, int] = {}
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                name, _, rest = line.partition(":")
                fields[name] = int(rest.split()[0]) * 1024
        return fields["MemTotal"], fields.get("MemAvailable", fields["MemFree"])
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if sys.platform == "darwin":
        # vm_stat counts free + inactive + purgeable pages as reclaimable.
        out = subprocess.run(["vm_stat"], capture_output=True, text=True, check=True).stdout
        page = int(out.split("page size of ")[1].split()[0])
        counts = {
            k.strip(): int(v.strip(" .")) for k, v in (ln.split(":") for ln in out.splitlines()[1:])
        }
        free = sum(counts.get(k, 0) for k in ("Pages free", "Pages inactive", "Pages purgeable"))
        return total, free * page
    return total, total
