"""The flight recorder inside a recorded torch.distributed program: every rank says where it
waits, numbered as PyTorch's Flight Recorder numbers it, without changing what the
program computes and with no torch in rankscope.

Standard library only, loaded by path as `hook.py` is. Recording starts once the program's
`init_process_group` returns with more than one rank. What a rank waits in comes from
torch's own Flight Recorder in the process (`rankscope record` switches it on with
`TORCH_FR_BUFFER_SIZE` unless the program's environment sets a size): it sees every
collective of every process group, DDP's and FSDP's from C++ included. Each tick reads the
groups' status alone (microseconds: how many collectives each group enqueued and
completed); a collective in flight for `WAIT_NOTE_S` is read in full once (its op, sizes
and dtype) and said, quoted as `fr_trace` users know it: `all_reduce #42 (group default_pg)`,
42 being its `collective_seq_id`. Point-to-point ops, which gloo does not record there, are
counted and timed at the Python call (`send`, `recv`; `isend`, `irecv` counted).

The pace: a step ends where the program waits for its collectives, `backward()` returning
(DDP's reducer waits for its allreduces there) or a blocking collective called from
Python returning. Once a second the default group's new Flight Recorder entries are read
(when each collective was enqueued, on this rank's clock): a step's last collective was
enqueued when the rank arrived; from there to the step's end it waited, from the step
before's end to there it worked. Every rank samples the same steps (`Cadence`, by the
collectives' numbers), so the rank its peers wait on, the last to arrive, waits least on
the same step. No clock is compared between ranks.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from rankscope.services.record.pipe import name_process
from rankscope.services.record.rank import (
    SAMPLED_KEPT,
    WAIT_NOTE_S,
    Cadence,
    RankRecorder,
    node_id,
    note_exits,
)

__all__ = ["FR_BUFFER", "FR_ENTRIES", "TorchRecorder", "install"]

FR_BUFFER = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
"""The variables that size torch's Flight Recorder (the first is torch's newer name)."""
FR_ENTRIES = 256
"""The Flight Recorder's size when the program's environment gives none: a read of it in
full, done once per wait, costs about 6 ms at this size."""
_JOB_KEY = "rankscope/job"
_POINT_TO_POINT = ("send", "recv", "isend", "irecv")
_BLOCKING = frozenset({"send", "recv"})
_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "barrier",
)
"""Collectives a step may wait for from Python (when not `async_op`)."""
_KEPT = 1024
"""Step ends, and the default group's collectives, kept between two reads (seconds of
them)."""

FlightRecorder = Callable[[bool], dict[str, Any]]
"""Torch's Flight Recorder read as JSON: with its entries (True) or its groups' status only."""


def _flight_recorder() -> FlightRecorder | None:
    """Torch's Flight Recorder in this process, None when this torch has none."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json
    except ImportError:
        return None

    def read(entries: bool) -> dict[str, Any]:
        found: dict[str, Any] = json.loads(
            _dump_fr_trace_json(includeCollectives=entries, onlyActive=False)
        )
        return found

    return read


def _label(name: str, desc: str) -> str:
    """A process group as its ranks name it alike: its description where the program gave
    one (`default_pg`), else its name."""
    return desc if desc and desc != "undefined" else f"pg {name}"


