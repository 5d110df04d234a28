"""`rankscope up`: an embedded NATS with rankscope's streams and buckets, the services
as supervised child processes, and with `--demo` the tiny model the demo cluster serves.
Runs until Ctrl-C or SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from rankscope.services.stack.demo import drive
from rankscope.services.stack.supervisor import ChildSpec, Supervisor, keep_nats
from rankscope.services.stack.terminal import Terminal
from rankscope.shared.connection import close, connect
from rankscope.shared.jetstream import Layout
from rankscope.shared.nats_auth import OPERATOR, agent_user, render
from rankscope.shared.nats_server import EmbeddedNats
from rankscope.shared.provision import LayoutError, ensure
from rankscope.shared.settings import Settings, env_name, to_environ
from rankscope.shared.subjects import Subjects
from rankscope.shared.tiny_model import TinyModelSpec, write_tiny_model

__all__ = ["demo_model", "run"]

log = logging.getLogger("rankscope.up")


def services(settings: Settings) -> tuple[ChildSpec, ...]:
    """The services `up` runs, each a `rankscope` subcommand: an aggregator per partition."""
    count = settings.aggregator_partitions
    aggregators = (
        ChildSpec(
            f"aggregator {i}/{count}", ["aggregator"], {env_name("aggregator_partition"): str(i)}
        )
        for i in range(count)
    )
    return (
        *(aggregators if count > 1 else [ChildSpec("aggregator", ["aggregator"])]),
        ChildSpec("ranktable", ["ranktable", "--serve"]),
        ChildSpec("gateway", ["gateway"]),
    )


DEMO_NODES = ("node-a", "node-b")


def demo_agents(settings: Settings) -> tuple[ChildSpec, ...]:
    """The demo's two node agents on loopback, each with a data dir of its own."""
    return tuple(
        ChildSpec(
            f"agent {node}",
            ["agent"],
            {
                "RANKSCOPE_NODE_ID": node,
                "RANKSCOPE_FRIENDLY_NAME": node,
                "RANKSCOPE_DATA_DIR": str(settings.data_dir / node),
            },
        )
        for node in DEMO_NODES
    )


def _user_of(child: ChildSpec) -> str:
    node = child.env.get("RANKSCOPE_NODE_ID")
    return agent_user(node) if node is not None else child.args[0]


def with_users(children: Sequence[ChildSpec]) -> tuple[dict[str, str], tuple[ChildSpec, ...]]:
    """A fresh password per child's role (an agent's is its node's), and the children
    connecting as those users."""
    passwords = {_user_of(child): secrets.token_urlsafe(24) for child in children}
    return passwords, tuple(
        replace(
            child,
            env={
                **child.env,
                "RANKSCOPE_NATS_USER": _user_of(child),
                "RANKSCOPE_NATS_PASSWORD": passwords[_user_of(child)],
            },
        )
        for child in children
    )


def demo_model(settings: Settings) -> Path:
    """The demo's tiny model, generated on first use and reused after."""
    directory = settings.data_dir / "models" / "tiny-qwen2"
    if not (directory / "model.safetensors").exists():
        log.info("generating the demo model in %s", directory)
        write_tiny_model(directory, TinyModelSpec())
    return directory


def node_password(settings: Settings, node: str) -> Path:
    """Where `up --demo --nats-auth` keeps the password of demo node `node`'s user, for
    `rankscope record` on this machine to report as that node."""
    return settings.data_dir / node / "nats.password"


