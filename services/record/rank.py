"""What every recorded rank does, whatever its framework: says who it is, ticks (memory and
pace every second, how far it got, a wait once it is long enough), and says how its
process ends. `hook.py` (MLX) and `torch_hook.py` (torch.distributed) say where it waits.

Standard library only, loaded by path as `pipe.py` is (`site/sitecustomize.py`).
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import resource
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from rankscope.services.record.pipe import Pipe, now

__all__ = [
    "SAMPLED_KEPT",
    "SAMPLE_GAP_S",
    "WAIT_NOTE_S",
    "Cadence",
    "RankRecorder",
    "node_id",
    "note_exits",
    "step",
]

WAIT_NOTE_S = 1.0
"""How long a rank waits on its collectives before it says so: `shared/recording.py`'s,
kept here (this module is loaded by path where rankscope may not be installed;
tests/test_recording.py checks the copy)."""
TICK_S = 0.25

SAMPLE_GAP_S = 0.1
"""About the time between two sampled steps: ten a second tell a slow rank from one its
neighbours on the core took turns from; a job stepping fast samples one step in many (an
MLX rank's sampled step costs two synchronisations per collective), one stepping slowly
every step."""
FIRST_EVERY = 16
"""One world collective in so many reaches a sampled step until the job's rate is known
(after its first second): a job's first steps come fast, and sampling each costs."""
SAMPLED_KEPT = 64
"""Sampled steps said on their own in one pace sample (a second's worth and more)."""


class Cadence:
    """Which steps a rank samples: those whose world collectives reach a multiple of
    `every`, a power of two set from how many world collectives the job issues a second.
    Ranks of a job in step issue them at one rate, so they sample the same steps; one a
    step behind a change of rate samples every other of them, still the same steps."""

    def __init__(self) -> None:
        self.every = FIRST_EVERY
        self._counted, self._at = 0, time.monotonic()

    def retune(self, issued: int, moment: float) -> None:
        """`issued` world collectives so far at `moment` (monotonic): `every` doubled, or
        quartered, once the rate since the last call asks for it (not at each wobble)."""
        elapsed = moment - self._at
        if elapsed <= 0:
            return
        wanted = (
            1
            << (
                max(1, math.ceil((issued - self._counted) / elapsed * SAMPLE_GAP_S)) - 1
            ).bit_length()
        )
        if wanted >= 2 * self.every or 4 * wanted <= self.every:
            self.every = wanted
        self._counted, self._at = issued, moment

    def due(self, first: int, last: int) -> bool:
        """Whether a step whose world collectives are numbers `first` to `last` is
        sampled."""
        return last // self.every > (first - 1) // self.every


class RankRecorder:
    """One rank's recording: its pipe, how far it got, how it ends. A framework's recorder
    says what it waits in (`poll`), its memory and its pace."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.counts: dict[str, int] = {}
        """Collectives issued so far, per group."""
        self.issued: tuple[str, str, int] | None = None
        """The newest collective issued: (op, group, number)."""
        self._told: tuple[str, str, int] | None = None
        self.exit_code: int | None = None
        self.error: str | None = None
        self.pipe = Pipe()

    def attach(self, job: str, node: str, port: int = 0) -> None:
        """Start the watcher, say who this rank is, and tick."""
        self.pipe.start(
            jobId=job, nodeId=node, deviceRank=self.rank, worldSize=self.size, port=port
        )
        threading.Thread(target=self._tick, name="rankscope-recorder", daemon=True).start()
        atexit.register(self._bye)

    def entry(self, phase: str, event: str, detail: str | None = None, **attrs: Any) -> None:
        """A flight-recorder entry of this rank."""
        self.pipe.entry(phase, event, detail, **attrs)

    def memory(self) -> dict[str, Any]:
        """The rank's memory now: `active`, `peak`, `cache` in bytes, and the `source` of
        the figures (`mlx.core`, `torch.cuda`): the process's resident memory and its peak
        unless a framework says more."""
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak *= 1 if sys.platform == "darwin" else 1024  # bytes there, KiB here
        try:
            with open("/proc/self/statm") as statm:
                active = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            active = peak
        return {"source": "process", "active": active, "peak": peak, "cache": 0}

    def take_pace(self) -> dict[str, Any] | None:
        """The steps sampled since the last take (`StepPace`'s fields), reset; None when
        the framework's steps are not timed."""
        return None

    def poll(self, moment: float) -> None:
        """Each tick (`moment`: monotonic): say a wait that has lasted `WAIT_NOTE_S`, and
        its end."""

    def each_second(self, moment: float) -> None:
        """Once a second, before the memory sample."""

    def _tick(self) -> None:
        sampled = 0.0
        while self.pipe.open:
            time.sleep(TICK_S)
            moment = time.monotonic()
            if moment - sampled >= 1.0:
                sampled = moment
                self.each_second(moment)
                self.pipe.send("memory", at=now(), pace=self.take_pace(), **self.memory())
                self._note_steps()
            self.poll(moment)

    def _note_steps(self) -> None:
        """Say how far the rank got, once a second while it issues collectives: its lane
        shows it stepping (the entry's phase is a resting one: no stall rule reads it)."""
        issued = self.issued
        if issued is None or issued == self._told:
            return
        self._told = issued
        op, group, number = issued
        made = sum(self.counts.values())
        last = f"{op} #{number} (group {group})"
        self.entry("idle", "steps", f"{made} collectives, the last {last}", step=made, last=last)

    def note_wait(self, site: str, **attrs: Any) -> None:
        """Say the rank has waited a while in `site` (`all_sum #417 (group world)`, or an
        evaluation's `eval()`)."""
        self.entry("decode_barrier", "collective_wait", f"waiting in {site}", site=site, **attrs)

    def note_resumed(self, waited: float) -> None:
        """Say a wait that was said is over, after `waited` seconds."""
        self.entry("idle", "collective_resumed", waitedMs=round(waited * 1000, 1))

    def _bye(self) -> None:
        self.poll(time.monotonic())  # the collectives since the last tick counted
        made = sum(self.counts.values())
        self.entry("shutdown_cleanup", "program_exit", f"after {made} collectives", step=made)
        self.pipe.send("bye", code=self.exit_code, error=self.error)
        self.pipe.close()


def node_id() -> str:
    """The node this rank reports as: `rankscope record`'s, else the host's name."""
    return os.environ.get("RANKSCOPE_RECORD_NODE") or os.uname().nodename


def note_exits(recorder: Callable[[], RankRecorder | None]) -> None:
    """Have the rank's recorder (`recorder()`, None before the group starts) learn the
    status `sys.exit` is given and an exception that ends the program."""
    original_exit, original_hook = sys.exit, sys.excepthook

    def exit_noted(code: Any = 0) -> Any:
        if (noted := recorder()) is not None:
            noted.exit_code = code if isinstance(code, int) else (0 if code is None else 1)
        return original_exit(code)

    def hook_noted(kind: type[BaseException], value: BaseException, traceback: Any) -> None:
        if (noted := recorder()) is not None:
            noted.exit_code, noted.error = 1, f"{kind.__name__}: {value}"[:500]
        original_hook(kind, value, traceback)

    sys.exit = exit_noted
    sys.excepthook = hook_noted


@contextlib.contextmanager
def step(recorder: RankRecorder | None, name: str) -> Iterator[None]:
    """A named step of the program on its rank's timeline (nothing when not recording)."""
    if recorder is None:
        yield
        return
    recorder.entry("prefill_pipeline", "step_started", name[:64], name=name[:64])
    try:
        yield
    finally:
        recorder.entry("idle", "step_ended", name[:64], name=name[:64])
