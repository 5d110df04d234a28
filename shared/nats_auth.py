"""NATS users, one per role, each allowed only what that role does.

- an agent (one user per node, `agent-<nodeId>`) publishes telemetry, task status and
  output only under its own node's subjects, and its own heartbeat key; it answers probes
  of its own node, reads the placement and task streams (its assignments; tasks there
  carry no prompt), its own node's copy of each task, whole, and its own node's last
  telemetry, and reports messages it could not apply (dead letters);
- the aggregator reads telemetry, placements, tasks and nodes, and writes only findings
  and dead letters; it answers queries and probes agents;
- the rank-table service reads specs, nodes, placements and runner status, and writes
  placements, rank tables, spec status and dead letters;
- the gateway asks queries, writes specs and tasks, and reads rank tables, output, task
  status and the buckets; it can never publish runner telemetry, task status or output;
- the operator (a person, with the `nats` CLI) reads every stream and bucket, the dead
  letters among them, and watches every subject, but writes nothing: it deletes no
  consumer, answers no request it sees and joins no queue group (it would take requests
  from the service that answers them).

Only the agents and the aggregator may answer requests (probes, queries), each only those
of the subjects it may subscribe to. Only the aggregator and the rank-table service may
create or update streams; nobody may delete or purge them. Each user receives replies only
under its own inbox prefix (`_INBOX_<user>`), so no role can read another's answers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rankscope.shared.jetstream import Layout
from rankscope.shared.subjects import AGGREGATOR_SERVICE, kv_key, service_discovery, token

__all__ = [
    "OPERATOR",
    "ROLES",
    "Permissions",
    "agent_user",
    "inbox_prefix",
    "password_variable",
    "render",
]

ROLES = ("aggregator", "ranktable", "gateway")
OPERATOR = "operator"
"""The user people read streams with (the `nats` CLI): every stream, no write."""
"""The service roles; every agent is a user of its own (`agent_user`)."""


def agent_user(node_id: str) -> str:
    """The NATS user of the agent on `node_id`."""
    return f"agent-{token(node_id)}"


def inbox_prefix(user: str) -> str:
    """Where `user` receives replies and push deliveries."""
    return f"_INBOX_{token(user)}"


def password_variable(user: str) -> str:
    """The environment variable the server config reads `user`'s password from."""
    return "RANKSCOPE_NATS_PASSWORD_" + "".join(c if c.isalnum() else "_" for c in user).upper()


@dataclass(frozen=True, slots=True)
class Permissions:
    """Subjects one user may publish to and subscribe to."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    responds: bool = False
    """Whether it may answer requests it receives (only the roles that serve them)."""
    deny_subscribe: tuple[str, ...] = ()
    """Subscriptions refused even where `subscribe` allows them (`subject queue` refuses
    joining a queue group there)."""


class _Api:
    """JetStream API subjects for the streams of one layout."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.all_streams = [s.name for s in layout.streams] + [
            b.stream_name for b in layout.buckets
        ]

    def stream(self, name: str) -> str:
        for stream in self.layout.streams:
            if stream.name.endswith("_" + name):
                return stream.name
        raise KeyError(name)

    def everyone(self) -> list[str]:
        """Checking that the streams exist (every service does at start-up), and their
        state (the subjects stored among it)."""
        return [*self.names(), "$JS.API.STREAM.INFO.*"]

    @staticmethod
    def names() -> list[str]:
        """Checking that the streams exist by name alone."""
        return ["$JS.API.INFO", "$JS.API.STREAM.NAMES"]

    def own(self) -> list[str]:
        """Creating and updating rankscope's streams and buckets."""
        return [f"$JS.API.STREAM.{verb}.{name}" for verb in ("CREATE", "UPDATE")
                for name in self.all_streams]  # fmt: skip

    def read(self, *streams: str, delete: bool = True) -> list[str]:
        """Pull followers, ordered consumers, direct gets and last-message reads on
        `streams`; with `delete`, removing consumers by name (a service's own, when it
        stops; ephemeral ones go by themselves once idle)."""
        subjects = ["$JS.FC.>"]
        for name in streams:
            subjects += [
                f"$JS.API.CONSUMER.CREATE.{name}",
                f"$JS.API.CONSUMER.CREATE.{name}.>",
                f"$JS.API.CONSUMER.MSG.NEXT.{name}.*",
                f"$JS.API.CONSUMER.INFO.{name}.*",
                *([f"$JS.API.CONSUMER.DELETE.{name}.*"] if delete else []),
                f"$JS.API.DIRECT.GET.{name}",
                f"$JS.API.DIRECT.GET.{name}.>",
                f"$JS.API.STREAM.MSG.GET.{name}",
            ]
        return subjects

    def read_only(self, stream: str, filter_subject: str) -> list[str]:
        """Pull followers on `stream` whose filter is `filter_subject` (or narrower), beside
        what `read` allows on other streams."""
        return [
            f"$JS.API.CONSUMER.CREATE.{stream}.*.{filter_subject}",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.*",
            f"$JS.API.CONSUMER.INFO.{stream}.*",
            f"$JS.API.CONSUMER.DELETE.{stream}.*",
        ]