def _keep_secret(path: Path, secret: str) -> Path:
    """Write `secret` to `path`, readable by this user alone; returns the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text(secret + "\n")
    return path


def _command() -> str:
    """How to run `rankscope` from here: by name when it is on the PATH, else by path (as
    after `make demo`, which leaves it in the project's virtualenv)."""
    beside = Path(sys.executable).parent / "rankscope"
    if shutil.which("rankscope") == str(beside) or not beside.exists():
        return "rankscope"
    return str(beside)


def _busy_port(settings: Settings) -> str | None:
    """Why `up` cannot start, if a port it needs is taken: one line naming the port and
    the setting to change (a child that cannot bind would only crash over and over)."""
    wanted = [
        ("NATS", "127.0.0.1", settings.nats_port if settings.nats_url is None else 0,
         "--nats-port / RANKSCOPE_NATS_PORT"),
        ("the gateway", settings.gateway_host, settings.gateway_port,
         "--gateway-port / RANKSCOPE_GATEWAY_PORT"),
        ("gRPC", settings.grpc_host, settings.grpc_port, "--grpc-port / RANKSCOPE_GRPC_PORT"),
    ]  # fmt: skip
    for what, host, port, setting in wanted:
        if not port:
            continue
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as exc:
                return (
                    f"port {port} for {what} on {host} is not free ({exc.strerror}): set {setting}"
                )
    return None


async def _serve(settings: Settings, *, demo: bool, nats_auth: bool, terminal: Terminal) -> None:
    if (busy := _busy_port(settings)) is not None:
        raise SystemExit(f"rankscope up: {busy}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    children = services(settings) + (demo_agents(settings) if demo else ())
    async with contextlib.AsyncExitStack() as stack:
        servers = settings.nats_servers
        watch = f"nats sub '{Subjects(settings.subject_prefix).everything()}'"
        if settings.nats_url is None:
            config = None
            if nats_auth:
                passwords, children = with_users(children)
                passwords[OPERATOR] = secrets.token_urlsafe(24)
                secret = _keep_secret(settings.data_dir / "operator.password", passwords[OPERATOR])
                watch += f' --user {OPERATOR} --password "$(cat {secret})"'
                for node in DEMO_NODES if demo else ():
                    _keep_secret(node_password(settings, node), passwords[agent_user(node)])
                config = render(
                    Layout.from_settings(settings), DEMO_NODES if demo else (), passwords
                )
                settings = replace(
                    settings, nats_user="ranktable", nats_password=passwords["ranktable"]
                )
            server = EmbeddedNats(
                store_dir=settings.data_dir / "nats",
                port=settings.nats_port,
                monitor=True,
                config=config,
            ).start()
            stack.callback(server.stop)
            stack.callback(asyncio.create_task(keep_nats(server, stop)).cancel)
            servers = [server.url]
            settings = replace(settings, nats_url=server.url)
        elif nats_auth:
            raise SystemExit("--nats-auth configures the embedded NATS: leave --nats-url unset")
        nc = await connect(settings, "rankscope-up")
        stack.push_async_callback(close, nc)
        try:
            await ensure(nc.jetstream(), Layout.from_settings(settings))
        except LayoutError as exc:
            raise SystemExit(f"rankscope up: {exc}") from None
        users = " (one user per role)" if nats_auth else ""
        terminal.say(
            f"NATS        {', '.join(servers)} (JetStream; streams and buckets ready){users}"
        )
        model = demo_model(settings) if demo else None
        if model is not None:
            terminal.say(f"demo model  {model}")
        if env_name("access_log") not in os.environ:  # the terminal shows the demo's progress
            settings = replace(settings, access_log=False)
        supervisor = Supervisor(children, env=to_environ(settings), terminal=terminal)
        await supervisor.start()
        supervising = asyncio.create_task(supervisor.run(stop))
        web = f"http://{settings.gateway_host}:{settings.gateway_port}"
        terminal.say(f"web         {web}/  (API docs {web}/docs)")
        terminal.say(f"ranktable   gRPC config.Config on {settings.grpc_host}:{settings.grpc_port}")
        terminal.say(f"watch       {watch} --server {servers[0]}")
        terminal.say(f"try         {_command()} timeline --url {web}")
        terminal.say(f"            curl -s {web}/v1/cluster/diagnosis")
        if demo and nats_auth:
            node = DEMO_NODES[0]
            terminal.say(
                f'record      RANKSCOPE_NATS_PASSWORD="$(cat {node_password(settings, node)})"'
                f" {_command()} record --node {node} --nats-user {agent_user(node)}"
                f" --nats-url {servers[0]} -- COMMAND"
            )
        terminal.say("Ctrl-C stops everything.")
        driving = (
            asyncio.create_task(
                drive(
                    web,
                    model,
                    stop,
                    terminal,
                    token=settings.api_token,
                    unsteady=supervisor.unsteady,
                )
            )
            if model is not None
            else None
        )
        await stop.wait()
        log.info("stopping")
        if driving is not None:
            driving.cancel()
        await supervising


def run(settings: Settings, *, demo: bool, nats_auth: bool = False) -> int:
    """Run the stack in the foreground; returns the exit code."""
    with Terminal() as terminal:
        asyncio.run(_serve(settings, demo=demo, nats_auth=nats_auth, terminal=terminal))
    return 0
