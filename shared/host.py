"""Facts about this machine that an agent reports in its heartbeat."""

from __future__ import annotations

import socket

import psutil

__all__ = ["hostname", "memory_bytes"]


def hostname() -> str:
    """The short host name."""
    return socket.gethostname().split(".")[0]


def memory_bytes() -> tuple[int, int]:
    """Total and available physical memory in bytes (what can be had without swapping, as
    each platform counts it)."""
    memory = psutil.virtual_memory()
    return memory.total, memory.available
