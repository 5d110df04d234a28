"""ClusterD's rank-table shapes (seed 003): `ClientInfo`, `Status`, `RankTableStream` and
the global rank table, string-valued as ClusterD publishes it, versions 1.0 and 1.2.

Optional 1.2 fields are left out of the JSON when unset, so a 1.0 table stays 1.0.
"""

from __future__ import annotations

from enum import StrEnum

from rankscope.shared.wire.base import CamelStruct, SnakeStruct

__all__ = [
    "ClientInfo",
    "Device",
    "RankTable",
    "RankTableStatus",
    "RankTableStream",
    "Server",
    "ServerGroup",
    "Status",
    "SuperPod",
    "SuperPodServer",
]


class RankTableStatus(StrEnum):
    """Rank-table status values: `completed` once every rank of the job is ready."""

    INITIALIZING = "initializing"
    COMPLETED = "completed"


class Device(SnakeStruct, kw_only=True, frozen=True, omit_defaults=True):
    """One rank's device."""

    device_id: str
    device_ip: str
    super_device_id: str | None = None
    device_logical_id: str
    rank_id: str


class Server(SnakeStruct, kw_only=True, frozen=True):
    """One node of the job and the devices (ranks) on it."""

    device: list[Device]
    server_id: str
    server_ip: str


class SuperPodServer(SnakeStruct, kw_only=True, frozen=True):
    """A server's membership in a super pod (version 1.2)."""

    server_id: str


class SuperPod(SnakeStruct, kw_only=True, frozen=True):
    """A logical super node (version 1.2)."""

    super_pod_id: str
    server_list: list[SuperPodServer]


class ServerGroup(SnakeStruct, kw_only=True, frozen=True, omit_defaults=True):
    """One job's servers."""

    group_id: str
    deploy_server: str
    server_count: str
    server_list: list[Server]
    super_pod_list: list[SuperPod] | None = None


class RankTable(SnakeStruct, kw_only=True, frozen=True):
    """The global rank table of one job."""

    version: str
    status: RankTableStatus
    server_group_list: list[ServerGroup]


class ClientInfo(CamelStruct, kw_only=True, frozen=True):
    """A subscriber: the job it follows and its role."""

    jobId: str
    role: str = ""


class RankTableStream(CamelStruct, kw_only=True, frozen=True):
    """One pushed rank table; `rankTable` is the table's JSON text, as ClusterD sends it."""

    jobId: str
    rankTable: str


class Status(SnakeStruct, kw_only=True, frozen=True):
    """The answer to `Register`."""

    code: int
    info: str
