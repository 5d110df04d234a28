"""Every shell line of the README works pasted into bash and into zsh (macOS's shell):
an interactive zsh has no comments (`# ...` goes to the command as words) and fails on an
unquoted glob that matches nothing (`?`, `*`, `[`)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.md"
_BLOCK = re.compile(r"^```sh\n(.*?)^```", re.S | re.M)
_HEREDOC = re.compile(r"<<-?'?(\w+)'?")


def _blocks() -> list[str]:
    return _BLOCK.findall(README.read_text())


def _lines(block: str) -> list[str]:
    """The lines a shell reads as commands (a here-document's body is data)."""
    found, ending = [], None
    for line in block.splitlines():
        if ending is not None:
            ending = None if line == ending else ending
            continue
        found.append(line)
        if match := _HEREDOC.search(line):
            ending = match.group(1)
    return found


def _unquoted(line: str) -> str:
    """The characters of `line` outside quotes."""
    kept, quote = [], None
    for char in line:
        if quote is not None:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        else:
            kept.append(char)
    return "".join(kept)


def test_the_readme_has_shell_lines_to_check() -> None:
    assert len(_blocks()) >= 5


@pytest.mark.parametrize("block", _blocks())
def test_no_comment_and_no_bare_glob_in_a_shell_line(block: str) -> None:
    for line in _lines(block):
        bare = _unquoted(line)
        assert "#" not in bare, f"an interactive zsh passes the comment on as words: {line}"
        assert not set("?*[]") & set(bare), f"zsh fails on a glob that matches nothing: {line}"


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_every_shell_block_parses(shell: str) -> None:
    path = shutil.which(shell)
    if path is None:
        pytest.skip(f"{shell} is not installed here")
    for block in _blocks():
        checked = subprocess.run([path, "-n"], input=block, capture_output=True, text=True)
        assert checked.returncode == 0, f"{shell}: {checked.stderr}\n{block}"
