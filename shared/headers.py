"""NATS headers rankscope's services set for each other."""

from __future__ import annotations

__all__ = ["ERROR_HEADER", "VERSION_HEADER"]

ERROR_HEADER = "Rankscope-Error"
"""On a query's reply: the HTTP status of a query that failed (its body a `QueryError`)."""

VERSION_HEADER = "Rankscope-Table-Version"
"""On a rank table: its version, counting every change of the job's table from 1."""
