"""Prometheus metrics of the gateway itself, and cluster gauges read from the aggregator."""

from __future__ import annotations

import bisect
from collections import defaultdict
from typing import Any

from shared.wire import ClusterTimeline, Diagnosis, RunnerHistory

__all__ = ["RequestMetrics", "cluster_lines"]

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")


class RequestMetrics:
    """Requests by route, method and status, and a latency histogram per route."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str, int], int] = defaultdict(int)
        self._buckets: dict[str, list[int]] = defaultdict(lambda: [0] * (len(_BUCKETS) + 1))
        self._sums: dict[str, float] = defaultdict(float)

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        """Count one request."""
        self._counts[(route, method, status)] += 1
        self._buckets[route][bisect.bisect_left(_BUCKETS, seconds)] += 1
        self._sums[route] += seconds

    def lines(self) -> list[str]:
        """Exposition lines."""
        out = [
            "# HELP rankscope_http_requests_total HTTP requests served.",
            "# TYPE rankscope_http_requests_total counter",
        ]
        for (route, method, status), count in sorted(self._counts.items()):
            out.append(
                f'rankscope_http_requests_total{{route="{_label(route)}",'
                f'method="{method}",status="{status}"}} {count}'
            )
        out += [
            "# HELP rankscope_http_request_seconds HTTP request latency.",
            "# TYPE rankscope_http_request_seconds histogram",
        ]
        for route, counts in sorted(self._buckets.items()):
            running = 0
            for bound, count in zip((*map(str, _BUCKETS), "+Inf"), counts, strict=True):
                running += count
                out.append(
                    f'rankscope_http_request_seconds_bucket{{route="{_label(route)}",'
                    f'le="{bound}"}} {running}'
                )
            out.append(
                f'rankscope_http_request_seconds_sum{{route="{_label(route)}"}} '
                f"{self._sums[route]:.6f}"
            )
            out.append(f'rankscope_http_request_seconds_count{{route="{_label(route)}"}} {running}')
        return out


def cluster_lines(
    health: dict[str, Any],
    timeline: ClusterTimeline,
    diagnosis: Diagnosis,
    history: list[RunnerHistory],
) -> list[str]:
    """Gauges of the cluster: runners by phase, findings by kind, MLX memory per runner,
    how much history each runner has, and the aggregator's own counters."""
    out = ["# TYPE rankscope_runners gauge"]
    phases: dict[tuple[str, str], int] = defaultdict(int)
    for runner in timeline.runners:
        phases[(runner.phase.value, runner.statusKind)] += 1
    for (phase, status), count in sorted(phases.items()):
        out.append(f'rankscope_runners{{phase="{phase}",status="{status}"}} {count}')
    out.append("# TYPE rankscope_findings gauge")
    kinds: dict[str, int] = defaultdict(int)
    for finding in diagnosis.findings:
        kinds[finding.kind.value] += 1
    for kind, count in sorted(kinds.items()):
        out.append(f'rankscope_findings{{kind="{kind}"}} {count}')
    out.append("# TYPE rankscope_mlx_memory_bytes gauge")
    for runner in timeline.runners:
        memory = runner.lastMlxMemory
        for kind, amount in (
            ("active", memory.active if memory else None),
            ("cache", memory.cache if memory else None),
            ("peak", memory.peak if memory else None),
        ):
            if amount is not None:
                out.append(
                    f'rankscope_mlx_memory_bytes{{runner="{_label(runner.runnerId)}",'
                    f'rank="{runner.deviceRank}",kind="{kind}"}} {amount.inBytes}'
                )
    out.append("# HELP rankscope_node_clock_offset_seconds How far a node's clock is ahead of "
               "the NATS server's (by its heartbeat; negative: behind).")  # fmt: skip
    out.append("# TYPE rankscope_node_clock_offset_seconds gauge")
    for node, offset in sorted(health.get("clockOffsets", {}).items()):
        out.append(f'rankscope_node_clock_offset_seconds{{node="{_label(node)}"}} {offset}')
    out += [
        "# TYPE rankscope_aggregator_entries gauge",
        f"rankscope_aggregator_entries {health.get('entries', 0)}",
        "# TYPE rankscope_aggregator_duplicates_total counter",
        f"rankscope_aggregator_duplicates_total {health.get('duplicates', 0)}",
        "# HELP rankscope_aggregator_slow_consumer_drops_total Messages the aggregator's "
        "NATS client dropped (always 0 unless something is wrong).",
        "# TYPE rankscope_aggregator_slow_consumer_drops_total counter",
        f"rankscope_aggregator_slow_consumer_drops_total {health.get('slowConsumerDrops', 0)}",
        "# HELP rankscope_aggregator_follower_restarts_total Stream consumers replaced after "
        "a gap, a stall or a lost consumer (nothing is lost: each resumes after its last "
        "handled message).",
        "# TYPE rankscope_aggregator_follower_restarts_total counter",
        f"rankscope_aggregator_follower_restarts_total {health.get('followerRestarts', 0)}",
        "# HELP rankscope_instance_queued_tasks Generations of an instance not yet over on "
        "every rank (waiting or running).",
        "# TYPE rankscope_instance_queued_tasks gauge",
    ]
    for instance, depth in sorted(health.get("queuedTasks", {}).items()):
        out.append(f'rankscope_instance_queued_tasks{{instance="{_label(instance)}"}} {depth}')
    out.append("# TYPE rankscope_aggregator_bad_messages_total counter")
    for kind, count in sorted(health.get("badMessages", {}).items()):
        out.append(f'rankscope_aggregator_bad_messages_total{{kind="{kind}"}} {count}')
    for name, field, help_text in (
        (
            "missing_seqs",
            "missingSeqs",
            "Seqs between a runner's oldest and newest received that never arrived.",
        ),
        (
            "first_seq",
            "firstSeq",
            "The oldest seq received of a runner when above 0: history before it was "
            "evicted by the stream's limits or never stored.",
        ),
        (
            "evicted_entries",
            "evictedEntries",
            "Entries of a runner dropped by the aggregator's retention.",
        ),
        (
            "unseen_seqs",
            "unseenSeqs",
            "Seqs JetStream acknowledged to a runner's agent newer than the newest the "
            "aggregator received, as of the last probe.",
        ),
    ):
        out += [
            f"# HELP rankscope_telemetry_{name} {help_text}",
            f"# TYPE rankscope_telemetry_{name} gauge",
        ]
        for held in history:
            if amount := getattr(held, field):  # a series appears when something is lacking
                out.append(
                    f'rankscope_telemetry_{name}{{runner="{_label(held.runnerId)}"}} {amount}'
                )
    return out
