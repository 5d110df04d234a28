"""PyTorch Flight Recorder dumps read as untrusted data, without torch.

A dump is one rank's ring of collective and point-to-point records with its process
groups (`pg_config`) and each group's counters (`pg_status`): the pickle torch writes
when a collective times out, or the JSON its `_dump_*_json` and HTTP handlers give.
Versions 2.x differ in small ways (`nccl_version` later `comm_lib_version`, tuples or
lists, counters as ints or strings, unset times `None` or `0`, `entries` absent when
empty, `frames` in pickle only); every such shape reads into the one model below.

A pickle is refused, unread, when any opcode would import or call: only dicts, lists,
tuples, strings, numbers, booleans and None are loaded, and no class is ever looked up.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import pickletools
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec

__all__ = [
    "MAX_DUMP_BYTES",
    "Dump",
    "DumpError",
    "Entry",
    "Frame",
    "Group",
    "GroupStatus",
    "HostileDumpError",
    "read_dump",
    "read_dumps",
]

MAX_DUMP_BYTES = 256 << 20
"""The largest dump read (torch's default ring of 2,000 entries with stacks is a few MB)."""

_CODE = frozenset(
    {
        "GLOBAL",
        "STACK_GLOBAL",
        "INST",
        "OBJ",
        "REDUCE",
        "BUILD",
        "NEWOBJ",
        "NEWOBJ_EX",
        "EXT1",
        "EXT2",
        "EXT4",
        "PERSID",
        "BINPERSID",
    }
)
"""Opcodes that import a name, call it, or hand data to code: no dump needs one."""
_RANK = re.compile(r"(\d+)(?:\.json|\.pkl|\.pickle)?$")


class DumpError(Exception):
    """A file that is no readable Flight Recorder dump, in one line naming it."""


class HostileDumpError(DumpError):
    """A file built to run code when unpickled: refused, and nothing of it ran."""


class Frame(msgspec.Struct, frozen=True):
    """One Python frame of the stack that issued a record."""

    name: str = ""
    filename: str = ""
    line: int = 0


class Entry(msgspec.Struct, frozen=True, kw_only=True):
    """One record of a rank's ring: a collective or a send/recv, as torch names it."""

    record_id: int = 0
    pg_id: int = 0
    process_group: tuple[str, str] = ("", "")
    """The group's name and description."""
    collective_seq_id: int = 0
    p2p_seq_id: int = 0
    profiling_name: str = ""
    time_created_ns: int | None = None
    input_sizes: list[Any] = []
    input_dtypes: list[str] = []
    output_sizes: list[Any] = []
    output_dtypes: list[str] = []
    state: str = "scheduled"
    time_discovered_started_ns: int | None = None
    time_discovered_completed_ns: int | None = None
    timeout_ms: int | None = None
    retired: bool = False
    """Completed and let go by torch (gloo's records say completion only this way)."""
    is_p2p: bool = False
    frames: list[Frame] = []

    @property
    def group(self) -> str:
        """The process group's name (joins records of one group across ranks)."""
        return self.process_group[0]

    @property
    def op(self) -> str:
        """The operation without its backend: `all_reduce`, `send 0->3`."""
        return self.profiling_name.split(":", 1)[-1]


class Group(msgspec.Struct, frozen=True):
    """A process group as a rank's dump describes it."""

    name: str = ""
    desc: str = ""
    ranks: list[int] | str = []

    def members(self) -> list[int]:
        """Its global ranks, in group-rank order."""
        if isinstance(self.ranks, str):  # torch writes the list as text
            try:
                parsed = json.loads(self.ranks)
            except ValueError:
                return []
            return [int(r) for r in parsed] if isinstance(parsed, list) else []
        return list(self.ranks)


class GroupStatus(msgspec.Struct, frozen=True):
    """A rank's counters for one process group (-1: none yet)."""

    last_enqueued_collective: int = -1
    last_started_collective: int = -1
    last_completed_collective: int = -1


class Dump(msgspec.Struct, frozen=True, kw_only=True):
    """One rank's Flight Recorder dump."""

    rank: int
    source: str
    version: str = ""
    comm_lib_version: str = ""
    pg_config: dict[str, Group] = {}
    pg_status: dict[str, GroupStatus] = {}
    """Keyed by the group's id on this rank (`Entry.pg_id`), not its name."""
    entries: list[Entry] = []


def _data_only(data: bytes, name: str) -> Any:
    """The value a pickle holds, refused unread if any opcode imports or calls."""
    try:
        for opcode, _, position in pickletools.genops(data):
            if opcode.name in _CODE:
                raise HostileDumpError(
                    f"{name}: refused: the pickle would import or call code ({opcode.name} "
                    f"at byte {position}); a Flight Recorder dump holds data only"
                )
    except (ValueError, IndexError, UnicodeDecodeError) as exc:
        raise DumpError(f"{name}: not a whole pickle ({exc})") from None
    try:
        return _NoClasses(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, ValueError) as exc:
        raise DumpError(f"{name}: not a whole pickle ({exc})") from None


class _NoClasses(pickle.Unpickler):
    """An unpickler that looks up no class (the opcode scan already refused them)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused to look up {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refused a persistent id")


def rank_of(path: Path) -> int | None:
    """The rank a dump's file name ends in (`_dump_12`, `rank-3.json`), if it does."""
    found = _RANK.search(path.name)
    return int(found.group(1)) if found else None


def read_dump(path: Path, rank: int | None = None) -> Dump:
    """One dump, pickle or JSON; its rank from the file name unless given.

    Raises:
        DumpError: unreadable, too large, hostile, or not a Flight Recorder dump.
    """
    name = str(path)
    try:
        with path.open("rb") as file:
            if os.fstat(file.fileno()).st_size > MAX_DUMP_BYTES:
                raise DumpError(f"{name}: larger than {MAX_DUMP_BYTES >> 20} MiB, not read")
            data = file.read(MAX_DUMP_BYTES + 1)
    except OSError as exc:
        raise DumpError(f"{name}: {exc.strerror or exc}") from None
    if len(data) > MAX_DUMP_BYTES:  # it grew while read
        raise DumpError(f"{name}: larger than {MAX_DUMP_BYTES >> 20} MiB, not read")
    rank = rank if rank is not None else rank_of(path)
    if rank is None:
        raise DumpError(f"{name}: no rank in the file name (torch names dumps <prefix><rank>)")
    if not data.strip():
        raise DumpError(f"{name}: empty")
    if data.lstrip()[:1] in (b"{", b"["):
        try:
            raw = json.loads(data)
        except ValueError as exc:
            raise DumpError(f"{name}: not whole JSON ({exc})") from None
    elif data[:1] == pickle.PROTO:  # torch pickles with protocol 2 or later
        raw = _data_only(data, name)
    else:
        raise DumpError(f"{name}: not a Flight Recorder dump (neither JSON nor a pickle)")
    return _model(raw, rank, name)


def _model(raw: Any, rank: int, name: str) -> Dump:
    if not isinstance(raw, dict) or not ({"pg_config", "entries", "version"} & raw.keys()):
        raise DumpError(f"{name}: not a Flight Recorder dump (no version, pg_config or entries)")
    fields = {k: v for k, v in raw.items() if isinstance(k, str)}
    if "comm_lib_version" not in fields and "nccl_version" in fields:
        fields["comm_lib_version"] = fields.pop("nccl_version")
    for key in ("entries", "pg_config", "pg_status"):
        if fields.get(key) is None:
            fields.pop(key, None)
    try:
        return msgspec.convert({**fields, "rank": rank, "source": name}, Dump, strict=False)
    except msgspec.ValidationError as exc:
        raise DumpError(f"{name}: a Flight Recorder dump of an unknown shape ({exc})") from None


def _files(paths: Iterable[Path]) -> Iterator[Path]:
    """Each file given, and each file of a folder given whose name ends in a rank."""
    for path in paths:
        if path.is_dir():
            yield from sorted(p for p in path.iterdir() if p.is_file() and rank_of(p) is not None)
        else:
            yield path


def read_dumps(paths: Iterable[Path]) -> tuple[list[Dump], list[DumpError]]:
    """Every dump under `paths` (files, or folders of one file per rank), and why each
    file that could not be read was not. A rank given twice keeps its first file."""
    dumps: dict[int, Dump] = {}
    problems: list[DumpError] = []
    for path in _files(paths):
        try:
            dump = read_dump(path)
        except DumpError as exc:
            problems.append(exc)
            continue
        if dump.rank in dumps:
            kept = dumps[dump.rank].source
            problems.append(DumpError(f"{path}: rank {dump.rank} again (kept {kept})"))
            continue
        dumps[dump.rank] = dump
    return [dumps[r] for r in sorted(dumps)], problems
