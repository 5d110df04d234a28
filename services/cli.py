"""The `rankscope` command line: one subcommand per service plus tools."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from setproctitle import setproctitle

from rankscope.services.client.commands import (
    add_client_commands,
    client_options,
    identifier,
    ranktable_client,
)
from rankscope.services.fr.command import add_fr_command
from rankscope.services.record.command import add_record_command
from rankscope.shared import logs
from rankscope.shared.processes import watch_parent_from_env
from rankscope.shared.settings import Settings, SettingsError, add_arguments, load
from rankscope.shared.tiny_model import ARCHITECTURES

__all__ = ["build_parser", "main"]


def _tiny_model(args: argparse.Namespace, settings: Settings) -> int:
    from rankscope.shared.tiny_model import TinyModelSpec, write_tiny_model

    try:
        spec = TinyModelSpec(args.layers, args.hidden, args.vocab, args.seed, args.arch)
    except ValueError as exc:
        print(f"rankscope: {exc}", file=sys.stderr)
        return 2
    directory = write_tiny_model(Path(args.directory), spec)
    print(f"wrote {spec.layers}-layer {spec.arch} model (hidden {spec.hidden}) to {directory}")
    return 0


def _up(args: argparse.Namespace, settings: Settings) -> int:
    from rankscope.services.stack.main import run

    return run(settings, demo=args.demo, nats_auth=args.nats_auth)


def _nats_config(args: argparse.Namespace, settings: Settings) -> int:
    from rankscope.shared.jetstream import Layout
    from rankscope.shared.nats_auth import render

    print(render(Layout.from_settings(settings), args.node), end="")
    return 0


def _agent(args: argparse.Namespace, settings: Settings) -> int:
    from rankscope.services.agent.main import run

    return run(settings)


def _aggregator(args: argparse.Namespace, settings: Settings) -> int:
    from rankscope.services.aggregator.main import run

    return run(settings)


def _gateway(args: argparse.Namespace, settings: Settings) -> int:
    from rankscope.services.gateway.main import run

    return run(settings)


def _record(args: argparse.Namespace, settings: Settings) -> int:
    from rankscope.services.record.command import record

    return record(args, settings)


def _ranktable(args: argparse.Namespace, settings: Settings) -> int:
    if (args.job is None) == (not args.serve):
        print(
            "rankscope ranktable: give a JOB to print its rank table, or --serve to run the "
            "rank-table service (see --help)",
            file=sys.stderr,
        )
        return 2
    if args.job is not None:
        return ranktable_client(args)
    from rankscope.services.ranktable.main import run

    return run(settings)


_SETTINGS = "[--SETTING VALUE ...]"
"""Every setting as a flag, in a usage line (its list follows in --help)."""
_SERVICES = frozenset({"up", "agent", "aggregator", "gateway", "ranktable"})
"""Subcommands that run a service, named so in `ps`."""


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (`--help` has the rest), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The `rankscope` argument parser, every subcommand included."""
    parser = _Parser(
        prog="rankscope",
        description="Diagnostics plane for pipeline-parallel MLX inference.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = commands.add_parser(
        "up",
        help="run the whole stack on this machine",
        usage=f"%(prog)s [-h] [--demo] [--nats-auth] {_SETTINGS}",
    )
    up.add_argument("--demo", action="store_true", help="add a demo cluster with a tiny model")
    up.add_argument(
        "--nats-auth",
        action="store_true",
        help="give the embedded NATS one user per role, each allowed only what it does",
    )
    up.set_defaults(handler=_up)
    add_arguments(up)

    nats_config = commands.add_parser(
        "nats-config",
        help="print a nats-server config with one user per role and per node",
        usage=f"%(prog)s [-h] [--node NODE_ID ...] {_SETTINGS}",
    )
    nats_config.add_argument(
        "--node", action="append", default=[], metavar="NODE_ID", help="an agent's node id"
    )
    nats_config.set_defaults(handler=_nats_config)
    add_arguments(nats_config)

    agent = commands.add_parser(
        "agent",
        help="run this node's agent (runners, flight recorder)",
        usage=f"%(prog)s [-h] {_SETTINGS}",
    )
    agent.set_defaults(handler=_agent)
    add_arguments(agent)

    aggregator = commands.add_parser(
        "aggregator",
        help="run the aggregator (timeline, placement views, diagnosis)",
        usage=f"%(prog)s [-h] {_SETTINGS}",
    )
    aggregator.set_defaults(handler=_aggregator)
    add_arguments(aggregator)

    gateway = commands.add_parser(
        "gateway", help="run the HTTP gateway and web timeline", usage=f"%(prog)s [-h] {_SETTINGS}"
    )
    gateway.set_defaults(handler=_gateway)
    add_arguments(gateway)

    ranktable = commands.add_parser(
        "ranktable",
        help="print a job's rank table; with --serve, run the rank-table service",
        usage=f"%(prog)s [-h] JOB [--follow] [--url URL] [--json] | --serve {_SETTINGS}",
    )
    ranktable.add_argument(
        "--serve", action="store_true", help="run the rank-table service (`up` starts it so)"
    )
    ranktable.add_argument(
        "job", nargs="?", type=identifier, metavar="JOB", help="job id (= instance id)"
    )
    ranktable.add_argument("--follow", "-f", action="store_true", help="with JOB: every change")
    client_options(ranktable)
    ranktable.set_defaults(handler=_ranktable)
    add_arguments(ranktable)

    add_client_commands(commands)

    recorder = add_record_command(commands)
    recorder.set_defaults(handler=_record)
    add_arguments(recorder)

    add_fr_command(commands)

    tiny = commands.add_parser("tiny-model", help="write a tiny mlx-lm model directory")
    tiny.add_argument("directory", help="where to write the model")
    tiny.add_argument("--layers", type=int, default=4, help="transformer layers (4)")
    tiny.add_argument("--hidden", type=int, default=64, help="hidden size, multiple of 16 (64)")
    tiny.add_argument("--vocab", type=int, default=512, help="tokenizer vocabulary (512)")
    tiny.add_argument("--seed", type=int, default=0, help="weights seed (0)")
    tiny.add_argument(
        "--arch", choices=list(ARCHITECTURES), default="qwen2", help="architecture (qwen2)"
    )
    tiny.set_defaults(handler=_tiny_model)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `rankscope`; returns the exit code (2 for bad settings or usage)."""
    args = build_parser().parse_args(argv)
    try:
        settings = load(args)
    except SettingsError as exc:
        print(f"rankscope: {exc}", file=sys.stderr)
        return 2
    logs.configure(settings.log_format, settings.log_level)
    if args.command in _SERVICES and getattr(args, "serve", True):  # not a client call
        watch_parent_from_env()  # a service `up` started ends with it, on every platform
        setproctitle(f"rankscope {args.command}")  # an agent adds its node once it knows it
    handler: Callable[[argparse.Namespace, Settings], int] = args.handler
    return handler(args, settings)


if __name__ == "__main__":
    sys.exit(main())
