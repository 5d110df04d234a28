"""A small HTTP client for the gateway (standard library only)."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

__all__ = ["ClientError", "Gateway"]


class ClientError(Exception):
    """A request that failed; the message is one line for the terminal, `status` the HTTP
    status when the gateway answered."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class Gateway:
    """The gateway at `url` (default `RANKSCOPE_URL` or http://127.0.0.1:8000)."""

    def __init__(self, url: str | None = None, token: str | None = None) -> None:
        self.url = (url or os.environ.get("RANKSCOPE_URL") or "http://127.0.0.1:8000").rstrip("/")
        self.token = token or os.environ.get("RANKSCOPE_API_TOKEN")

    def _request(self, method: str, path: str, body: Any = None) -> urllib.request.Request:
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = json.dumps(body).encode() if body is not None else None
        return urllib.request.Request(self.url + path, data=data, method=method, headers=headers)

    def call(self, method: str, path: str, body: Any = None, timeout: float = 30) -> Any:
        """JSON of a request.

        Raises:
            ClientError: the gateway is unreachable or answered with an error.
        """
        try:
            with urllib.request.urlopen(self._request(method, path, body), timeout=timeout) as r:
                return self._json(r.read() or b"null")
        except urllib.error.HTTPError as error:
            raise self._refused(error) from None
        except (urllib.error.URLError, OSError) as error:
            raise ClientError(f"cannot reach {self.url}: {error}") from None

    def _json(self, data: bytes) -> Any:
        try:
            return json.loads(data)
        except ValueError:
            raise ClientError(
                f"{self.url} did not answer as rankscope's gateway does (no JSON)"
            ) from None

    def _refused(self, error: urllib.error.HTTPError) -> ClientError:
        """The error of an answer with a failure status, one line."""
        try:
            detail = json.loads(error.read() or b"{}").get("detail", error.reason)
        except (ValueError, AttributeError):
            detail = f"{error.reason} (not rankscope's gateway at {self.url}?)"
        return ClientError(f"{error.code}: {detail}", error.code)

    def events(self, path: str) -> Iterator[str]:
        """The `data:` lines of a server-sent event stream, as they come.

        Raises:
            ClientError: as `call`.
        """
        try:
            with urllib.request.urlopen(self._request("GET", path), timeout=None) as stream:
                for raw in stream:
                    line = raw.decode().rstrip("\n")
                    if line.startswith("data: "):
                        yield line[len("data: ") :]
        except urllib.error.HTTPError as error:
            raise self._refused(error) from None
        except (urllib.error.URLError, OSError) as error:
            raise ClientError(f"cannot reach {self.url}: {error}") from None