def permissions(layout: Layout, user: str, node_id: str | None = None) -> Permissions:
    """What `user` (a role of `ROLES`, or an agent with its `node_id`) may do."""
    api, subjects = _Api(layout), layout.subjects
    nodes_kv = layout.nodes_bucket.stream_name
    runners_kv = layout.runners_bucket.stream_name
    status_kv = layout.runner_status_bucket.stream_name
    inbox = [f"{inbox_prefix(user)}.>"]
    if node_id is not None:
        node = token(node_id)
        return Permissions(
            publish=(
                subjects.runner_of_node(node_id),
                kv_key(layout.nodes_bucket.bucket, node),
                subjects.task_status_of_node(node_id),
                subjects.output_of_node(node_id),
                subjects.deadletter(agent_user(node_id)),
                # `rankscope record` on this node runs with its agent's credentials
                subjects.record_register(node_id),
                # no stream's state but its heartbeat bucket's (nats-py reads it to open
                # the bucket): the subjects of the others name other nodes' tasks
                *api.names(),
                f"$JS.API.STREAM.INFO.{nodes_kv}",
                # no consumer of another's can it delete: its own go once idle
                *api.read(api.stream("PLACEMENT"), api.stream("TASKS"), delete=False),
                # a restarted runner resumes its seq from its last stored message
                f"$JS.API.DIRECT.GET.{api.stream('RUNNER')}.{subjects.runner_of_node(node_id)}",
                # its own copy of each task of its instances, prompts included
                f"$JS.API.DIRECT.GET.{api.stream('INPUTS')}.{subjects.task_inputs_of_node(node_id)}",
            ),
            subscribe=(
                *inbox,
                subjects.node_diagnostics(node_id),
                subjects.node_evidence(node_id),
                subjects.node_model(node_id),
                subjects.record_evidence_of_node(node_id),
            ),
            responds=True,
        )
    if user == "aggregator":
        return Permissions(
            publish=(
                subjects.diagnosis_all(),
                subjects.deadletter("aggregator"),
                subjects.canary("aggregator"),
                subjects.node_request_all("diagnostics"),
                subjects.node_request_all("evidence"),
                subjects.record_evidence_all(),
                *api.everyone(),
                *api.own(),
                *api.read(
                    api.stream("RUNNER"),
                    api.stream("PLACEMENT"),
                    api.stream("RECORDED"),
                    api.stream("FR"),
                    api.stream("TASKS"),
                    api.stream("DIAGNOSIS"),  # the incidents open when it last stopped
                    nodes_kv,
                ),
            ),
            subscribe=(*inbox, subjects.query_all(), *service_discovery(AGGREGATOR_SERVICE)),
            responds=True,
        )
    if user == "ranktable":
        return Permissions(
            publish=(
                subjects.placement_all(),
                subjects.recorded_all(),
                subjects.ranktable_all(),
                subjects.node_request_all("model"),
                subjects.canary("ranktable"),
                kv_key(layout.runner_status_bucket.bucket),
                # a deleted job's rank table goes with it
                f"$JS.API.STREAM.PURGE.{api.stream('RANKTABLE')}",
                subjects.deadletter("ranktable"),
                *api.everyone(),
                *api.own(),
                *api.read(
                    api.stream("RUNNER"),
                    api.stream("PLACEMENT"),
                    api.stream("RECORDED"),
                    api.stream("RANKTABLE"),
                    runners_kv,
                    nodes_kv,
                    status_kv,
                ),
            ),
            subscribe=(*inbox, subjects.record_register_all()),
            responds=True,
        )
    if user == "gateway":
        return Permissions(
            publish=(
                subjects.query_all(),
                subjects.tasks_of_any(),
                subjects.task_inputs_all(),
                subjects.node_request_all("diagnostics"),
                subjects.node_request_all("evidence"),  # Skulk's capture route
                subjects.fr_load_all(),  # `rankscope fr load`, through the API
                kv_key(layout.runners_bucket.bucket),
                *api.everyone(),
                *api.read(
                    api.stream("RANKTABLE"),
                    api.stream("DIAGNOSIS"),
                    api.stream("FR"),  # a loaded job's incident bundle holds its verdict
                    runners_kv,
                    nodes_kv,
                    status_kv,
                ),
                *api.read_only(api.stream("RUNNER"), subjects.memory_of_instance(None)),
            ),
            subscribe=(
                *inbox,
                subjects.ranktable_all(),
                subjects.output_all(),
                subjects.task_status_all(),
            ),
        )
    if user == OPERATOR:
        return Permissions(
            publish=(
                *api.everyone(),
                "$JS.API.STREAM.LIST",
                "$JS.API.CONSUMER.LIST.*",
                "$JS.API.CONSUMER.NAMES.*",
                *service_discovery(),  # nats micro ls, info, stats
                *api.read(*api.all_streams, delete=False),
            ),
            subscribe=(*inbox, "_INBOX.>", subjects.everything()),  # the nats CLI's own inbox too
            # a queue subscription would take requests from the services that answer them
            deny_subscribe=(f"{subjects.everything()} >",),
        )
    raise ValueError(f"no role {user!r}; roles are {', '.join(ROLES)}, {OPERATOR} and agent-<node>")


