"""Build a job's global rank table (ClusterD shape) from its placement and readiness."""

from __future__ import annotations

from collections.abc import Callable

from rankscope.shared.wire import (
    Device,
    InstanceCreated,
    RankTable,
    RankTableStatus,
    Server,
    ServerGroup,
)

__all__ = ["TABLE_FORMAT_VERSION", "rank_table"]

TABLE_FORMAT_VERSION = "1.0"


def rank_table(instance: InstanceCreated | None, is_ready: Callable[[str], bool]) -> RankTable:
    """One server group for the job, one server per node, one device per rank.

    `completed` once every rank is ready; `initializing` before that, and while the job
    has no placement (an empty group: it waits for capacity).
    """
    servers: dict[str, list[Device]] = {}
    hosts: dict[str, str] = {}
    for rank in instance.assignments if instance else ():
        devices = servers.setdefault(rank.nodeId, [])
        hosts[rank.nodeId] = rank.host
        local = str(len(devices))
        devices.append(
            Device(
                device_id=local,
                device_ip=rank.host,
                device_logical_id=local,
                rank_id=str(rank.deviceRank),
            )
        )
    ready = instance is not None and all(is_ready(r.runnerId) for r in instance.assignments)
    group = ServerGroup(
        group_id="0",
        deploy_server="0",
        server_count=str(len(servers)),
        server_list=[
            Server(device=devices, server_id=node_id, server_ip=hosts[node_id])
            for node_id, devices in servers.items()
        ],
    )
    return RankTable(
        version=TABLE_FORMAT_VERSION,
        status=RankTableStatus.COMPLETED if ready else RankTableStatus.INITIALIZING,
        server_group_list=[group],
    )
