"""A `ClusterTimeline` as Chrome trace-event JSON: one track per rank, one slice per
phase, memory as counter tracks. Opens in Perfetto and chrome://tracing."""

from __future__ import annotations

from typing import Any

from rankscope.shared.timestamps import micros
from rankscope.shared.wire import ClusterTimeline

__all__ = ["to_trace"]


def to_trace(timeline: ClusterTimeline) -> dict[str, Any]:
    """Trace events: a process per instance, a thread per rank, complete events per phase."""
    instance_of = {r.runnerId: r.instanceId for r in timeline.runners}
    processes = {i: n for n, i in enumerate(sorted(set(instance_of.values())), start=1)}
    events: list[dict[str, Any]] = []
    for instance, pid in processes.items():
        events.append(
            {
                "ph": "M",
                "name": "process_name",
                "pid": pid,
                "tid": 0,
                "args": {"name": f"instance {instance}"},
            }
        )
    for runner in timeline.runners:
        pid = processes[runner.instanceId]
        events.append(
            {
                "ph": "M",
                "name": "thread_name",
                "pid": pid,
                "tid": runner.deviceRank,
                "args": {"name": f"rank {runner.deviceRank} {runner.nodeId}"},
            }
        )
    by_runner: dict[str, list[Any]] = {}
    for entry in timeline.timeline:
        by_runner.setdefault(entry.runnerId, []).append(entry)
    for runner_id, entries in by_runner.items():
        pid = processes.get(instance_of.get(runner_id, ""), 0)
        for current, following in zip(entries, [*entries[1:], None], strict=True):
            start = micros(current.at)
            end = micros(following.at) if following else start + 1
            events.append(
                {
                    "ph": "X",
                    "name": current.phase.value,
                    "cat": current.event,
                    "pid": pid,
                    "tid": current.deviceRank,
                    "ts": start,
                    "dur": max(end - start, 1),
                    "args": {
                        "event": current.event,
                        "detail": current.detail,
                        "taskId": current.taskId,
                        "commandId": current.commandId,
                        **current.attrs,
                    },
                }
            )
            memory = current.mlxMemory
            if memory is not None and memory.active is not None:
                events.append(
                    {
                        "ph": "C",
                        "name": f"mlx memory rank {current.deviceRank}",
                        "pid": pid,
                        "ts": start,
                        "args": {
                            "active": memory.active.inBytes,
                            "cache": memory.cache.inBytes if memory.cache else 0,
                        },
                    }
                )
    return {"traceEvents": events, "displayTimeUnit": "ms"}
