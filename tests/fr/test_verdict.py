"""Flight Recorder dumps judged: NVIDIA's 16-rank Megatron dumps with injected faults name
exactly the ranks their reference output lists, pickle or JSON alike; dumps of real 4-rank
gloo jobs made here name the hung rank, both sides of a desync, and nobody when healthy;
and the shapes of the wild (renamed keys, text counters, missing parts) read the same."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest

from rankscope.services.fr.dumps import read_dump, read_dumps
from rankscope.services.fr.verdict import judge
from rankscope.shared.wire.fr import FrVerdict

FIXTURES = Path(__file__).parent.parent / "fixtures" / "fr"
NVIDIA = ("gpu_error_1st", "gpu_error_2nd", "lock_gil_1st", "lock_gil_2nd")


def _verdict(*paths: Path) -> FrVerdict:
    dumps, unread = read_dumps(paths)
    return judge(dumps, unread)


def _reference(scenario: str) -> list[int]:
    """The missing ranks NVIDIA's analyser printed (the table's last column)."""
    rows = (FIXTURES / "nvidia" / scenario / "reference.txt").read_text().splitlines()[1:]
    return sorted({int(r) for row in rows for r in re.split(r"\s*\|\s*", row)[-1].split(",")})


def _as_json(folder: Path, into: Path) -> Path:
    """Each pickle dump of `folder` written as JSON, as torch's JSON dumper would."""
    into.mkdir()
    for dump in folder.glob("_dump_*"):
        raw = pickle.loads(dump.read_bytes())
        (into / f"{dump.name}.json").write_text(json.dumps(raw))
    return into


@pytest.mark.parametrize("scenario", NVIDIA)
def test_nvidia_s_faults_name_exactly_the_ranks_their_reference_lists(scenario: str) -> None:
    verdict = _verdict(FIXTURES / "nvidia" / scenario)
    assert verdict.culprits == _reference(scenario)
    assert verdict.unread == []
    assert len(verdict.ranks) == 16


@pytest.mark.parametrize("scenario", NVIDIA)
def test_nvidia_s_dumps_read_as_json_give_the_same_verdict(scenario: str, tmp_path: Path) -> None:
    as_json = _verdict(_as_json(FIXTURES / "nvidia" / scenario, tmp_path / "json"))
    as_pickle = _verdict(FIXTURES / "nvidia" / scenario)
    assert as_json.culprits == as_pickle.culprits
    assert (as_json.stuck, as_json.summary) == (as_pickle.stuck, as_pickle.summary)
    unsourced = [msgspec.structs.replace(r, dump=None) for r in as_json.ranks]
    assert unsourced == [msgspec.structs.replace(r, dump=None) for r in as_pickle.ranks]


def test_a_culprit_is_shown_with_the_collective_its_peers_wait_in() -> None:
    verdict = _verdict(FIXTURES / "nvidia" / "gpu_error_1st")
    expert = next(s for s in verdict.stuck if s.groupDesc == "EXPERT_MODEL_PARALLEL_GROUP")
    assert (expert.collective.op, expert.collective.seq) == ("all_to_all", 20537)
    assert (expert.entered, expert.missing) == ([13, 14, 15], [12])
    waiting = {r.rank: r for r in verdict.ranks}
    assert waiting[13].role == "waiting"
    assert waiting[13].waitingOn == [12]
    assert waiting[12].role == "culprit"
    assert verdict.summary.startswith("rank 12 is the culprit: missing from all_to_all #20537")


@pytest.mark.parametrize("form", ["pickle", "json"])
def test_a_gloo_rank_that_never_enters_the_collective_is_named_alone(form: str) -> None:
    folder = FIXTURES / "gloo" / "hang"
    verdict = _verdict(folder if form == "pickle" else folder / "json")
    assert verdict.culprits == [3]
    (stuck,) = verdict.stuck
    assert (stuck.collective.op, stuck.entered, stuck.missing) == ("all_reduce", [0, 1, 2], [3])
    culprit = next(r for r in verdict.ranks if r.rank == 3)
    assert culprit.waitingIn is None  # stuck outside any collective
    if form == "pickle":  # only pickles hold stacks: where it issued its last collective
        assert any("make_dumps.py" in frame for frame in culprit.stack)


@pytest.mark.parametrize("form", ["pickle", "json"])
def test_a_gloo_desync_names_both_sides_with_their_operations(form: str) -> None:
    folder = FIXTURES / "gloo" / "desync"
    verdict = _verdict(folder if form == "pickle" else folder / "json")
    (mismatch,) = verdict.mismatches
    assert (mismatch.field, mismatch.seq) == ("operation", 6)
    assert mismatch.values == {"all_reduce": [0, 1, 2], "broadcast": [3]}
    assert verdict.culprits == [3]  # the side fewer took
    assert verdict.stuck == []


@pytest.mark.parametrize("form", ["pickle", "json"])
def test_a_healthy_gloo_run_names_nobody(form: str) -> None:
    folder = FIXTURES / "gloo" / "healthy"
    verdict = _verdict(folder if form == "pickle" else folder / "json")
    assert (verdict.culprits, verdict.stuck, verdict.mismatches) == ([], [], [])
    assert verdict.summary == "no rank waits: every recorded operation completed"


