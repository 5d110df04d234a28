"""Every NATS subject rankscope uses, built in one place.

Ids become subject tokens through `token`, which escapes what NATS reserves (`.`, `*`,
`>`, white space) reversibly as `=XX`, so two different ids never share a subject; the
same tokens are valid KV keys. The raw id always travels in the payload too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "AGGREGATOR_SERVICE",
    "MAX_TOKEN",
    "IdTooLongError",
    "Subjects",
    "TelemetryKind",
    "kv_key",
    "replies",
    "reply",
    "service_discovery",
    "token",
    "untoken",
]

TelemetryKind = Literal["phase", "memory", "status"]

_SAFE = re.compile(r"[A-Za-z0-9_\-]")
_ALL_SAFE = re.compile(r"[A-Za-z0-9_\-]+")
_PREFIX = re.compile(r"^[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*$")


MAX_TOKEN = 512
"""Longest escaped id: a subject of a few ids stays far below NATS's 4 KiB control line,
past which the server drops the connection of whoever sent it."""


class IdTooLongError(ValueError):
    """An id too long to name a subject or a KV key."""


def token(raw: str | int) -> str:
    """Make an id safe as one subject token and KV key (`=XX` escapes for the rest).

    Raises:
        ValueError: the id is empty.
        IdTooLongError: escaped, it is longer than `MAX_TOKEN`.
    """
    text = str(raw)
    if not text:
        raise ValueError("an empty id cannot name a subject")
    if len(text) > MAX_TOKEN:
        raise IdTooLongError(f"an id of {len(text):,} characters is over the limit of {MAX_TOKEN}")
    if _ALL_SAFE.fullmatch(text):
        return text
    escaped = "".join(
        c if _SAFE.match(c) else "".join(f"={b:02X}" for b in c.encode()) for c in text
    )
    if len(escaped) > MAX_TOKEN:
        raise IdTooLongError(
            f"an id of {len(text):,} characters escapes to {len(escaped):,} (`.`, `*`, `>`, "
            f"white space and non-ASCII take 3 per byte), over the limit of {MAX_TOKEN}"
        )
    return escaped


def untoken(escaped: str) -> str:
    """Invert `token`."""
    raw = bytearray()
    i = 0
    while i < len(escaped):
        if escaped[i] == "=":
            raw.append(int(escaped[i + 1 : i + 3], 16))
            i += 3
        else:
            raw += escaped[i].encode()
            i += 1
    return raw.decode()


@dataclass(frozen=True, slots=True)
class Subjects:
    """Subject builders under one prefix (default `rankscope`)."""

    prefix: str = "rankscope"

    def __post_init__(self) -> None:
        if not _PREFIX.match(self.prefix):
            raise ValueError(f"subject prefix {self.prefix!r} must be dot-separated plain tokens")

    def runner(self, node_id: str, instance_id: str, rank: int, kind: TelemetryKind) -> str:
        """Telemetry of one rank: `<prefix>.runner.<nodeId>.<instanceId>.<rank>.<kind>`."""
        return f"{self.prefix}.runner.{token(node_id)}.{token(instance_id)}.{rank}.{kind}"

    def runner_all(self) -> str:
        """Every rank's telemetry."""
        return f"{self.prefix}.runner.>"

    def runner_of_node(self, node_id: str) -> str:
        """The telemetry of every rank of one node."""
        return f"{self.prefix}.runner.{token(node_id)}.>"

    def runner_of_instance(self, instance_id: str | None) -> str:
        """The telemetry of every rank of one instance (None: of none, a subject that no
        message has, as `=` alone is no escaped id)."""
        return f"{self.prefix}.runner.*.{'=' if instance_id is None else token(instance_id)}.>"

    def memory_of_instance(self, instance_id: str | None) -> str:
        """The memory samples of every rank of one instance (None: of every instance)."""
        instance = "*" if instance_id is None else token(instance_id)
        return f"{self.prefix}.runner.*.{instance}.*.memory"

    def runner_status_all(self) -> str:
        """Every rank's status changes."""
        return f"{self.prefix}.runner.*.*.*.status"

    def placement(self, instance_id: str) -> str:
        """Placement decisions of one instance."""
        return f"{self.prefix}.placement.{token(instance_id)}"

    def placement_all(self) -> str:
        """Placement decisions of every instance."""
        return f"{self.prefix}.placement.>"

    def recorded(self, job_id: str) -> str:
        """Announcements and releases of one recorded job (`rankscope record`): placement
        events too, in a stream of their own, so no node's registrations can push the
        placed instances' events out of theirs."""
        return f"{self.prefix}.recorded.{token(job_id)}"

    def recorded_all(self) -> str:
        """Announcements and releases of every recorded job."""
        return f"{self.prefix}.recorded.>"

    def fr_load(self, job_id: str) -> str:
        """A PyTorch job's Flight Recorder dumps as `rankscope fr load` gave them (the
        newest load of each job is kept)."""
        return f"{self.prefix}.fr.{token(job_id)}"

    def fr_load_all(self) -> str:
        """Every job's loaded Flight Recorder dumps."""
        return f"{self.prefix}.fr.>"

    def tasks(self, instance_id: str) -> str:
        """Tasks (and cancels) asked of one instance."""
        return f"{self.prefix}.tasks.{token(instance_id)}"

    def task_status(self, instance_id: str, node_id: str) -> str:
        """Status of an instance's tasks as one node's ranks report it:
        `<prefix>.tasks.<instanceId>.status.<nodeId>`."""
        return f"{self.task_statuses(instance_id)[:-1]}{token(node_id)}"

    def task_statuses(self, instance_id: str) -> str:
        """Status of an instance's tasks from every node."""
        return f"{self.tasks(instance_id)}.status.*"

    def tasks_of_instance(self, instance_id: str | None) -> tuple[str, str]:
        """Tasks asked of one instance, and their status (None: of none)."""
        tasks = f"{self.prefix}.tasks.=" if instance_id is None else self.tasks(instance_id)
        return tasks, f"{tasks}.>"

    def tasks_all(self) -> str:
        """Tasks and task status of every instance."""
        return f"{self.prefix}.tasks.>"

    def tasks_of_any(self) -> str:
        """Tasks asked of any instance (not their status)."""
        return f"{self.prefix}.tasks.*"

    def task_status_of_node(self, node_id: str) -> str:
        """Status of every instance's tasks as one node's ranks report it."""
        return f"{self.prefix}.tasks.*.status.{token(node_id)}"

    def task_status_all(self) -> str:
        """Status of every instance's tasks from every node."""
        return f"{self.prefix}.tasks.*.status.*"

    def task_input(self, node_id: str, instance_id: str, task_id: str) -> str:
        """A task whole, prompt included, for the ranks of one node:
        `<prefix>.input.<nodeId>.<instanceId>.<taskId>`; the task on `tasks` carries none,
        so a node reads the prompts of its own instances alone."""
        return f"{self.prefix}.input.{token(node_id)}.{token(instance_id)}.{token(task_id)}"

    def task_inputs_of_node(self, node_id: str) -> str:
        """Whole tasks for the ranks of one node."""
        return f"{self.prefix}.input.{token(node_id)}.>"

    def task_inputs_all(self) -> str:
        """Whole tasks for every node."""
        return f"{self.prefix}.input.>"

    def record_register(self, node_id: str) -> str:
        """Where a recorded rank on `node_id` asks to be announced (request/reply): a
        node's credentials register ranks on that node alone."""
        return f"{self.prefix}.record.register.{token(node_id)}"

    def record_register_all(self) -> str:
        """Registrations of recorded ranks on every node."""
        return f"{self.prefix}.record.register.*"

    def record_evidence(self, node_id: str, runner_id: str) -> str:
        """Where a recorded rank's watcher answers for its evidence (stacks, process
        state, memory): no agent supervises that rank."""
        return f"{self.prefix}.record.evidence.{token(node_id)}.{token(runner_id)}"

    def record_evidence_of_node(self, node_id: str) -> str:
        """Evidence requests of the recorded ranks on one node."""
        return f"{self.prefix}.record.evidence.{token(node_id)}.*"

    def record_evidence_all(self) -> str:
        """Evidence requests of every recorded rank."""
        return f"{self.prefix}.record.evidence.>"

    def ranktable(self, job_id: str) -> str:
        """The rank table of one job (= instance)."""
        return f"{self.prefix}.ranktable.{token(job_id)}"

    def ranktable_all(self) -> str:
        """Rank tables of every job."""
        return f"{self.prefix}.ranktable.>"

    def diagnosis(self, instance_id: str) -> str:
        """Findings of one instance as they appear and clear; `=` (which no id escapes to)
        for those of the whole installation (`instance_id` empty), such as a NATS outage."""
        return f"{self.prefix}.diagnosis.{token(instance_id) if instance_id else '='}"

    def diagnosis_all(self) -> str:
        """Findings of every instance."""
        return f"{self.prefix}.diagnosis.>"

    def node_diagnostics(self, node_id: str) -> str:
        """Live request to one agent for its supervisors' state."""
        return f"{self.prefix}.node.{token(node_id)}.diagnostics"

    def node_evidence(self, node_id: str) -> str:
        """Request to one agent to capture its runners' stacks and memory now."""
        return f"{self.prefix}.node.{token(node_id)}.evidence"

    def node_model(self, node_id: str) -> str:
        """Request to one agent to read a model's shape (layers, weight bytes) on its node."""
        return f"{self.prefix}.node.{token(node_id)}.model"

    def node_request_all(self, kind: Literal["diagnostics", "evidence", "model"]) -> str:
        """Requests of one kind to every agent."""
        return f"{self.prefix}.node.*.{kind}"

    def query(self, view: str, index: int = 0, count: int = 1) -> str:
        """Request for one view to the aggregators of partition `index` of `count`:
        `<prefix>.query.<view>`, and `<prefix>.query.<view>.<index>-of-<count>` when the
        instances are partitioned."""
        subject = f"{self.prefix}.query.{token(view)}"
        return subject if count == 1 else f"{subject}.{index}-of-{count}"

    def query_all(self) -> str:
        """Requests to the aggregators for any view, of any partition."""
        return f"{self.prefix}.query.>"

    def instance_token(self, subject: str) -> str | None:
        """The instance token of a telemetry, placement (a recorded job's too), loaded
        dump or task subject; None for others."""
        head = f"{self.prefix}."
        rest = subject[len(head) :].split(".") if subject.startswith(head) else []
        if len(rest) >= 4 and rest[0] == "runner":
            return rest[2]
        if len(rest) >= 2 and rest[0] in ("placement", "recorded", "fr", "tasks"):
            return rest[1]
        return None

    def output(self, command_id: str, node_id: str) -> str:
        """Generated token chunks of one command (core NATS), from the node of its
        instance's last rank: `<prefix>.output.<commandId>.<nodeId>`."""
        return f"{self.prefix}.output.{token(command_id)}.{token(node_id)}"

    def output_of_node(self, node_id: str) -> str:
        """Generated chunks of every command whose last rank is on one node."""
        return f"{self.prefix}.output.*.{token(node_id)}"

    def output_all(self) -> str:
        """Generated chunks of every command."""
        return f"{self.prefix}.output.>"

    def everything(self) -> str:
        """Every subject of this installation."""
        return f"{self.prefix}.>"

    def deadletter(self, service: str) -> str:
        """Copies of messages `service` could not apply (each role writes only its own)."""
        return f"{self.prefix}.deadletter.{token(service)}"

    def deadletter_all(self) -> str:
        """Every service's dead letters."""
        return f"{self.prefix}.deadletter.>"

    def canary(self, service: str) -> str:
        """Where `service` writes to learn whether JetStream stores messages now."""
        return f"{self.prefix}.canary.{token(service)}"

    def canary_all(self) -> str:
        """Every service's canary."""
        return f"{self.prefix}.canary.*"


AGGREGATOR_SERVICE = "rankscope-aggregator"
"""The aggregator's name as a NATS micro service (`nats micro info rankscope-aggregator`)."""


def service_discovery(name: str | None = None) -> tuple[str, ...]:
    """The NATS micro discovery requests (`$SRV.PING`, `INFO`, `STATS`) a service named
    `name` answers: to every service, to its name, to one instance; every one of them
    when no name is given."""
    if name is None:
        return ("$SRV.>",)
    return ("$SRV.*", f"$SRV.*.{name}", f"$SRV.*.{name}.*")


def reply(inbox: str, token: str) -> str:
    """The reply subject `token` under `inbox` (one of a client's own inboxes)."""
    return f"{inbox}.{token}"


def replies(inbox: str) -> str:
    """Every reply subject under `inbox`."""
    return f"{inbox}.*"


def kv_key(bucket: str, key: str = ">") -> str:
    """The subject of a key of KV `bucket` (every key: `>`)."""
    return f"$KV.{bucket}.{key}"