class TorchRecorder(RankRecorder):
    """One torch.distributed rank's recording: what each of its process groups has in
    flight, from the Flight Recorder, and its blocking point-to-point call."""

    def __init__(self, torch: Any, rank: int, size: int, read: FlightRecorder | None) -> None:
        super().__init__(rank, size)
        self.torch, self.read = torch, read
        self.labels: dict[str, str] = {}
        """Process groups by name, as said (`_label`)."""
        self.flight: dict[str, tuple[int, float]] = {}
        """Per group, its oldest collective in flight: (number, monotonic since)."""
        self.said: dict[str, tuple[int, float]] = {}
        """Per group, the collective whose wait was said, and since when."""
        self.calling: tuple[str, dict[str, Any], float] | None = None
        """A blocking point-to-point call in progress: its site, attrs, monotonic since."""
        self.call_said = False
        self._lock = threading.Lock()
        self.world = _group_names(torch, None)[0]
        """The default group's name: its collectives make the steps."""
        self.cadence = Cadence()
        self.ends: deque[int] = deque(maxlen=_KEPT)
        """When steps ended (wall ns, this rank's clock), not yet read."""
        self._collectives: deque[tuple[int, int]] = deque(maxlen=_KEPT)
        """The default group's collectives not yet in a step: (number, enqueued wall ns)."""
        self._read_up_to = -1
        """The newest Flight Recorder record read."""
        self._step_ended: int | None = None
        self._pace: dict[str, Any] = _no_pace()

    def memory(self) -> dict[str, Any]:
        cuda = self.torch.cuda
        if not (cuda.is_available() and cuda.is_initialized()):
            return super().memory()
        active = cuda.memory_allocated()
        return {
            "source": "torch.cuda",
            "active": active,
            "peak": cuda.max_memory_allocated(),
            "cache": cuda.memory_reserved() - active,
        }

    def take_pace(self) -> dict[str, Any]:
        pace, self._pace = self._pace, _no_pace()
        return pace

    def each_second(self, moment: float) -> None:
        self.cadence.retune(self.counts.get(self.labels.get(self.world, ""), 0), moment)
        if self.read is None or not self.ends:
            return
        read_at = time.time_ns()
        try:
            entries = self.read(True).get("entries", [])
        except (RuntimeError, ValueError):
            return
        fresh = [e for e in entries if int(e.get("record_id", -1)) > self._read_up_to]
        if not fresh:
            return
        newest = max(int(e["record_id"]) for e in fresh)
        if self._read_up_to >= 0 and newest - self._read_up_to > len(fresh):
            self._step_ended = None  # the buffer came round since the last read: begin anew
        self._read_up_to = newest
        for entry in fresh:
            group = entry.get("process_group") or [""]
            if str(group[0]) == self.world and not entry.get("is_p2p"):
                created = int(entry.get("time_created_ns", 0))
                self._collectives.append((int(entry.get("collective_seq_id", 0)), created))
        last = max(fresh, key=lambda e: int(e["record_id"]))
        if not last.get("is_p2p"):  # how far the rank got, its op named
            name, desc = [*(last.get("process_group") or []), self.world, ""][:2]
            label = self.labels.setdefault(str(name), _label(str(name), str(desc)))
            self.issued = (_op(last), label, int(last.get("collective_seq_id", 0)))
        while self.ends and self.ends[0] <= read_at:
            self._step(self.ends.popleft())

    def _step(self, ended: int) -> None:
        """A step that ended at `ended` (wall ns): its collectives are those enqueued since
        the step before ended; sampled when the cadence says."""
        started, self._step_ended = self._step_ended, ended
        inside: list[tuple[int, int]] = []
        while self._collectives and self._collectives[0][1] <= ended:
            inside.append(self._collectives.popleft())
        if started is None or not inside:
            return  # a step whose start is not known, or with no collective
        (first, _), (last, arrived) = inside[0], inside[-1]
        pace = self._pace
        if not self.cadence.due(first, last) or len(pace["sampled"]) >= SAMPLED_KEPT:
            return
        work, wait = (arrived - started) / 1e9, (ended - arrived) / 1e9
        pace["steps"] += 1
        pace["workSeconds"] += work
        pace["waitSeconds"] += wait
        pace["sampled"].append((last, work, wait, 0.0))

    def poll(self, moment: float) -> None:
        self._poll_calls(moment)
        if self.read is None:
            return
        try:
            status = self.read(False).get("pg_status", {})
        except (RuntimeError, ValueError):
            return
        for name, figures in status.items():
            enqueued = int(figures.get("last_enqueued_collective", 0))
            completed = int(figures.get("last_completed_collective", 0))
            self._progress(name, enqueued, completed, moment)

    def _progress(self, name: str, enqueued: int, completed: int, moment: float) -> None:
        """A group's counts at `moment`: its steps, and a wait said or ended."""
        if name not in self.labels:
            self.labels.update(_world_labels(self.torch))
        label = self.labels.get(name, f"pg {name}")
        if enqueued > self.counts.get(label, 0):
            self.counts[label] = enqueued
            self.issued = ("collective", label, enqueued)
        said = self.said.get(name)
        if said is not None and completed >= said[0]:
            del self.said[name]
            self.note_resumed(moment - said[1])
        if enqueued <= completed:
            self.flight.pop(name, None)
            return
        oldest = completed + 1
        flying = self.flight.get(name)
        if flying is None or flying[0] != oldest:
            self.flight[name] = flying = (oldest, moment)
        if moment - flying[1] >= WAIT_NOTE_S and name not in self.said:
            self.said[name] = flying
            self._say_wait(name, oldest, enqueued - completed)

    def _say_wait(self, name: str, number: int, pending: int) -> None:
        """Say the group's collective `number` has been in flight a while, read in full."""
        assert self.read is not None
        try:
            entries = self.read(True).get("entries", [])
        except (RuntimeError, ValueError):
            entries = []
        for entry in entries:
            group = entry.get("process_group") or [name, ""]
            self.labels[str(group[0])] = _label(str(group[0]), str(group[1]))
        found = next(
            (
                e
                for e in entries
                if str((e.get("process_group") or [""])[0]) == name
                and e.get("collective_seq_id") == number
                and not e.get("is_p2p")
            ),
            None,
        )
        label = self.labels.get(name, f"pg {name}")
        if found is None:
            site = f"collective #{number} (group {label})"
            self.note_wait(site, group=label, step=number, pending=pending)
            return
        op = _op(found)
        sizes = found.get("input_sizes") or [[]]
        self.note_wait(
            f"{op} #{number} (group {label})",
            op=op,
            group=label,
            step=number,
            pending=pending,
            shape="x".join(map(str, sizes[0])) or "scalar",
            dtype=",".join(found.get("input_dtypes") or []),
            frRecord=found.get("record_id"),
        )

    def _poll_calls(self, moment: float) -> None:
        calling = self.calling
        if calling is None or self.call_said:
            return
        site, attrs, since = calling
        if moment - since >= WAIT_NOTE_S:
            self.call_said = True
            self.note_wait(site, **attrs)

    # What the program calls

    def point_to_point(self, op: str, peer: Any, group: Any) -> str:
        """A point-to-point op was issued to or from `peer`: its site."""
        name, desc = _group_names(self.torch, group)
        label = self.labels.setdefault(name, _label(name, desc))
        key = f"{label} p2p"
        with self._lock:
            number = self.counts[key] = self.counts.get(key, 0) + 1
        self.issued = (op, label, number)
        return f"{op} #{number} (group {label}, peer {peer})"

    def calls(self, site: str, op: str, peer: Any, since: float) -> None:
        """A blocking point-to-point call starts."""
        self.calling, self.call_said = (site, {"op": op, "peer": peer}, since), False

    def called(self, moment: float) -> None:
        """The blocking call returned."""
        calling, said = self.calling, self.call_said
        self.calling, self.call_said = None, False
        if calling is not None and said:
            self.note_resumed(moment - calling[2])


