"""Headers rankscope's services set for each other (NATS) and for clients (HTTP)."""

from __future__ import annotations

from nats.micro.request import ERROR_CODE_HEADER, ERROR_HEADER

__all__ = ["ERROR_CODE_HEADER", "ERROR_HEADER", "MISSING_PARTITIONS_HEADER", "VERSION_HEADER"]

# ERROR_CODE_HEADER, ERROR_HEADER: on a service's reply, the HTTP status of a query that
# failed and why (NATS micro service errors).

VERSION_HEADER = "Rankscope-Table-Version"
"""On a rank table: its version, counting every change of the job's table from 1."""

MISSING_PARTITIONS_HEADER = "Rankscope-Missing-Partitions"
"""On a gateway answer built without some aggregator partitions: their indexes, comma
separated."""
