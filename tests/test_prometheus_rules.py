"""The Prometheus rules and scrape config shipped in `deploy/prometheus/` are what
Prometheus itself accepts, and the rules fire when they should (`promtool test rules`)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

DEPLOY = Path(__file__).parent.parent / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool")

pytestmark = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed here (Debian's prometheus)"
)


@pytest.mark.parametrize(
    "command",
    [
        ["check", "rules", "rankscope.rules.yml"],
        ["check", "config", "prometheus.yml"],
        ["test", "rules", "rankscope.rules.test.yml"],
    ],
    ids=["rules", "config", "rule-tests"],
)
def test_promtool_accepts_it(command: list[str]) -> None:
    assert PROMTOOL is not None
    done = subprocess.run(
        [PROMTOOL, *command], cwd=DEPLOY, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_metric_a_rule_reads_is_one_the_gateway_exports() -> None:
    rules = (DEPLOY / "rankscope.rules.yml").read_text()
    exported = "".join(
        path.read_text() for path in (Path(__file__).parent.parent / "services").rglob("*.py")
    )
    for metric in ("rankscope_nats_reachable", "rankscope_aggregator_up",
                   "rankscope_aggregator_partitions_missing", "rankscope_findings",
                   "rankscope_node_clock_offset_seconds", "rankscope_aggregator_bad_messages",
                   "rankscope_aggregator_slow_consumer_drops",
                   "rankscope_gateway_slow_consumer_drops", "rankscope_telemetry_"):  # fmt: skip
        assert metric in rules
        assert f'"{metric}' in exported, metric