def _op(entry: dict[str, Any]) -> str:
    """A Flight Recorder entry's op as `fr_trace` users say it (`nccl:all_reduce`: the
    backend dropped)."""
    return str(entry.get("profiling_name", "")).split(":")[-1] or "collective"


def _no_pace() -> dict[str, Any]:
    return {"steps": 0, "workSeconds": 0.0, "waitSeconds": 0.0, "sampled": []}


def _world_labels(torch: Any) -> dict[str, str]:
    """Every process group the program made, by name, as said (`_label`)."""
    try:
        groups = dict(torch.distributed.distributed_c10d._world.pg_names)
    except (AttributeError, RuntimeError):
        return {}
    return {
        str(name): _label(str(name), str(getattr(group, "group_desc", "")))
        for group, name in groups.items()
    }


def _group_names(torch: Any, group: Any) -> tuple[str, str]:
    """A process group's name and description (the default group's when None)."""
    c10d = torch.distributed.distributed_c10d
    try:
        chosen = group if group is not None else c10d._get_default_group()
        return str(chosen.group_name), str(getattr(chosen, "group_desc", ""))
    except (AttributeError, RuntimeError, ValueError):
        return "0", ""


_recorder: TorchRecorder | None = None


def _job_id(dist: Any) -> str:
    """The job id every rank agrees on: given, else rank 0's drawn and shared through the
    job's own store (no collective: Flight Recorder numbers stay the program's)."""
    given = os.environ.get("RANKSCOPE_RECORD_JOB")
    if given:
        return given
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 0:
        store.set(_JOB_KEY, f"job-{secrets.token_hex(6)}")
    return bytes(store.get(_JOB_KEY)).decode()


