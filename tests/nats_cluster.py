"""A NATS cluster of real `nats-server` processes on loopback, with JetStream clustered."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import nats
from nats.errors import Error as NatsError

from rankscope.shared.nats_server import EmbeddedNats, NatsServerError
from tests.stack_up import free_port

CLUSTER = "rankscope"

_ATTEMPTS = 3


@contextlib.contextmanager
def nats_cluster(root: Path, size: int = 3) -> Iterator[list[EmbeddedNats]]:
    """`size` servers routed to each other (JetStream, `server_name`s n0, n1, ...),
    stopped when the block ends. Their ports are drawn free, yet bound only as each server
    starts: one taken meanwhile by another test's process is drawn again."""
    for attempt in range(_ATTEMPTS):
        servers = _members(root, size)
        try:
            for server in servers:
                server.start()
        except NatsServerError as failed:
            for server in servers:
                server.stop()
            if "address already in use" not in str(failed) or attempt == _ATTEMPTS - 1:
                raise
            shutil.rmtree(root, ignore_errors=True)
            continue
        try:
            yield servers
        finally:
            for server in servers:
                server.stop()
        return


def _members(root: Path, size: int) -> list[EmbeddedNats]:
    routes = [f"nats://127.0.0.1:{free_port()}" for _ in range(size)]

    def member(i: int) -> EmbeddedNats:
        others = ",".join(r for r in routes if r != routes[i])
        flags = ["--server_name", f"n{i}", "--cluster_name", CLUSTER]
        flags += ["--cluster", routes[i], "--routes", others]
        return EmbeddedNats(store_dir=root / f"n{i}", port=free_port(), extra_args=tuple(flags))

    return [member(i) for i in range(size)]


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
