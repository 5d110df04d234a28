"""One frozen settings object, read once from flags and `RANKSCOPE_*` variables.

Each setting `x_y` is the flag `--x-y` and the variable `RANKSCOPE_X_Y`; a flag wins over
the variable, the variable over the default. A bad value stops start-up with one line that
names where it came from.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import httpx

from rankscope.shared.partitions import MAX_PARTITIONS, Partition
from rankscope.shared.quantity import parse_bytes

__all__ = [
    "ENV_PREFIX",
    "Settings",
    "SettingsError",
    "add_arguments",
    "default",
    "env_name",
    "load",
    "to_environ",
]

ENV_PREFIX = "RANKSCOPE_"

MAX_REPLICAS = 5
"""The most copies JetStream keeps of a stream."""

_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*(ms|s|m|h|d)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


class SettingsError(ValueError):
    """A setting with a bad value; the message starts with the flag or variable."""


def _duration(text: str) -> float:
    match = _DURATION.match(text)
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(f"expected a positive duration such as 10, 2.5s, 500ms, 7d; got {text!r}")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2)]


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 1 < value < 100:
        raise ValueError(f"expected a ratio above 1 such as 1.25, got {text!r}")
    return value


def _share(text: str) -> float:
    try:
        value = float(text.removesuffix("%")) / (100 if text.endswith("%") else 1)
    except ValueError:
        value = -1.0
    if not 0 < value < 1:
        raise ValueError(f"expected a share between 0 and 1 such as 0.1 or 10%, got {text!r}")
    return value


def _deviations(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 100:
        raise ValueError(f"expected a number of deviations from 0 to 100 such as 5, got {text!r}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise ValueError(f"expected a port from 0 to 65535, got {value}")
    return value


def _flag_value(text: str) -> bool:
    value = text.strip().lower()
    if value not in {"1", "0", "true", "false", "yes", "no", "on", "off"}:
        raise ValueError(f"expected true or false, got {text!r}")
    return value in {"1", "true", "yes", "on"}


def _whole(text: str, least: int, wanted: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected a whole number, got {text!r}") from None
    if value < least:
        raise ValueError(f"expected {wanted}, got {value}")
    return value


def _file(text: str) -> Path:
    path = Path(text).expanduser()
    if not path.is_file():
        raise ValueError(f"no readable file {text!r}")
    return path


def _positive_int(text: str) -> int:
    return _whole(text, 1, "a positive number")


def _index(text: str) -> int:
    return _whole(text, 0, "0 or more")


def _size(text: str) -> int:
    value = parse_bytes(text)
    if value <= 0:
        raise ValueError(f"expected a positive size such as 512Mi or 1Gi, got {text!r}")
    return value


def _nats_urls(text: str) -> str:
    for url in text.split(","):
        if not re.match(r"^(nats|tls|ws|wss)://[^\s/]+$", url.strip()):
            raise ValueError(
                f"expected nats://host:port (comma separated for several), got {url!r}"
            )
    return text


def _replicas(text: str) -> int:
    value = _positive_int(text)
    if value > MAX_REPLICAS:
        raise ValueError(f"JetStream keeps at most {MAX_REPLICAS} copies, got {value}")
    return value


def _partitions(text: str) -> int:
    value = _positive_int(text)
    if value > MAX_PARTITIONS:
        raise ValueError(f"expected at most {MAX_PARTITIONS} partitions, got {value}")
    return value


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}; got {text!r}")
        return value

    return parse


def _words(text: str) -> tuple[str, ...]:
    return tuple(word.strip() for word in text.split(",") if word.strip())


def _url(text: str) -> str:
    """`text` if the HTTP client reads it as an http(s) URL with a host."""
    try:
        parsed = httpx.URL(text.strip())
    except httpx.InvalidURL as exc:
        why = str(exc)
    else:
        why = (
            "" if parsed.scheme in ("http", "https") and parsed.host else "not http(s) with a host"
        )
    if why:
        shown = re.sub(r"//[^/]*@", "//***@", text)[:60]  # no password in a log line
        raise ValueError(f"expected an http(s)://host:port URL, got {shown!r}: {why}")
    return text.strip()


def _urls(text: str) -> tuple[str, ...]:
    return tuple(_url(url) for url in _words(text))


def _text(text: str) -> str:
    if not text.strip():
        raise ValueError("must not be empty")
    return text.strip()


def _prefix(text: str) -> str:
    if not re.match(r"^[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*$", text):
        raise ValueError(f"expected dot-separated letters, digits, '-' or '_'; got {text!r}")
    return text


def _setting(default: Any, parse: Callable[[str], Any], help: str, *, secret: bool = False) -> Any:
    return field(default=default, metadata={"parse": parse, "help": help, "secret": secret})


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything an operator can configure, for every service."""

    nats_url: str | None = _setting(
        None, _nats_urls, "NATS server URL(s); `up` starts an embedded server when unset."
    )
    nats_user: str | None = _setting(None, _text, "NATS user name.")
    nats_password: str | None = _setting(None, _text, "NATS password.", secret=True)
    nats_token: str | None = _setting(None, _text, "NATS token.", secret=True)
    nats_creds: Path | None = _setting(None, _file, "NATS credentials file (JWT + nkey).")
    nats_tls_ca: Path | None = _setting(None, _file, "CA bundle to verify the NATS server.")
    nats_tls_cert: Path | None = _setting(None, _file, "Client certificate for NATS TLS.")
    nats_tls_key: Path | None = _setting(None, _file, "Client key for NATS TLS.")
    nats_port: int = _setting(4222, _port, "Client port of the embedded nats-server (0: any).")
    nats_ping_interval: float = _setting(
        10.0, _duration, "How often a service pings NATS; 3 pings unanswered end a dead link."
    )
    subject_prefix: str = _setting("rankscope", _prefix, "First token of every subject.")
    data_dir: Path = _setting(Path(".rankscope"), Path, "Where local state lives.")
    node_id: str | None = _setting(None, _text, "This node's id (default: kept in data dir).")
    friendly_name: str | None = _setting(None, _text, "This node's display name (hostname).")
    node_address: str = _setting("127.0.0.1", _text, "Address peers reach this node at.")
    nodepool: str = _setting("default", _text, "Nodepool this node belongs to.")
    node_labels: tuple[str, ...] = _setting((), _words, "Comma-separated node labels.")
    ring_port_base: int = _setting(
        52000, _port, "First port handed to ranks for their ring connections."
    )
    max_replicas: int = _setting(
        64, _positive_int, "Most instances one Runner spec may ask for (more: refused)."
    )
    max_runners_per_node: int = _setting(
        16, _positive_int, "Most runners placed on one node, every spec together."
    )
    heartbeat_ttl: float = _setting(10.0, _duration, "Node entry lifetime without heartbeat.")
    replicas: int = _setting(
        1, _replicas, "Copies of every stream and bucket: 3 on a NATS cluster (one may fail)."
    )
    aggregator_partitions: int = _setting(
        1,
        _partitions,
        "Partitions the instances are spread over, each folded by its own aggregators; "
        "the gateway asks every partition.",
    )
    aggregator_partition: int = _setting(
        0, _index, "The partition this aggregator folds (0 to aggregator_partitions - 1)."
    )
    telemetry_max_age: float = _setting(7 * 86400.0, _duration, "Telemetry retention (age).")
    telemetry_max_bytes: int = _setting(1 << 30, _size, "Telemetry retention (bytes).")
    telemetry_max_msgs_per_subject: int = _setting(
        700_000,
        _positive_int,
        "Telemetry messages kept per runner and kind: a chatty runner evicts its own oldest.",
    )
    collective_timeout: float = _setting(
        60.0, _duration, "Longest a runner waits in one collective before it gives up."
    )
    connect_timeout: float = _setting(
        120.0,
        _duration,
        "Longest a runner waits for its ring's peers to connect before its agent ends it "
        "(and starts it again).",
    )
    stall_threshold: float = _setting(
        10.0, _duration, "Seconds without progress before a working rank counts as stuck."
    )
    slow_ratio: float = _setting(
        1.15,
        _ratio,
        "How many times its usual work per step a rank must take over slow_window to be "
        "named slow (its peers not as far from theirs).",
    )
    slow_clear: float = _setting(
        1.1, _ratio, "The ratio under which a rank named slow is back in line."
    )
    slow_window: float = _setting(
        25.0, _duration, "Seconds of each rank's newest pace samples judged for slowness."
    )
    slow_hold: float = _setting(
        10.0,
        _duration,
        "Seconds a rank named slow must stay back in line before its finding clears.",
    )
    slow_noise: float = _setting(
        5.0,
        _deviations,
        "How many of its own deviations (how far its work per step strays over a span when "
        "nothing is wrong) a rank's work must also exceed its usual by to be named slow; "
        "0 judges by the ratios alone.",
    )
    slow_learn: float = _setting(
        90.0,
        _duration,
        "Seconds of a rank's pace samples the aggregator needs before it can name the rank "
        "slow: its usual work per step and how far that strays are learnt from them.",
    )
    straggler_share: float = _setting(
        0.10,
        _share,
        "The share of a job's step time spent waiting for one rank (the last to arrive in "
        "its collectives) that names it slow, when it is last far more often than chance.",
    )
    straggler_window: float = _setting(
        20.0, _duration, "Seconds of the newest steps every rank sampled compared to name one."
    )
    stage_window: float = _setting(
        20.0,
        _duration,
        "Seconds of the newest steps a pipeline's stages are compared over, per layer, to "
        "name the one the pipeline waits on.",
    )
    record_give_up: float = _setting(
        60.0,
        _duration,
        "How long a recorded rank's watcher keeps delivering after the rank ended.",
    )
    record_kill_after: float = _setting(
        15.0,
        _duration,
        "How long after `rankscope record` was asked to end the job its ranks may still run "
        "before those still running are killed (blocked in a collective whose peer ended, "
        "they run no signal handler).",
    )
    record_ranks_per_node: int = _setting(
        256,
        _positive_int,
        "Recorded ranks one node may hold at once, registering or live (more: refused).",
    )
    record_deadline: float = _setting(
        120.0,
        _duration,
        "How long a recorded rank may stop asking while its job gathers, or stay silent once "
        "its job is announced, before it is dropped.",
    )
    load_threshold: float = _setting(
        300.0, _duration, "The same for connecting, loading and warming up."
    )
    retention_per_runner: int = _setting(
        250_000, _positive_int, "Flight-recorder entries the aggregator keeps per runner."
    )
    retention_total: int = _setting(
        2_000_000, _positive_int, "Flight-recorder entries the aggregator keeps in all."
    )
    retention_bytes: int = _setting(
        512 << 20,
        _size,
        "Bytes of flight-recorder entries the aggregator keeps in all: past it, the node "
        "holding the most gives up its oldest first.",
    )
    snapshots: bool = _setting(
        True, _flag_value, "Keep the aggregator's folded state in the data dir between restarts."
    )
    snapshot_interval: float = _setting(
        30.0, _duration, "Seconds between aggregator snapshots (taken when something changed)."
    )
    alertmanager_url: tuple[str, ...] = _setting(
        (),
        _urls,
        "Alertmanager URLs the aggregator alerts (comma separated; user:password@ for basic auth).",
    )
    alertmanager_token: str | None = _setting(
        None, _text, "Bearer token for Alertmanager.", secret=True
    )
    public_url: str | None = _setting(
        None, _url, "The gateway's URL as operators reach it (links in alerts)."
    )
    api_token: str | None = _setting(
        None, _text, "Bearer token the gateway requires for changes.", secret=True
    )
    api_token_reads: bool = _setting(
        False, _flag_value, "Require the token for reads too (with api_token set)."
    )
    request_timeout: float = _setting(
        5.0, _duration, "Deadline of one gateway request to the services behind it."
    )
    chat_default_tokens: int = _setting(
        128, _positive_int, "Tokens a chat completion generates when it names no max_tokens."
    )
    chat_max_tokens: int = _setting(
        4096, _positive_int, "Most tokens a chat completion may ask for (more: a 422)."
    )
    gateway_host: str = _setting("127.0.0.1", _text, "Address the HTTP gateway binds.")
    gateway_port: int = _setting(8000, _port, "Port of the HTTP gateway.")
    grpc_host: str = _setting("127.0.0.1", _text, "Address the rank-table gRPC service binds.")
    grpc_port: int = _setting(8899, _port, "Port of the rank-table gRPC service.")
    access_log: bool = _setting(
        True, _flag_value, "Log every HTTP request (`up` leaves it off unless set)."
    )
    log_format: Literal["text", "json"] = _setting("text", _choice("text", "json"), "Log lines.")
    log_level: str = _setting(
        "info", _choice("debug", "info", "warning", "error"), "Lowest level logged."
    )

    def __post_init__(self) -> None:
        if self.aggregator_partition >= self.aggregator_partitions:
            raise SettingsError(
                f"{env_name('aggregator_partition')}: expected 0 to "
                f"{self.aggregator_partitions - 1} with {self.aggregator_partitions} "
                f"partitions, got {self.aggregator_partition}"
            )

    @property
    def partition(self) -> Partition:
        """The instances this aggregator folds and answers for."""
        return Partition(self.aggregator_partition, self.aggregator_partitions)

    @property
    def nats_servers(self) -> list[str]:
        """The NATS servers to connect to (the local default port when unset)."""
        if self.nats_url is None:
            return [f"nats://127.0.0.1:{self.nats_port or 4222}"]
        return [url.strip() for url in self.nats_url.split(",")]

    def __repr__(self) -> str:
        shown = []
        for spec in fields(self):
            value = getattr(self, spec.name)
            if spec.metadata["secret"] and value is not None:
                value = "***"
            shown.append(f"{spec.name}={value!r}")
        return f"Settings({', '.join(shown)})"


