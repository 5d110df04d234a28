"""ClusterD-compatible gRPC `config.Config`: `Register` and `SubscribeRankTable`.

Unlike ClusterD, a second subscriber to a job does not evict the first, and a job that
does not exist yet is waited for rather than refused.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from rankscope.services.lifecycle import StartError
from rankscope.services.ranktable.grpcapi import config_pb2, config_pb2_grpc
from rankscope.services.ranktable.hub import TableHub
from rankscope.shared.subjects import token

__all__ = ["serve"]

log = logging.getLogger(__name__)


async def _check_job_id(job_id: str, context: grpc.aio.ServicerContext) -> None:
    """The same limit as everywhere else: a job id must fit a subject token."""
    try:
        token(job_id)
    except ValueError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"jobId: {exc}")


class ConfigService(config_pb2_grpc.ConfigServicer):
    """Serves rank tables from the hub."""

    def __init__(self, hub: TableHub) -> None:
        self._hub = hub

    async def Register(  # noqa: N802 - the proto's name
        self, request: config_pb2.ClientInfo, context: grpc.aio.ServicerContext
    ) -> config_pb2.Status:
        await _check_job_id(request.jobId, context)
        known = self._hub.latest(request.jobId) is not None
        info = "registered" if known else "registered; the job has no rank table yet"
        return config_pb2.Status(code=0, info=info)

    async def SubscribeRankTable(  # noqa: N802 - the proto's name
        self, request: config_pb2.ClientInfo, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[config_pb2.RankTableStream]:
        await _check_job_id(request.jobId, context)
        # quoted and cut: a client's text never makes a log line of its own, nor a huge one
        said = {"jobId": repr(request.jobId[:128]), "role": repr(request.role[:64])}
        log.info("rank-table subscriber", extra=said)
        async for _, table in self._hub.follow(request.jobId):
            yield config_pb2.RankTableStream(jobId=table.jobId, rankTable=table.rankTable)


async def serve(hub: TableHub, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Start the gRPC server; returns it and the bound port (`port` 0 picks one)."""
    # no second server on a port one already holds (gRPC shares it by default on Linux):
    # a rank-table service started twice by mistake fails at once instead of splitting work
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    config_pb2_grpc.add_ConfigServicer_to_server(ConfigService(hub), server)  # type: ignore[no-untyped-call]
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise StartError(
            f"cannot bind the rank-table gRPC port {host}:{port}: is a rank-table service "
            "running there already? (rankscope ranktable JOB prints a job's rank table; "
            "--grpc-port picks another port)"
        )
    await server.start()
    return server, bound