def _start(torch: Any) -> None:
    """Record this rank once its default group has started."""
    global _recorder
    dist = torch.distributed
    if _recorder is not None or not dist.is_initialized() or dist.get_world_size() < 2:
        return
    rank, size = dist.get_rank(), dist.get_world_size()
    recorder = TorchRecorder(torch, rank, size, _flight_recorder())
    job = _job_id(dist)
    autograd = torch.autograd
    autograd.backward = _wrap_step_end(autograd.backward)
    recorder.attach(job, node_id())
    name_process(job, rank)
    backend = str(dist.get_backend())
    recorder.entry("connect_group", "group_ready", rank=rank, size=size, backend=backend)
    _recorder = recorder


def _wrap_init(torch: Any, init: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(init)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        result = init(*args, **kwargs)
        try:
            _start(torch)
        except Exception as exc:  # the program goes on, unrecorded
            print(f"rankscope record: rank not recorded: {exc}", file=sys.stderr)
        return result

    return wrapped


def _wrap_step_end(original: Callable[..., Any]) -> Callable[..., Any]:
    """`original` (`backward`, a collective) ends a step when it returns having waited
    (a collective called with `async_op` has not)."""

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        recorder = _recorder
        if recorder is not None and not kwargs.get("async_op"):
            recorder.ends.append(time.time_ns())
        return result

    return wrapped


def _wrap_point_to_point(op: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        recorder = _recorder
        if recorder is None:
            return original(*args, **kwargs)
        peer = kwargs.get("dst", kwargs.get("src", args[1] if len(args) > 1 else None))
        site = recorder.point_to_point(op, peer, kwargs.get("group"))
        if op not in _BLOCKING:
            return original(*args, **kwargs)
        recorder.calls(site, op, peer, time.monotonic())
        try:
            return original(*args, **kwargs)
        finally:
            recorder.called(time.monotonic())

    return wrapped


_installed = False


def install(dist: Any) -> None:
    """Wrap `dist` (the imported `torch.distributed`): recording starts when the program's
    default group does. Installing twice changes nothing."""
    global _installed
    if _installed or not hasattr(dist, "init_process_group"):
        return
    _installed = True
    torch = sys.modules["torch"]
    modules: list[Any] = [dist, sys.modules.get("torch.distributed.distributed_c10d")]
    for module in modules:
        if module is None:
            continue
        module.init_process_group = _wrap_init(torch, module.init_process_group)
        for op in _POINT_TO_POINT:
            if hasattr(module, op):
                setattr(module, op, _wrap_point_to_point(op, getattr(module, op)))
        for op in _COLLECTIVES:
            if hasattr(module, op):
                setattr(module, op, _wrap_step_end(getattr(module, op)))
    note_exits(lambda: _recorder)
