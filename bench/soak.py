"""A healthy soak: the demo (its chats every 5 s) and a recorded 4-rank data-parallel job
side by side on `rankscope up --demo`, the diagnosis sampled every second for the whole
time. Target: no finding at all (`tests/test_slow_rank.py` runs a minute of it in CI).

    .venv/bin/python bench/soak.py [--minutes 30]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.stack_up import free_ports, running_up  # noqa: E402
from tests.test_slow_rank import Gateway, recorded  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp())
    env = {"RANKSCOPE_LOG_LEVEL": "error"}
    ring = ("--ring-port-base", str(free_ports(2)))
    with running_up(work / ".rankscope", "--demo", *ring, env=env) as (_, shown):
        gateway = Gateway(shown["web"].split()[0].rstrip("/"), shown["NATS"].split()[0])
        seen: collections.Counter[str] = collections.Counter()
        samples = 0
        with recorded(gateway, "soak", work / "train.py"):
            started = time.monotonic()
            while time.monotonic() - started < args.minutes * 60:
                with contextlib.suppress(OSError):
                    for finding in gateway.get("/v1/cluster/diagnosis")["findings"]:
                        seen[f"{finding['instanceId']} {finding['kind']}"] += 1
                    samples += 1
                time.sleep(1)
            history = gateway.get("/v1/cluster/diagnosis/history")["findings"]
    print(f"{args.minutes:g} minutes, demo chats every 5 s and a recorded 4-rank job")
    print(f"diagnosis samples: {samples}, with a finding: {sum(seen.values())}")
    for what, count in seen.most_common():
        print(f"  {count:5d} samples: {what}")
    print(f"incidents in the history: {len(history)}")
    for incident in history:
        print(f"  {incident['since']} .. {incident['clearedAt']}: {incident['summary'][:160]}")
    print(f"kept: {work / '.rankscope'} (bench/straggler_replay.py judges its job again)")


if __name__ == "__main__":
    main()
