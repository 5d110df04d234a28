"""Logging set up in one place: readable lines by default, JSON lines on request."""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from typing import Any

import msgspec

from rankscope.shared.timestamps import format_ts

__all__ = ["configure", "structured"]

_RESERVED = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "color_message",  # uvicorn repeats its message with terminal colors
}
_json = msgspec.json.Encoder(enc_hook=repr)


def _timestamp(record: logging.LogRecord) -> str:
    return format_ts(datetime.fromtimestamp(record.created, UTC))


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _RESERVED}


class TextFormatter(logging.Formatter):
    """`<time> <LEVEL> <logger>: <message> key=value ...`"""

    def format(self, record: logging.LogRecord) -> str:
        extras = " ".join(f"{k}={v}" for k, v in _extras(record).items())
        line = f"{_timestamp(record)} {record.levelname:<7} {record.name}: {record.getMessage()}"
        if extras:
            line += " " + extras
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: `ts`, `level`, `logger`, `msg`, extras, `exc`."""

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **_extras(record),
        }
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return _json.encode(payload).decode()


def configure(log_format: str = "text", level: str = "info") -> None:
    """Send every logger's records to stderr in `log_format` ("text" or "json")."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for chatty in ("nats", "httpx"):  # a line per reconnect attempt, per request
        logging.getLogger(chatty).setLevel(max(root.level, logging.WARNING))


def structured() -> bool:
    """Whether this process logs JSON lines."""
    return any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers)
