"""What a recorded rank and the rest of rankscope agree on (`rankscope record`): the
variables `record` hands each rank's hook, the files of the exits folder, and when a
rank says it waits. Standard library only: the hook inside each rank imports it."""

from __future__ import annotations

__all__ = ["REAPER", "STOP_FILE", "WAIT_NOTE_S", "Handoff", "rank_marker", "reaper_marker"]

WAIT_NOTE_S = 1.0
"""How long an evaluation waits on its collectives before the rank says so: the aggregator
counts that second into the wait."""
STOP_FILE = "stop-asked"
"""In the exits folder once the user asked the job to stop (`rankscope record` got Ctrl-C
or an ending signal): the signal's name, for the watchers to tell a stop from a fault."""


class Handoff:
    """The environment `rankscope record` (or `start()` inside a program) gives a rank."""

    JOB = "RANKSCOPE_RECORD_JOB"
    """The job's id (else the ranks agree on one)."""
    NODE = "RANKSCOPE_RECORD_NODE"
    """The node the rank reports as."""
    HOST = "RANKSCOPE_RECORD_HOST"
    """The address the rank is reached at."""
    EXITS = "RANKSCOPE_RECORD_EXITS"
    """The exits folder: a marker per rank (`rank_marker`) and per process that writes how
    the ranks it started ended (`reaper_marker`), and `STOP_FILE`."""
    PYTHON = "RANKSCOPE_RECORD_PYTHON"
    """rankscope's interpreter, which runs each rank's watcher."""
    LOG = "RANKSCOPE_RECORD_LOG"
    """Where the watchers log, if anywhere."""


REAPER = ".reaps"
"""The ending of a `reaper_marker`."""


def rank_marker(pid: int) -> str:
    """The exits folder's file that says the process `pid` is a recorded rank."""
    return f"{pid}.rank"


def reaper_marker(pid: int) -> str:
    """The exits folder's file that says the process `pid` writes how each recorded rank it
    started ended, once it reaps it (`rankscope record`, a Python launcher under it)."""
    return f"{pid}{REAPER}"
