"""rankscope installs under its own name: `shared/` and `services/` as `rankscope.shared`
and `rankscope.services`, every package listed, and a wheel built from the repository runs
the demo from another directory with its web page, NATS config and gRPC code."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import tomllib
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_every_package_of_shared_and_services_is_installed_under_rankscope() -> None:
    listed = set(
        tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {
        "rankscope." + ".".join(init.parent.relative_to(REPO).parts)
        for room in ("shared", "services")
        for init in (REPO / room).rglob("__init__.py")
    }
    # directories of data only are packages of their own too, or setuptools warns
    found |= set(data["package-data"]) - {"rankscope.shared", "rankscope.services"}
    assert found == listed, f"pyproject.toml lists {sorted(listed)}, the tree has {sorted(found)}"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.mark.slow
def test_a_wheel_installed_in_a_fresh_venv_runs_the_demo_from_another_directory(
    tmp_path: Path,
) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(wheels), str(REPO)],
        check=True, capture_output=True,
    )  # fmt: skip
    (wheel,) = wheels.glob("rankscope-*.whl")
    fresh = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", str(fresh)], check=True)
    site = Path(sysconfig.get_paths(vars={"base": str(fresh)})["purelib"])
    here = sysconfig.get_paths()["purelib"]  # the dependencies, not rankscope's own hook
    (site / "dependencies.pth").write_text(here + "\n")
    subprocess.run(
        [fresh / "bin" / "python", "-m", "pip", "install", "--no-deps", "-q", str(wheel)],
        check=True, capture_output=True,
    )  # fmt: skip
    assert not (site / "shared").exists()  # nothing at the top of site-packages
    assert not (site / "services").exists()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    port = _free_port()
    up = subprocess.Popen(
        [fresh / "bin" / "rankscope", "up", "--demo", "--nats-auth", "--nats-port", "0",
         "--gateway-port", str(port), "--grpc-port", str(_free_port()),
         "--ring-port-base", str(_free_port()), "--data-dir", str(elsewhere / "data")],
        cwd=elsewhere, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={  # the dependencies' programs (nats-server) where a user's PATH has them
            **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
            "PATH": f"{fresh / 'bin'}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}"
            + os.environ.get("PATH", ""),
        },
    )  # fmt: skip
    try:
        assert up.stdout is not None
        shown: list[str] = []
        for line in up.stdout:
            shown.append(line)
            if line.startswith("demo ready"):
                break
        assert up.poll() is None, "".join(shown)
        base = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(f"{base}/", timeout=30) as page:
            assert b"rankscope" in page.read()  # the web page's assets came with the wheel
        with urllib.request.urlopen(f"{base}/v1/cluster/timeline?limit=1", timeout=30) as reply:
            runners = json.loads(reply.read())["runners"]
        assert sorted(r["deviceRank"] for r in runners) == [0, 1]  # the demo's two ranks
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=30) == 0
        if up.stdout is not None:
            up.stdout.close()
