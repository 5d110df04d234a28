"""Run rankscope services as child processes: restart a crashed one (with backoff) and
say so, stop them all on the way out (SIGTERM, then SIGKILL); likewise keep the embedded
NATS server running."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from rankscope.services.stack.store_watch import StoreWatch
from rankscope.services.stack.terminal import Terminal
from rankscope.shared.nats_server import EmbeddedNats, NatsServerError
from rankscope.shared.processes import LIFELINE_ENV, die_with_parent, signal_name

__all__ = ["ChildSpec", "Supervisor", "keep_nats"]

log = logging.getLogger("rankscope.up")

_BACKOFF_START_S = 0.5
_BACKOFF_MAX_S = 30.0
_STABLE_AFTER_S = 60.0
_STEADY_AFTER_S = 10.0
"""How long a restarted child must run before it counts as steady again."""
_GRACE_S = 8.0  # within `up`'s promise: everything stopped in 10 s
_NATS_CHECK_S = 0.5


@dataclass(frozen=True, slots=True)
class ChildSpec:
    """One service: a `rankscope` subcommand with its arguments and extra environment."""

    name: str
    args: Sequence[str]
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass
class _Child:
    spec: ChildSpec
    process: asyncio.subprocess.Process | None = None
    started: float = 0.0
    restarts: int = 0
    running: bool = False


class Supervisor:
    """Keeps every child running until `stop`; `pids` shows who runs now."""

    def __init__(
        self,
        children: Sequence[ChildSpec],
        *,
        env: Mapping[str, str],
        terminal: Terminal | None = None,
    ) -> None:
        self._children = [_Child(spec) for spec in children]
        self._env = {**os.environ, **env, LIFELINE_ENV: str(os.getpid())}
        self._terminal = terminal if terminal is not None and terminal.interactive else None
        """On a terminal, the children's output goes through it, line by line."""
        self._relays: set[asyncio.Task[None]] = set()

    @property
    def pids(self) -> dict[str, int]:
        """Process ids of the running children by name."""
        return {c.spec.name: c.process.pid for c in self._children if c.process is not None}

    def unsteady(self) -> list[str]:
        """The children down now, or restarted less than `_STEADY_AFTER_S` ago."""
        moment = time.monotonic()
        return [
            c.spec.name
            for c in self._children
            if not c.running or (c.restarts and moment - c.started < _STEADY_AFTER_S)
        ]

    async def _start(self, child: _Child) -> asyncio.subprocess.Process:
        child.started = time.monotonic()
        child.running = True
        child.process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "rankscope.services.cli",
            *child.spec.args,
            env={**self._env, **child.spec.env},
            stdin=asyncio.subprocess.DEVNULL,
            stdout=None if self._terminal is None else asyncio.subprocess.PIPE,
            stderr=None if self._terminal is None else asyncio.subprocess.STDOUT,
            preexec_fn=die_with_parent(),
            start_new_session=True,  # Ctrl-C reaches `up` alone, which stops them in order
        )
        if self._terminal is not None and child.process.stdout is not None:
            relay = asyncio.create_task(self._terminal.relay(child.process.stdout))
            self._relays.add(relay)
            relay.add_done_callback(self._relays.discard)
        return child.process

    async def start(self) -> None:
        """Start every child once."""
        for child in self._children:
            await self._start(child)

    async def _keep(self, child: _Child, stop: asyncio.Event) -> None:
        backoff = _BACKOFF_START_S
        process = child.process or await self._start(child)
        while True:
            code = await process.wait()
            child.running = False
            if stop.is_set():
                return
            if time.monotonic() - child.started > _STABLE_AFTER_S:
                backoff = _BACKOFF_START_S
            child.restarts += 1
            cause = signal_name(code) or f"exit code {code}"
            log.error(
                "%s stopped (%s); restart %d in %.1fs",
                child.spec.name,
                cause,
                child.restarts,
                backoff,
            )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), backoff)
            if stop.is_set():
                return
            backoff = min(backoff * 2, _BACKOFF_MAX_S)
            process = await self._start(child)

    async def run(self, stop: asyncio.Event) -> None:
        """Keep every child running until `stop` is set, then stop them all."""
        keepers = [asyncio.create_task(self._keep(child, stop)) for child in self._children]
        await stop.wait()
        await self.terminate()
        await asyncio.gather(*keepers)

    async def terminate(self) -> None:
        """SIGTERM every child, then SIGKILL what is left after a grace period, and
        whatever is left in their process groups (each child leads its own)."""
        running = [c.process for c in self._children if c.process and c.process.returncode is None]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        waits = [asyncio.create_task(process.wait()) for process in running]
        if waits:
            _, late = await asyncio.wait(waits, timeout=_GRACE_S)
            for process in running:
                if process.returncode is None:
                    log.warning("killing a child that ignored SIGTERM", extra={"pid": process.pid})
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
            await asyncio.gather(*late)
        for child in self._children:  # grandchildren (runners) left in a child's group
            if child.process is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(child.process.pid, signal.SIGKILL)


async def keep_nats(server: EmbeddedNats, stop: asyncio.Event) -> None:
    """Start `server` again whenever it ends before `stop`, or its store broke on a full
    disk that has room again (JetStream does not recover from a failed write by itself),
    on the same store and port, so that the services reconnect to it and find their
    streams where they were (from the main thread: the server is tied to the thread that
    starts it)."""
    backoff, store, told = _BACKOFF_START_S, StoreWatch(server.log_path, server.store_dir), False
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), _NATS_CHECK_S)
        if stop.is_set():
            return
        code = server.exit_code()
        if server.pid is not None and code is None:
            if (broken := store.look()) is None:
                continue
            if not store.has_room():
                if not told:
                    told = True
                    log.error("JetStream cannot store (%s); nats-server restarts once the "
                              "disk of %s has room again", broken, server.store_dir)  # fmt: skip
                continue
            log.error("the disk of %s has room again; restarting nats-server, whose store "
                      "broke (%s)", server.store_dir, broken)  # fmt: skip
        if code is not None:
            cause = signal_name(code) or f"exit code {code}"
            log.error("nats-server stopped (%s); starting it again on %s", cause, server.store_dir)
        try:
            server.restart()
            store.mended()
            told = False
        except NatsServerError as exc:
            log.error("nats-server did not start again (%s); next try in %.1fs", exc, backoff)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), backoff)
            backoff = min(backoff * 2, _BACKOFF_MAX_S)
        else:
            log.info("nats-server running again on %s", server.url)
            backoff = _BACKOFF_START_S
