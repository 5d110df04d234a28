"""The gateway as the CLI sees it: JSON calls and server-sent event streams (httpx and
httpx-sse), every failure one line."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import httpx
from httpx_sse import SSEError, connect_sse

from rankscope.shared.headers import MISSING_PARTITIONS_HEADER

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
        token = token or os.environ.get("RANKSCOPE_API_TOKEN")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._session: httpx.Client | None = None

    def _client(self) -> httpx.Client:
        """One client for the command's life (`--follow` asks every second): each client
        made builds its TLS context, 20 ms of CPU."""
        if self._session is None:
            self._session = httpx.Client(base_url=self.url, headers=self._headers)
        return self._session

    def call(self, method: str, path: str, body: Any = None, timeout: float = 30) -> Any:
        """JSON of a request.

        Raises:
            ClientError: the gateway is unreachable or answered with an error.
        """
        try:
            answer = self._client().request(method, path, json=body, timeout=timeout)
        except httpx.HTTPError as error:
            raise self._unreachable(error) from None
        if answer.is_error:
            raise self._refused(answer)
        if missing := answer.headers.get(MISSING_PARTITIONS_HEADER):
            print(
                f"partial answer: aggregator partition {missing} did not answer; "
                "their instances are not shown",
                file=sys.stderr,
            )
        return self._json(answer.content or b"null")

    def _json(self, data: bytes) -> Any:
        try:
            return json.loads(data)
        except ValueError:
            raise ClientError(
                f"{self.url} did not answer as rankscope's gateway does (no JSON)"
            ) from None

    def _unreachable(self, error: httpx.HTTPError) -> ClientError:
        return ClientError(f"cannot reach {self.url}: {error or type(error).__name__}")

    def _refused(self, answer: httpx.Response) -> ClientError:
        """The error of an answer with a failure status, one line."""
        try:
            detail = json.loads(answer.read() or b"{}").get("detail", answer.reason_phrase)
        except (ValueError, AttributeError):
            detail = f"{answer.reason_phrase} (not rankscope's gateway at {self.url}?)"
        return ClientError(f"{answer.status_code}: {detail}", answer.status_code)

    def download(self, path: str, timeout: float = 60) -> bytes:
        """The bytes of a GET (a file the gateway builds).

        Raises:
            ClientError: as `call`.
        """
        try:
            answer = self._client().get(path, timeout=timeout)
        except httpx.HTTPError as error:
            raise self._unreachable(error) from None
        if answer.is_error:
            raise self._refused(answer)
        return answer.content

    def events(self, path: str) -> Iterator[str]:
        """The data of each server-sent event of a stream, as it comes.

        Raises:
            ClientError: as `call`, or the answer is not an event stream.
        """
        try:
            with connect_sse(self._client(), "GET", path, timeout=None) as source:
                if source.response.is_error:
                    raise self._refused(source.response)
                for event in source.iter_sse():
                    if event.data:
                        yield event.data
        except SSEError:
            raise ClientError(
                f"{self.url}{path} is not an event stream (not rankscope's gateway?)"
            ) from None
        except httpx.HTTPError as error:
            raise self._unreachable(error) from None
