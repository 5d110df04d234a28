"""`compose.yaml` is valid and runs NATS with JetStream on a volume."""

from __future__ import annotations

from pathlib import Path

import yaml

COMPOSE = Path(__file__).parent.parent / "compose.yaml"


def test_nats_service_has_jetstream_on_a_volume() -> None:
    document = yaml.safe_load(COMPOSE.read_text())
    nats = document["services"]["nats"]
    assert "--jetstream" in nats["command"]
    store = nats["command"][nats["command"].index("--store_dir") + 1]
    assert any(volume.endswith(f":{store}") for volume in nats["volumes"])
    assert "4222:4222" in nats["ports"]
    assert set(document["volumes"]) == {v.split(":")[0] for v in nats["volumes"]}