def render(layout: Layout, nodes: Sequence[str], passwords: Mapping[str, str] | None = None) -> str:
    """A nats-server config: rankscope's limits and one user per role and per node.

    Passwords are written as given, or, when `passwords` is None, as references to
    environment variables of the server (`password_variable`), so the file holds no secret.
    """
    users = [(role, permissions(layout, role)) for role in (*ROLES, OPERATOR)]
    users += [(agent_user(n), permissions(layout, agent_user(n), n)) for n in nodes]
    lines = [
        "# rankscope's NATS server config with one user per role (`rankscope nats-config`).",
        "# Timelines for a browser can be tens of MB; NATS's 1 MB default would refuse them.",
        "max_payload: 64MB",
        "authorization {",
        "  users: [",
    ]
    for user, allowed in users:
        denied = json.dumps(list(allowed.deny_subscribe))
        secret = (
            json.dumps(passwords[user]) if passwords is not None else f"${password_variable(user)}"
        )
        lines += [
            f"    {{user: {json.dumps(user)}, password: {secret}, permissions: {{",
            f"      publish: {{allow: {json.dumps(list(allowed.publish))}}}",
            f"      subscribe: {{allow: {json.dumps(list(allowed.subscribe))}"
            + (f", deny: {denied}" if allowed.deny_subscribe else "")
            + "}",
            f"      allow_responses: {'true' if allowed.responds else 'false'}",
            "    }}",
        ]
    lines += ["  ]", "}", ""]
    return "\n".join(lines)
