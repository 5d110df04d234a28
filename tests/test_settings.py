"""Settings come from flags, then `RANKSCOPE_*` variables, then defaults; a bad value
stops start-up with one line naming where it came from."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from rankscope.shared.settings import (
    Settings,
    SettingsError,
    add_arguments,
    env_name,
    load,
    to_environ,
)


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_defaults() -> None:
    settings = load({}, environ={})
    assert settings == Settings()
    assert settings.nats_servers == ["nats://127.0.0.1:4222"]
    assert settings.heartbeat_ttl == 10.0
    assert settings.gateway_port == 8000
    assert settings.grpc_port == 8899


def test_variable_overrides_default_and_flag_overrides_variable() -> None:
    environ = {"RANKSCOPE_GATEWAY_PORT": "9000", "RANKSCOPE_HEARTBEAT_TTL": "2.5s"}
    assert load({}, environ=environ).gateway_port == 9000
    settings = load(_parse("--gateway-port", "9100"), environ=environ)
    assert settings.gateway_port == 9100
    assert settings.heartbeat_ttl == 2.5


def test_values_are_parsed_into_types() -> None:
    settings = load(
        {},
        environ={
            "RANKSCOPE_TELEMETRY_MAX_AGE": "7d",
            "RANKSCOPE_TELEMETRY_MAX_BYTES": "512Mi",
            "RANKSCOPE_NODE_LABELS": "m2, ultra,",
            "RANKSCOPE_DATA_DIR": "/var/lib/rankscope",
            "RANKSCOPE_LOG_FORMAT": "JSON",
            "RANKSCOPE_NATS_URL": "nats://a:4222,nats://b:4222",
        },
    )
    assert settings.telemetry_max_age == 7 * 86400
    assert settings.telemetry_max_bytes == 512 * 2**20
    assert settings.node_labels == ("m2", "ultra")
    assert settings.data_dir == Path("/var/lib/rankscope")
    assert settings.log_format == "json"
    assert settings.nats_servers == ["nats://a:4222", "nats://b:4222"]


@pytest.mark.parametrize(
    ("name", "value", "complaint"),
    [
        ("gateway_port", "http", "expected a port number"),
        ("gateway_port", "70000", "from 0 to 65535"),
        ("heartbeat_ttl", "soon", "positive duration"),
        ("heartbeat_ttl", "0", "positive duration"),
        ("telemetry_max_bytes", "lots", "not a quantity"),
        ("log_format", "xml", "one of text, json"),
        ("nats_url", "localhost:4222", "nats://host:port"),
        ("subject_prefix", "a b", "dot-separated"),
        ("nats_creds", "/nonexistent/user.creds", "no readable file"),
        ("nats_tls_ca", "/nonexistent/ca.pem", "no readable file"),
        ("nats_tls_key", "/", "no readable file"),
    ],
)
def test_bad_variable_names_the_variable(name: str, value: str, complaint: str) -> None:
    with pytest.raises(SettingsError, match=rf"^{env_name(name)}: .*{complaint}"):
        load({}, environ={env_name(name): value})


def test_bad_flag_names_the_flag() -> None:
    with pytest.raises(SettingsError, match=r"^--grpc-port: expected a port number"):
        load(_parse("--grpc-port", "x"), environ={})


def test_secrets_are_masked_in_repr() -> None:
    settings = load({}, environ={"RANKSCOPE_NATS_PASSWORD": "hunter2", "RANKSCOPE_NATS_USER": "u"})
    assert settings.nats_password == "hunter2"
    assert "hunter2" not in repr(settings)
    assert "nats_user='u'" in repr(settings)


def test_cli_stops_with_one_line_naming_the_variable(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rankscope.services.cli", "up"],
        env={"RANKSCOPE_HEARTBEAT_TTL": "never", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent.parent,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "rankscope: RANKSCOPE_HEARTBEAT_TTL: expected a positive duration such as 10, 2.5s, "
        "500ms, 7d; got 'never'"
    ]


def test_child_processes_get_the_same_settings_through_the_environment() -> None:
    settings = load(
        {},
        environ={
            "RANKSCOPE_NATS_URL": "nats://a:4222,nats://b:4222",
            "RANKSCOPE_NODE_LABELS": "m2,ultra",
            "RANKSCOPE_HEARTBEAT_TTL": "2.5s",
            "RANKSCOPE_TELEMETRY_MAX_BYTES": "512Mi",
            "RANKSCOPE_DATA_DIR": "/srv/rankscope",
            "RANKSCOPE_NATS_PASSWORD": "hunter2",
        },
    )
    assert load({}, environ=to_environ(settings)) == settings
    assert "RANKSCOPE_GATEWAY_PORT" not in to_environ(settings)