def default(name: str) -> Any:
    """The default of setting `name`: what the modules it tunes take when not told, so it
    is written once, here."""
    return Settings.__dataclass_fields__[name].default


def env_name(name: str) -> str:
    """The environment variable of setting `name`."""
    return ENV_PREFIX + name.upper()


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one `--flag` per setting; unset flags leave the variable or default in force."""
    group = parser.add_argument_group(
        "settings",
        "Each a flag or a RANKSCOPE_* variable (a flag wins); docs/CONFIGURATION.md has them all.",
    )
    for spec in fields(Settings):
        group.add_argument(
            _flag(spec.name),
            dest=f"setting_{spec.name}",
            metavar=spec.name.split("_")[-1].upper(),
            help=f"{spec.metadata['help']} [{env_name(spec.name)}]",
        )


def load(
    flags: argparse.Namespace | Mapping[str, str | None] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Build the settings from flags (as parsed by `add_arguments`) and the environment.

    Raises:
        SettingsError: a value does not parse; the message names the flag or variable.
    """
    given: Mapping[str, Any] = (
        {k.removeprefix("setting_"): v for k, v in vars(flags).items()}
        if isinstance(flags, argparse.Namespace)
        else (flags or {})
    )
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for spec in fields(Settings):
        raw, origin = given.get(spec.name), _flag(spec.name)
        if raw is None:
            raw, origin = env.get(env_name(spec.name)), env_name(spec.name)
        if raw is None:
            continue
        try:
            values[spec.name] = spec.metadata["parse"](raw)
        except ValueError as exc:
            raise SettingsError(f"{origin}: {exc}") from None
    return Settings(**values)


def to_environ(settings: Settings) -> dict[str, str]:
    """The `RANKSCOPE_*` variables that reproduce `settings` in a child process (only the
    settings that differ from their defaults)."""
    environ: dict[str, str] = {}
    for spec in fields(Settings):
        value = getattr(settings, spec.name)
        if value == spec.default:
            continue
        if isinstance(value, tuple):
            value = ",".join(value)
        environ[env_name(spec.name)] = "" if value is None else str(value)
    return environ
