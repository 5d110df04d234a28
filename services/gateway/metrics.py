"""Prometheus metrics of the gateway itself, and cluster gauges read from the aggregator,
on `prometheus-client` (registry, metric families, exposition)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from rankscope.shared.wire import AggregatorHealth, ClusterTimeline, Diagnosis, RunnerHistory

__all__ = ["RequestMetrics", "cluster_families", "exposition", "gauge"]

prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]  # no `_created` series

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class RequestMetrics:
    """Requests by route, method and status, and a latency histogram per route."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._requests = Counter(
            "rankscope_http_requests",
            "HTTP requests served.",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self._latency = Histogram(
            "rankscope_http_request_seconds",
            "HTTP request latency.",
            ["route"],
            buckets=_BUCKETS,
            registry=self.registry,
        )

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        """Count one request."""
        self._requests.labels(route, method, str(status)).inc()
        self._latency.labels(route).observe(seconds)


class _Families(Collector):
    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        yield from self._families


def exposition(requests: RequestMetrics, families: Iterable[Metric]) -> bytes:
    """The text exposition of the gateway's own metrics and `families`."""
    scraped = CollectorRegistry(auto_describe=False)
    scraped.register(_Families(families))
    return generate_latest(requests.registry) + generate_latest(scraped)


def gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    """A gauge of one unlabelled value."""
    return GaugeMetricFamily(name, help_text, value=value)


def _counter(name: str, help_text: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, help_text, value=value)


def cluster_families(
    health: AggregatorHealth,
    timeline: ClusterTimeline,
    diagnosis: Diagnosis,
    history: list[RunnerHistory],
) -> list[Metric]:
    """Gauges of the cluster: runners by phase, findings by kind, MLX memory per runner,
    how much history each runner has, and the aggregator's own counters."""
    runners = GaugeMetricFamily(
        "rankscope_runners", "Runners by phase and status.", labels=["phase", "status"]
    )
    phases: dict[tuple[str, str], int] = defaultdict(int)
    for runner in timeline.runners:
        phases[(runner.phase.value, runner.statusKind)] += 1
    for (phase, status), count in sorted(phases.items()):
        runners.add_metric([phase, status], count)
    findings = GaugeMetricFamily("rankscope_findings", "Open findings by kind.", labels=["kind"])
    kinds: dict[str, int] = defaultdict(int)
    for finding in diagnosis.findings:
        kinds[finding.kind.value] += 1
    for kind, count in sorted(kinds.items()):
        findings.add_metric([kind], count)
    memory = GaugeMetricFamily(
        "rankscope_mlx_memory_bytes",
        "MLX memory of a runner by kind, as last sampled.",
        labels=["runner", "rank", "kind"],
    )
    for runner in timeline.runners:
        sampled = runner.lastMlxMemory
        for kind, amount in (
            ("active", sampled.active if sampled else None),
            ("cache", sampled.cache if sampled else None),
            ("peak", sampled.peak if sampled else None),
        ):
            if amount is not None:
                memory.add_metric([runner.runnerId, str(runner.deviceRank), kind], amount.inBytes)
    clocks = GaugeMetricFamily(
        "rankscope_node_clock_offset_seconds",
        "How far a node's clock is ahead of the NATS server's (by its heartbeat; "
        "negative: behind).",
        labels=["node"],
    )
    for node, offset in sorted(health.clockOffsets.items()):
        clocks.add_metric([node], offset)
    queued = GaugeMetricFamily(
        "rankscope_instance_queued_tasks",
        "Generations of an instance not yet over on every rank (waiting or running).",
        labels=["instance"],
    )
    for instance, depth in sorted(health.queuedTasks.items()):
        queued.add_metric([instance], depth)
    bad = CounterMetricFamily(
        "rankscope_aggregator_bad_messages",
        "Messages the aggregator could not apply, dead-lettered, by kind.",
        labels=["kind"],
    )
    for kind, count in sorted(health.badMessages.items()):
        bad.add_metric([kind], count)
    trimmed = CounterMetricFamily(
        "rankscope_aggregator_trimmed_bytes",
        "Bytes of a node's history the aggregator gave up to stay within "
        "RANKSCOPE_RETENTION_BYTES (the node holding the most gives up its oldest first).",
        labels=["node"],
    )
    for node, given_up in sorted(health.trimmedBytes.items()):
        trimmed.add_metric([node], given_up)
    return [
        runners,
        findings,
        memory,
        clocks,
        gauge("rankscope_aggregator_entries", "Entries the aggregator holds.",
              health.entries),
        gauge("rankscope_aggregator_held_bytes",
              "Bytes of entries the aggregator holds (bounded by RANKSCOPE_RETENTION_BYTES).",
              health.heldBytes),
        trimmed,
        _counter("rankscope_aggregator_duplicates", "Telemetry received twice and ignored.",
                 health.duplicates),
        _counter("rankscope_aggregator_slow_consumer_drops",
                 "Messages the aggregator's NATS client dropped (always 0 unless something "
                 "is wrong).", health.slowConsumerDrops),
        _counter("rankscope_aggregator_follower_restarts",
                 "Stream consumers replaced after a gap, a stall or a lost consumer (nothing "
                 "is lost: each resumes after its last handled message).",
                 health.followerRestarts),
        queued,
        bad,
        *_telemetry(history),
        *_pace(history),
        *_waited_on(history),
    ]  # fmt: skip