def _entry(seq: int, op: str = "all_reduce", **fields: Any) -> dict[str, Any]:
    return {
        "record_id": seq,
        "pg_id": 0,
        "process_group": ("0", "default_pg"),
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "profiling_name": f"nccl:{op}",
        "time_created_ns": 1_700_000_000_000_000_000 + seq,
        "input_sizes": [[4, 4]],
        "input_dtypes": ["Float"],
        "state": "scheduled",
        "is_p2p": False,
        **fields,
    }


def _write(folder: Path, rank: int, dump: dict[str, Any], form: str = "pickle") -> None:
    folder.mkdir(exist_ok=True)
    if form == "pickle":
        (folder / f"_dump_{rank}").write_bytes(pickle.dumps(dump))
    else:
        (folder / f"rank_{rank}.json").write_text(json.dumps(dump))


def _dump(entries: list[dict[str, Any]], completed: int = 0, **fields: Any) -> dict[str, Any]:
    dump: dict[str, Any] = {
        "version": "2.4",
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2]"}},
        "pg_status": {"0": {"last_enqueued_collective": 0, "last_completed_collective": completed}},
        "entries": entries,
    }
    dump.update(fields)
    return dump


@pytest.mark.parametrize(
    ("field", "changed", "said"),
    [
        ("input_sizes", [[4, 8]], "4x8"),
        ("input_dtypes", ["Half"], "Half"),
        ("profiling_name", "nccl:broadcast", "broadcast"),
    ],
)
def test_each_kind_of_disagreement_names_the_rank_that_differs(
    tmp_path: Path, field: str, changed: Any, said: str
) -> None:
    for rank in range(3):
        odd = {field: changed} if rank == 1 else {}
        _write(tmp_path, rank, _dump([_entry(1), _entry(2, **odd)], completed=1))
    verdict = _verdict(tmp_path)
    (mismatch,) = verdict.mismatches
    assert mismatch.seq == 2
    assert mismatch.values[said] == [1]
    assert verdict.culprits == [1]


def test_dumps_of_every_2x_shape_read_alike(tmp_path: Path) -> None:
    """Counters as text, `nccl_version` or `comm_lib_version`, unset times 0 or None,
    `entries` absent when empty, tuples or lists."""
    shapes = [
        _dump([_entry(1), _entry(2)], completed=1, nccl_version="2.18.1"),
        _dump(
            [_entry(1, time_discovered_started_ns=0), _entry(2, time_discovered_started_ns=None)],
            completed=1,
            comm_lib_version="2.21.5",
        ),
        _dump([], completed=1),
    ]
    shapes[1]["pg_status"]["0"] = {k: str(v) for k, v in shapes[1]["pg_status"]["0"].items()}
    del shapes[2]["entries"]
    for rank, shape in enumerate(shapes):
        _write(tmp_path, rank, shape, "json" if rank == 1 else "pickle")
    verdict = _verdict(tmp_path)
    assert verdict.culprits == [2]  # in no collective while 0 and 1 wait in #2
    assert [d.comm_lib_version for d in read_dumps([tmp_path])[0]] == ["2.18.1", "2.21.5", ""]


def test_a_truncated_dump_is_said_and_its_rank_judged_without_it(tmp_path: Path) -> None:
    for rank in range(3):
        _write(tmp_path, rank, _dump([_entry(1), _entry(2)], completed=1))
    whole = (tmp_path / "_dump_2").read_bytes()
    (tmp_path / "_dump_2").write_bytes(whole[: len(whole) // 2])
    verdict = _verdict(tmp_path)
    (unread,) = verdict.unread
    assert unread.startswith(f"{tmp_path / '_dump_2'}: not a whole pickle")
    assert verdict.withoutDump == [2]
    assert [r.role for r in verdict.ranks] == ["waiting", "waiting", "culprit"]


def test_a_rank_without_a_dump_that_its_peers_wait_on_is_the_culprit(tmp_path: Path) -> None:
    _write(tmp_path, 0, _dump([_entry(1), _entry(2)], completed=1))
    _write(tmp_path, 1, _dump([_entry(1), _entry(2)], completed=1))
    _write(tmp_path, 2, _dump([_entry(1)], completed=1))
    (tmp_path / "_dump_2").unlink()
    verdict = _verdict(tmp_path)
    assert verdict.culprits == [2]
    assert next(r for r in verdict.ranks if r.rank == 2).dump is None


def test_a_file_that_is_no_dump_is_said_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "notes_0").write_text("hello")
    (tmp_path / "list_1").write_bytes(pickle.dumps([1, 2, 3]))
    (tmp_path / "huge_2").touch()
    with (tmp_path / "huge_2").open("r+b") as huge:
        huge.truncate(300 << 20)  # sparse: nothing is written, nothing read
    dumps, unread = read_dumps([tmp_path])
    assert dumps == []
    said = sorted(str(u).split(": ", 1)[1] for u in unread)
    assert said[0] == "larger than 256 MiB, not read"
    assert said[1] == "not a Flight Recorder dump (neither JSON nor a pickle)"
    assert said[2].startswith("not a Flight Recorder dump (no version")


def test_the_rank_comes_from_the_file_name_as_torch_writes_it(tmp_path: Path) -> None:
    _write(tmp_path, 12, _dump([_entry(1)]))
    assert read_dump(tmp_path / "_dump_12").rank == 12
