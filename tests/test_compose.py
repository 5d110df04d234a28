"""`compose.yaml` runs real `rankscope` subcommands configured by real settings, and
`compose.cluster.yaml` puts them on a routed 3-server NATS cluster with three copies of
everything (no Docker engine runs here, so the files themselves are checked)."""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from rankscope.services.cli import build_parser
from rankscope.shared.jetstream import Layout
from rankscope.shared.nats_auth import password_variable, render
from rankscope.shared.partitions import Partition
from rankscope.shared.settings import Settings, env_name, load

REPO = Path(__file__).parent.parent


class _ComposeLoader(yaml.SafeLoader):
    """Compose's YAML, its merge tags (`!override`, `!reset`) read as their plain values."""


def _untagged(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    return loader.construct_scalar(node)  # type: ignore[arg-type]


for _tag in ("!override", "!reset"):
    _ComposeLoader.add_constructor(_tag, _untagged)

COMPOSE = yaml.safe_load((REPO / "compose.yaml").read_text())
CLUSTER = yaml.load((REPO / "compose.cluster.yaml").read_text(), _ComposeLoader)
SERVERS = ("nats", "nats-2", "nats-3")
SETTINGS = {env_name(f.name) for f in dataclasses.fields(Settings)}
AGENTS = {n: s for n, s in COMPOSE["services"].items() if n.startswith("agent")}


def _rankscope_argv(service: dict[str, Any]) -> list[str] | None:
    entrypoint = service.get("entrypoint")
    if entrypoint and entrypoint[:2] == ["sh", "-c"]:
        words = shlex.split(entrypoint[2])
        return words[words.index("rankscope") + 1 :]
    return service.get("command")


def test_nats_runs_jetstream_on_a_volume_with_a_healthcheck() -> None:
    nats = COMPOSE["services"]["nats"]
    assert "--jetstream" in nats["command"]
    store = nats["command"][nats["command"].index("--store_dir") + 1]
    assert any(volume.endswith(f":{store}") for volume in nats["volumes"])
    assert "./deploy/nats-auth.conf:/etc/nats/rankscope.conf:ro" in nats["volumes"]
    assert "healthcheck" in nats


def test_the_shipped_nats_config_is_what_nats_config_prints_for_the_compose_nodes() -> None:
    nodes = [s["environment"]["RANKSCOPE_NODE_ID"] for n, s in AGENTS.items()]
    assert nodes == ["node-1", "node-2"]
    assert (REPO / "deploy" / "nats-auth.conf").read_text() == render(Layout(), nodes), (
        "regenerate: rankscope nats-config --node node-1 --node node-2 > deploy/nats-auth.conf"
    )


def test_every_service_connects_as_its_own_user_with_a_password_the_server_knows() -> None:
    server_env = COMPOSE["services"]["nats"]["environment"]
    config = (REPO / "deploy" / "nats-auth.conf").read_text()
    assert set(re.findall(r"password: \$(\w+)", config)) == set(server_env)
    for name in ("aggregator", "ranktable", "gateway", *AGENTS):
        env = COMPOSE["services"][name]["environment"]
        user = env["RANKSCOPE_NATS_USER"]
        # the service's password is the same variable (and default) the server reads
        assert env["RANKSCOPE_NATS_PASSWORD"] == server_env[password_variable(user)], name


def test_every_service_command_is_a_real_subcommand() -> None:
    parser = build_parser()
    for name, service in COMPOSE["services"].items():
        if name == "nats":
            continue
        argv = _rankscope_argv(service)
        assert argv, f"{name} runs no rankscope command"
        parsed = parser.parse_args(argv)  # exits (fails the test) on an unknown command
        assert parsed.command == argv[0]


def test_every_variable_is_a_real_setting() -> None:
    for name, service in COMPOSE["services"].items():
        if name == "nats":
            continue
        variables = set(service.get("environment", {}))
        entry = " ".join(service.get("entrypoint") or [])
        variables |= set(re.findall(r"(RANKSCOPE_[A-Z_]+)=", entry))
        assert variables <= SETTINGS, f"{name}: {sorted(variables - SETTINGS)} are not settings"


def test_gateway_on_8000_with_a_readiness_check_and_restart_policies() -> None:
    gateway = COMPOSE["services"]["gateway"]
    assert "8000:8000" in gateway["ports"]
    assert "/readyz" in " ".join(gateway["healthcheck"]["test"])
    for name in ("aggregator", "ranktable", "gateway", *AGENTS):
        assert COMPOSE["services"][name]["restart"] == "unless-stopped"


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_the_cluster_routes_three_jetstream_servers_to_each_other() -> None:
    names = set()
    for server in SERVERS:
        command = CLUSTER["services"][server]["command"]
        assert "--jetstream" in command
        assert _flag(command, "--cluster_name") == "rankscope"
        assert _flag(command, "--cluster") == "nats://0.0.0.0:6222"
        others = {f"nats://{other}:6222" for other in SERVERS if other != server}
        assert set(_flag(command, "--routes").split(",")) == others, server
        names.add(_flag(command, "--server_name"))
        # each server keeps its own store: the base's for `nats`, a volume of its own else
        volumes = CLUSTER["services"][server].get("volumes", COMPOSE["services"]["nats"]["volumes"])
        assert any(v.endswith(":/data") for v in volumes)
    assert len(names) == len(SERVERS), "server names are unique"
    stores = {v for s in SERVERS[1:] for v in CLUSTER["services"][s]["volumes"]}
    assert {v.split(":")[0] for v in stores if v.endswith(":/data")} <= set(CLUSTER["volumes"])
    assert "ports" not in CLUSTER["services"]["nats"], "the base's published ports stay"
    assert all(CLUSTER["services"][s]["ports"] == [] for s in SERVERS[1:])


def test_on_the_cluster_every_service_knows_every_server_and_keeps_three_copies() -> None:
    on_nats = [
        n
        for n, s in COMPOSE["services"].items()
        if "RANKSCOPE_NATS_USER" in s.get("environment", {})
    ]
    assert sorted(on_nats) == sorted(["aggregator", "ranktable", "gateway", *AGENTS])
    for name in on_nats:
        env = {
            **COMPOSE["services"][name]["environment"],
            **CLUSTER["services"][name]["environment"],
        }
        assert set(env) <= SETTINGS
        settings = load(None, {k: str(v) for k, v in env.items()})
        assert settings.replicas == 3, name
        assert (settings.nats_url or "").split(",") == [f"nats://{s}:4222" for s in SERVERS]


def test_on_the_cluster_two_aggregator_partitions_serve_a_gateway_that_asks_both() -> None:
    def settings(name: str) -> Settings:
        base = COMPOSE["services"][name.removesuffix("-2")]["environment"]
        env = {**base, **CLUSTER["services"][name]["environment"]}
        return load(None, {k: str(v) for k, v in env.items()})

    assert CLUSTER["services"]["aggregator-2"]["extends"]["service"] == "aggregator"
    partitions = {settings(n).partition for n in ("aggregator", "aggregator-2")}
    assert partitions == {Partition(0, 2), Partition(1, 2)}
    assert settings("gateway").aggregator_partitions == 2
    assert settings("aggregator-2").replicas == 3
