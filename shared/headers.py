"""NATS headers rankscope's services set for each other."""

from __future__ import annotations

from nats.micro.request import ERROR_CODE_HEADER, ERROR_HEADER

__all__ = ["ERROR_CODE_HEADER", "ERROR_HEADER", "VERSION_HEADER"]

# ERROR_CODE_HEADER, ERROR_HEADER: on a service's reply, the HTTP status of a query that
# failed and why (NATS micro service errors).

VERSION_HEADER = "Rankscope-Table-Version"
"""On a rank table: its version, counting every change of the job's table from 1."""
