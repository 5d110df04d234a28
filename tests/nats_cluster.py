"""A NATS cluster of real `nats-server` processes on loopback, with JetStream clustered."""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
from collections.abc import Iterator
from pathlib import Path

import nats
from nats.errors import Error as NatsError

from rankscope.shared.nats_server import EmbeddedNats

CLUSTER = "rankscope"

_BELOW_EPHEMERAL = (10_000, 32_768)
"""Ports the kernel never hands out on its own (Linux's ephemeral range starts at 32768):
a route port picked ahead of its server's start cannot be taken meanwhile as the source
port of a connection, or as another server's random port."""


def _unassigned_port() -> int:
    while True:
        port = random.randrange(*_BELOW_EPHEMERAL)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


@contextlib.contextmanager
def nats_cluster(root: Path, size: int = 3) -> Iterator[list[EmbeddedNats]]:
    """`size` servers routed to each other (JetStream, `server_name`s n0, n1, ...),
    stopped when the block ends."""
    routes = [f"nats://127.0.0.1:{_unassigned_port()}" for _ in range(size)]

    def member(i: int) -> EmbeddedNats:
        others = ",".join(r for r in routes if r != routes[i])
        flags = ["--server_name", f"n{i}", "--cluster_name", CLUSTER]
        flags += ["--cluster", routes[i], "--routes", others]
        return EmbeddedNats(
            store_dir=root / f"n{i}", port=_unassigned_port(), extra_args=tuple(flags)
        )

    servers = [member(i) for i in range(size)]
    try:
        for server in servers:
            server.start()
        yield servers
    finally:
        for server in servers:
            server.stop()


async def until_jetstream_answers(urls: list[str], seconds: float = 30.0) -> None:
    """Wait until the cluster has elected its JetStream meta leader."""
    nc = await nats.connect(servers=urls)
    try:
        for _ in range(int(seconds / 0.2)):
            with contextlib.suppress(NatsError, TimeoutError):
                await nc.jetstream().account_info()
                return
            await asyncio.sleep(0.2)
        raise AssertionError(f"JetStream of the cluster did not answer within {seconds:g}s")
    finally:
        await nc.close()