def _telemetry(history: list[RunnerHistory]) -> Iterator[Metric]:
    """Per-runner gaps in its telemetry; a series appears when something is lacking."""
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
        family = GaugeMetricFamily(f"rankscope_telemetry_{name}", help_text, labels=["runner"])
        for held in history:
            if amount := getattr(held, field):
                family.add_metric([held.runnerId], amount)
        yield family


def _pace(history: list[RunnerHistory]) -> Iterator[Metric]:
    """Per rank, its sampled steps by the seconds they took working and waiting."""
    labels = ["runner", "instance", "rank"]
    work = HistogramMetricFamily(
        "rankscope_step_work_seconds",
        "Seconds a rank's sampled decode step took computing its own part (a rank slower "
        "than its peers works longer).",
        labels=labels,
    )
    wait = HistogramMetricFamily(
        "rankscope_step_wait_seconds",
        "Seconds a rank's sampled decode step waited for its peers (the victims of a slow "
        "rank wait longer).",
        labels=labels,
    )
    for held in history:
        pace = held.pace
        if pace is None:
            continue
        values = [held.runnerId, held.instanceId, str(held.deviceRank)]
        bounds = [f"{b:g}" for b in pace.bounds] + ["+Inf"]
        for family, counts, total in (
            (work, pace.workCounts, pace.workSeconds),
            (wait, pace.waitCounts, pace.waitSeconds),
        ):
            family.add_metric(values, list(zip(bounds, counts, strict=True)), total)
    yield work
    yield wait


def _waited_on(history: list[RunnerHistory]) -> Iterator[Metric]:
    """Per rank of a job whose ranks sample the same steps: the share of the job's time
    spent waiting for it, and how often it arrived last."""
    labels = ["runner", "instance", "rank"]
    waited = GaugeMetricFamily(
        "rankscope_rank_waited_on_ratio",
        "Share of its job's step time spent waiting for the rank (the last to arrive in its "
        "collectives), over the newest steps every rank sampled; the straggler's stands out.",
        labels=labels,
    )
    last = GaugeMetricFamily(
        "rankscope_rank_last_arrival_ratio",
        "Share of those steps on which the rank arrived last (chance: 1 / ranks).",
        labels=labels,
    )
    for held in history:
        values = [held.runnerId, held.instanceId, str(held.deviceRank)]
        if held.waitedOn is not None:
            waited.add_metric(values, held.waitedOn)
        if held.lastArrival is not None:
            last.add_metric(values, held.lastArrival)
    yield waited
    yield last
