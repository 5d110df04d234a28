"""The recorder inside each rank keeps its own copy of what `shared/recording.py` names (it
is loaded by path into interpreters without rankscope): the copy must not drift."""

from __future__ import annotations

import re
from pathlib import Path

from rankscope.services.record import hook, pipe, rank, torch_hook
from rankscope.shared import recording
from rankscope.shared.recording import Handoff, rank_marker


def test_the_hook_waits_as_the_contract_says() -> None:
    assert rank.WAIT_NOTE_S == hook.WAIT_NOTE_S == recording.WAIT_NOTE_S


def test_the_recorder_reads_only_the_contract_s_variables_and_marks_ranks_alike() -> None:
    source = "".join(
        Path(module.__file__ or "").read_text() for module in (hook, torch_hook, rank, pipe)
    )
    named = {value for key, value in vars(Handoff).items() if key.isupper()}
    assert set(re.findall(r'"(RANKSCOPE_RECORD_[A-Z_]+)"', source)) == named
    assert re.findall(r'f"\{[^}]+\}(\.rank)"', source) == [".rank", ".rank"]
    assert rank_marker(4242) == "4242.rank"
