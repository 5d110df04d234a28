"""`rankscope fr analyze` as a user runs it: the verdict in words or as JSON, and a hostile
pickle refused in one line with a non-zero exit while nothing of it runs."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

FIXTURES = Path(__file__).parent.parent / "fixtures" / "fr"


def _fr(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rankscope.services.cli", "fr", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


class _Planted:
    """What an attacker pickles: unpickling it runs `touch`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def test_the_verdict_in_words_names_the_culprit_and_who_waits() -> None:
    done = _fr("analyze", str(FIXTURES / "gloo" / "hang"))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "Flight Recorder dumps of ranks 0-3 (version 2.10)"
    assert lines[1].startswith("rank 3 is the culprit: missing from all_reduce #6 of default_pg")
    assert "  ranks 0-2: in all_reduce #6 [4 Float] of default_pg (group 0)" in done.stdout


def test_json_holds_the_culprits_as_rank_numbers() -> None:
    done = _fr("analyze", str(FIXTURES / "nvidia" / "lock_gil_2nd"), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["culprits"] == [10, 15]


def test_a_hostile_pickle_is_refused_in_one_line_and_nothing_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    hostile = tmp_path / "_dump_1"
    hostile.write_bytes(pickle.dumps({"version": "2.4", "entries": [_Planted(marker)]}))
    (tmp_path / "_dump_0").write_bytes((FIXTURES / "gloo" / "healthy" / "rank_0").read_bytes())
    done = _fr("analyze", str(tmp_path))
    assert done.returncode == 1
    (said,) = done.stderr.splitlines()
    assert said.startswith(
        f"rankscope fr: {hostile}: refused: the pickle would import or call code (STACK_GLOBAL"
    )
    assert not marker.exists()


def test_nothing_readable_is_said_and_fails(tmp_path: Path) -> None:
    done = _fr("analyze", str(tmp_path / "nowhere_0"))
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"rankscope fr: {tmp_path / 'nowhere_0'}: No such file or directory",
        "rankscope fr: no Flight Recorder dump read",
    ]
