"""What `rankscope up` shows on a terminal: its own lines and its services' log lines,
each whole, above one status line that updates in place (the demo's ranks, chats and
findings). Off a terminal (a pipe, a file, CI) there is no status line and the services
write their logs themselves, as any process would."""

from __future__ import annotations

import asyncio
import logging
import sys
from types import TracebackType

from rich.console import Console
from rich.status import Status
from rich.text import Text

__all__ = ["Terminal"]


class _Through(logging.Handler):
    """Log records as whole lines through the terminal."""

    def __init__(self, terminal: Terminal, formatter: logging.Formatter | None) -> None:
        super().__init__()
        self._terminal = terminal
        if formatter is not None:
            self.setFormatter(formatter)

    def emit(self, record: logging.LogRecord) -> None:
        self._terminal.line(self.format(record))


class Terminal:
    """The terminal `up` runs in, if it runs in one.

    Use as a context manager: on a terminal, this process's log records go through it
    while it is open, so no line is ever glued to the status line.
    """

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(highlight=False)
        self.interactive = self.console.is_terminal
        self._status: Status | None = None
        self._handlers: list[logging.Handler] = []

    def __enter__(self) -> Terminal:
        if self.interactive:
            root = logging.getLogger()
            self._handlers = root.handlers[:]
            formatter = self._handlers[0].formatter if self._handlers else None
            root.handlers[:] = [_Through(self, formatter)]
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.clear()
        if self.interactive:
            logging.getLogger().handlers[:] = self._handlers

    def line(self, text: str) -> None:
        """Print one whole line (above the status line, on a terminal)."""
        if self.interactive:
            self.console.print(Text(text), soft_wrap=True)
        else:
            print(text, file=sys.stderr, flush=True)

    def say(self, text: str) -> None:
        """Print one line of `up`'s own to standard output."""
        if self.interactive:
            self.console.print(Text(text), soft_wrap=True)
        else:
            print(text, flush=True)

    def status(self, text: str) -> None:
        """Show `text` on the status line (a terminal only)."""
        if not self.interactive:
            return
        if self._status is None:
            self._status = self.console.status(Text(text))
            self._status.start()
        else:
            self._status.update(Text(text))

    def clear(self) -> None:
        """Take the status line away."""
        if self._status is not None:
            self._status.stop()
            self._status = None

    async def relay(self, stream: asyncio.StreamReader) -> None:
        """Print each line a child writes to `stream` until it closes."""
        while line := await stream.readline():
            self.line(line.decode(errors="replace").rstrip("\n"))
