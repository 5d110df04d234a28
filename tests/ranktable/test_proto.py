"""The committed gRPC modules are what `make proto` makes of the committed .proto (its
import of the messages module named as installed, under `rankscope`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).parent.parent.parent
PROTO = "services/ranktable/grpcapi/config.proto"


def test_generated_modules_are_current(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I.",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            PROTO,
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    for name in ("config_pb2.py", "config_pb2.pyi", "config_pb2_grpc.py"):
        fresh = (tmp_path / "services/ranktable/grpcapi" / name).read_text()
        # as `make proto` leaves it: the package is installed as rankscope.services
        fresh = fresh.replace("from services.", "from rankscope.services.")
        committed = (REPO / "services/ranktable/grpcapi" / name).read_text()
        assert fresh == committed, f"{name} is stale: run `make proto`"
