"""`compose.yaml` runs real `rankscope` subcommands configured by real settings (no Docker
engine runs here, so the file itself is checked)."""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from services.cli import build_parser
from shared.settings import Settings, env_name

REPO = Path(__file__).parent.parent
COMPOSE = yaml.safe_load((REPO / "compose.yaml").read_text())
SETTINGS = {env_name(f.name) for f in dataclasses.fields(Settings)}


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
    assert "./shared/nats.conf:/etc/nats/rankscope.conf:ro" in nats["volumes"]
    assert "healthcheck" in nats


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
        variables = set(service.get("environment", {}))
        entry = " ".join(service.get("entrypoint") or [])
        variables |= set(re.findall(r"(RANKSCOPE_[A-Z_]+)=", entry))
        assert variables <= SETTINGS, f"{name}: {sorted(variables - SETTINGS)} are not settings"


def test_gateway_on_8000_with_a_readiness_check_and_restart_policies() -> None:
    gateway = COMPOSE["services"]["gateway"]
    assert "8000:8000" in gateway["ports"]
    assert "/readyz" in " ".join(gateway["healthcheck"]["test"])
    for name in ("aggregator", "ranktable", "gateway", "agent"):
        assert COMPOSE["services"][name]["restart"] == "unless-stopped"
