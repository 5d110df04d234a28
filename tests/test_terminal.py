"""`rankscope up`'s terminal: whole lines above one status line on a terminal; plain
lines off one."""

from __future__ import annotations

import asyncio
import io
import logging
import re
from collections.abc import Iterator

import pytest
from rich.console import Console

from rankscope.services.stack.terminal import Terminal
from rankscope.shared import logs

_CONTROL = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")


def _tty() -> tuple[Terminal, io.StringIO]:
    written = io.StringIO()
    return Terminal(Console(file=written, force_terminal=True, width=100)), written


@pytest.fixture
def configured() -> Iterator[None]:
    """Logging as `rankscope up` sets it up, undone afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    logs.configure("text", "info")
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.usefixtures("configured")
def test_on_a_terminal_lines_and_log_records_print_whole_above_the_status() -> None:
    terminal, written = _tty()
    with terminal:
        terminal.status("demo: 2/2 ranks ready")
        terminal.line("a child's log line")
        logging.getLogger("rankscope.test").warning("a record of up's own")
    shown = _CONTROL.sub("\n", written.getvalue()).splitlines()
    assert "a child's log line" in shown
    assert any(line.endswith("rankscope.test: a record of up's own") for line in shown), shown
    assert not any("ranks ready" in line and "log line" in line for line in shown)


async def test_a_child_s_output_is_relayed_line_by_line() -> None:
    terminal, written = _tty()
    stream = asyncio.StreamReader()
    stream.feed_data(b"first\nsecond, without its end")
    stream.feed_eof()
    await terminal.relay(stream)
    shown = _CONTROL.sub("\n", written.getvalue()).splitlines()
    assert [line for line in shown if line] == ["first", "second, without its end"]


def test_off_a_terminal_lines_go_to_stderr_and_nothing_else_is_drawn(
    capsys: pytest.CaptureFixture[str],
) -> None:
    terminal = Terminal(Console(file=io.StringIO(), force_terminal=False))
    with terminal:
        terminal.status("not drawn")
        terminal.line("a child's log line")
        terminal.say("demo ready")
    out, err = capsys.readouterr()
    assert (out, err) == ("demo ready\n", "a child's log line\n")
