"""With rankscope's per-role NATS config, the server itself refuses what a role must not
do, while the same user's own work goes through."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig
from nats.js.errors import NotFoundError

from rankscope.shared.connection import close, connect
from rankscope.shared.jetstream import Layout
from rankscope.shared.nats_auth import OPERATOR, ROLES, agent_user, render
from rankscope.shared.nats_server import EmbeddedNats
from rankscope.shared.provision import ensure
from rankscope.shared.replay import follow
from rankscope.shared.settings import Settings

pytestmark = [pytest.mark.nats, pytest.mark.timeout(120)]

NODES = ("node-a", "node-b")
LAYOUT = Layout()
SUBJECTS = LAYOUT.subjects
PASSWORDS = {user: f"pw-{user}" for user in (*ROLES, OPERATOR, *(agent_user(n) for n in NODES))}


class _Session:
    """One user's connection and the server errors it received."""

    def __init__(self, nc: Client, errors: list[str]) -> None:
        self.nc, self.js, self.errors = nc, nc.jetstream(timeout=1.0), errors

    async def refused(self, what: str) -> None:
        """The server reported a permissions violation naming `what`."""
        for _ in range(100):
            if any("permissions violation" in e.lower() and what.lower() in e.lower()
                   for e in self.errors):  # fmt: skip
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"no permissions violation for {what!r}; got {self.errors}")

    async def publish_refused(self, subject: str) -> None:
        with pytest.raises((TimeoutError, NatsError)):
            await self.js.publish(subject, b"{}", timeout=0.2)  # never acked: refused
        await self.refused(subject)


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[EmbeddedNats]:
    server = EmbeddedNats(store_dir=tmp_path, config=render(LAYOUT, NODES, PASSWORDS)).start()
    owner = await _login(server, "aggregator")
    await ensure(owner.js, LAYOUT)
    await close(owner.nc)
    yield server
    server.stop()


async def _login(server: EmbeddedNats, user: str) -> _Session:
    errors: list[str] = []

    async def collect(exc: Exception) -> None:
        errors.append(str(exc))

    settings = Settings(nats_url=server.url, nats_user=user, nats_password=PASSWORDS[user])
    return _Session(await connect(settings, f"test-{user}", error_cb=collect), errors)


async def _stored(session: _Session, subject: str) -> bool:
    try:
        await session.js.get_last_msg(LAYOUT.runner_stream.name, subject, direct=True)
    except NotFoundError:
        return False
    return True


async def test_an_agent_publishes_only_under_its_own_node(server: EmbeddedNats) -> None:
    agent = await _login(server, agent_user("node-a"))
    mine = SUBJECTS.runner("node-a", "i", 0, "memory")
    theirs = SUBJECTS.runner("node-b", "i", 0, "memory")
    await agent.js.publish(mine, b"{}")
    await agent.js.publish(SUBJECTS.task_status("i", "node-a"), b"{}")
    await agent.nc.publish(SUBJECTS.output("cmd", "node-a"), b"{}")
    await agent.publish_refused(theirs)
    await agent.publish_refused(SUBJECTS.task_status("i", "node-b"))
    await agent.publish_refused(SUBJECTS.tasks("i"))  # only the gateway asks for work
    await agent.publish_refused(f"$KV.{LAYOUT.nodes_bucket.bucket}.node-b")
    await agent.publish_refused(SUBJECTS.placement("i"))
    await agent.publish_refused(SUBJECTS.diagnosis("i"))
    await agent.nc.publish(SUBJECTS.output("cmd", "node-b"), b"{}")
    await agent.refused(SUBJECTS.output("cmd", "node-b"))
    assert await _stored(agent, mine)  # how a restarted runner resumes its seq
    await close(agent.nc)
    aggregator = await _login(server, "aggregator")
    assert not await _stored(aggregator, theirs)
    await close(aggregator.nc)


async def test_each_role_writes_dead_letters_only_as_itself(server: EmbeddedNats) -> None:
    agent = await _login(server, agent_user("node-a"))
    await agent.js.publish(SUBJECTS.deadletter(agent_user("node-a")), b"its own")
    for other in ("aggregator", "ranktable", agent_user("node-b")):
        await agent.publish_refused(SUBJECTS.deadletter(other))
    with pytest.raises((TimeoutError, NatsError)):
        await agent.js.purge_stream(LAYOUT.deadletter_stream.name)
    await agent.refused("STREAM.PURGE")
    await close(agent.nc)


async def test_no_agent_can_roll_up_the_node_bucket(server: EmbeddedNats) -> None:
    bucket = LAYOUT.nodes_bucket
    other = await _login(server, agent_user("node-b"))
    await other.js.publish(f"$KV.{bucket.bucket}.node-b", b"{}")
    await close(other.nc)
    agent = await _login(server, agent_user("node-a"))
    with pytest.raises(NatsError, match=r"(?i)rollup"):
        await agent.js.publish(f"$KV.{bucket.bucket}.node-a", b"{}", headers={"Nats-Rollup": "all"})
    await close(agent.nc)
    aggregator = await _login(server, "aggregator")
    kept = await aggregator.js.get_last_msg(bucket.stream_name, f"$KV.{bucket.bucket}.node-b")
    assert kept.data == b"{}"
    await close(aggregator.nc)


async def test_an_agent_reads_only_its_own_node_s_prompts(server: EmbeddedNats) -> None:
    inputs = LAYOUT.inputs_stream.name
    gateway = await _login(server, "gateway")
    for node in NODES:
        await gateway.js.publish(SUBJECTS.task_input(node, "i", "t"), node.encode())
    await close(gateway.nc)
    agent = await _login(server, agent_user("node-a"))
    mine = await agent.js.get_last_msg(inputs, SUBJECTS.task_input("node-a", "i", "t"), direct=True)
    assert mine.data == b"node-a"
    theirs = SUBJECTS.task_input("node-b", "i", "t")
    with pytest.raises((TimeoutError, NatsError)):
        await agent.js.get_last_msg(inputs, theirs, direct=True)
    await agent.refused(f"DIRECT.GET.{inputs}.{theirs}")
    with pytest.raises((TimeoutError, NatsError)):
        await agent.js.add_consumer(inputs, ConsumerConfig(ack_policy=AckPolicy.NONE))
    await agent.refused(f"CONSUMER.CREATE.{inputs}")
    await agent.publish_refused(SUBJECTS.task_input("node-a", "i", "forged"))
    await close(agent.nc)


async def test_an_agent_reads_no_other_node_s_telemetry(server: EmbeddedNats) -> None:
    agent = await _login(server, agent_user("node-b"))
    await agent.js.publish(SUBJECTS.runner("node-b", "i", 1, "memory"), b"{}")
    await close(agent.nc)
    agent = await _login(server, agent_user("node-a"))
    theirs = SUBJECTS.runner("node-b", "i", 1, "memory")
    with pytest.raises((TimeoutError, NatsError)):
        await _stored(agent, theirs)
    await agent.refused(f"DIRECT.GET.{LAYOUT.runner_stream.name}.{theirs}")
    with pytest.raises((TimeoutError, NatsError)):
        await agent.js.get_last_msg(LAYOUT.runner_stream.name, theirs)
    await agent.refused("STREAM.MSG.GET")
    await close(agent.nc)


async def test_an_agent_reads_its_assignments_but_not_the_telemetry_stream(
    server: EmbeddedNats,
) -> None:
    agent = await _login(server, agent_user("node-a"))
    await agent.js.subscribe(SUBJECTS.placement_all(), ordered_consumer=True)
    await agent.nc.subscribe(SUBJECTS.node_diagnostics("node-a"))
    with pytest.raises((TimeoutError, NatsError)):
        await agent.js.subscribe(SUBJECTS.runner_all(), ordered_consumer=True)
    await agent.refused("CONSUMER.CREATE")
    await agent.nc.subscribe(SUBJECTS.node_diagnostics("node-b"))
    await agent.refused(f'subscription to "{SUBJECTS.node_diagnostics("node-b")}"')
    await agent.nc.subscribe("_INBOX_gateway.>")  # nobody reads another's replies
    await agent.refused('subscription to "_INBOX_gateway.>"')
    await close(agent.nc)


async def test_an_agent_lists_no_stream_s_subjects_yet_finds_every_stream(
    server: EmbeddedNats,
) -> None:
    gateway = await _login(server, "gateway")
    await gateway.js.publish(SUBJECTS.task_input("node-b", "i", "their-task"), b"{}")
    await close(gateway.nc)
    agent = await _login(server, agent_user("node-a"))
    await ensure(agent.js, LAYOUT, owner=False, patience=2)  # how an agent starts
    await agent.js.key_value(LAYOUT.nodes_bucket.bucket)  # where its heartbeat goes
    inputs = LAYOUT.inputs_stream.name
    with pytest.raises((TimeoutError, NatsError)):
        await agent.js.stream_info(inputs, subjects_filter=">")
    await agent.refused(f"STREAM.INFO.{inputs}")
    await close(agent.nc)


async def test_an_agent_deletes_no_consumer_of_the_streams_it_reads(server: EmbeddedNats) -> None:
    aggregator = await _login(server, "aggregator")
    theirs = ConsumerConfig(name="theirs", ack_policy=AckPolicy.NONE, inactive_threshold=60)
    for stream in (LAYOUT.tasks_stream.name, LAYOUT.placement_stream.name):
        await aggregator.js.add_consumer(stream, theirs)
    agent = await _login(server, agent_user("node-a"))
    for stream in (LAYOUT.tasks_stream.name, LAYOUT.placement_stream.name):
        with pytest.raises((TimeoutError, NatsError)):
            await agent.js.delete_consumer(stream, "theirs")
        await agent.refused(f"CONSUMER.DELETE.{stream}.theirs")
        assert (await aggregator.js.consumer_info(stream, "theirs")).name == "theirs"
    for session in (agent, aggregator):
        await close(session.nc)


async def test_the_gateway_cannot_publish_telemetry_placements_status_or_output(
    server: EmbeddedNats,
) -> None:
    gateway = await _login(server, "gateway")
    await gateway.publish_refused(SUBJECTS.runner("node-a", "i", 0, "phase"))
    await gateway.publish_refused(SUBJECTS.placement("i"))
    await gateway.publish_refused(f"$KV.{LAYOUT.nodes_bucket.bucket}.node-a")
    await gateway.publish_refused(SUBJECTS.task_status("i", "node-a"))
    await gateway.nc.publish(SUBJECTS.output("cmd", "node-a"), b"{}")
    await gateway.refused(SUBJECTS.output("cmd", "node-a"))
    await gateway.js.publish(SUBJECTS.tasks("i"), b"{}")  # its own work
    await gateway.js.publish(SUBJECTS.fr_load("i"), b"{}")  # `rankscope fr load`'s too
    await close(gateway.nc)


async def test_no_agent_loads_dumps_as_the_gateway_does(server: EmbeddedNats) -> None:
    agent = await _login(server, agent_user("node-a"))
    await agent.publish_refused(SUBJECTS.fr_load("i"))
    await close(agent.nc)


async def test_the_gateway_reads_memory_samples_and_no_other_telemetry(
    server: EmbeddedNats,
) -> None:
    agent = await _login(server, agent_user("node-a"))
    await agent.js.publish(SUBJECTS.runner("node-a", "i", 0, "memory"), b"{}")
    await close(agent.nc)
    gateway = await _login(server, "gateway")
    for subject in (SUBJECTS.memory_of_instance("i"), SUBJECTS.memory_of_instance(None)):
        follower = await follow(gateway.js, subject, _ignore)
        await asyncio.wait_for(follower.caught_up.wait(), 5)
        assert follower.handled == 1
        await follower.stop()
    with pytest.raises((TimeoutError, NatsError)):
        await follow(gateway.js, SUBJECTS.runner_of_instance("i"), _ignore)
    await gateway.refused("CONSUMER.CREATE")
    await close(gateway.nc)


async def _ignore(msg: Msg) -> None:
    del msg


async def test_the_aggregator_writes_only_its_own_subjects(server: EmbeddedNats) -> None:
    aggregator = await _login(server, "aggregator")
    await aggregator.js.publish(SUBJECTS.diagnosis("i"), b"{}")
    await aggregator.js.subscribe(SUBJECTS.runner_all(), ordered_consumer=True)
    await aggregator.publish_refused(SUBJECTS.runner("node-a", "i", 0, "phase"))
    await aggregator.publish_refused(SUBJECTS.placement("i"))
    await aggregator.publish_refused(SUBJECTS.tasks("i"))
    await aggregator.publish_refused(f"$KV.{LAYOUT.runners_bucket.bucket}.spec")
    await close(aggregator.nc)


async def test_only_owners_change_streams_and_nobody_deletes_them(server: EmbeddedNats) -> None:
    for user in ("gateway", agent_user("node-a")):
        session = await _login(server, user)
        with pytest.raises((TimeoutError, NatsError)):
            await session.js.update_stream(
                StreamConfig(name=LAYOUT.runner_stream.name, subjects=[SUBJECTS.runner_all()])
            )
        await session.refused("STREAM.UPDATE")
        await close(session.nc)
    for user in ROLES:
        session = await _login(server, user)
        with pytest.raises((TimeoutError, NatsError)):
            await session.js.delete_stream(LAYOUT.runner_stream.name)
        await session.refused("STREAM.DELETE")
        await close(session.nc)


async def test_the_operator_reads_every_stream_the_dead_letters_too_and_writes_nothing(
    server: EmbeddedNats,
) -> None:
    aggregator = await _login(server, "aggregator")
    await aggregator.js.publish(SUBJECTS.deadletter("aggregator"), b"bad input")
    await close(aggregator.nc)
    operator = await _login(server, OPERATOR)
    kept = await operator.js.get_last_msg(
        LAYOUT.deadletter_stream.name, SUBJECTS.deadletter("aggregator")
    )
    assert kept.data == b"bad input"
    names = await operator.js.streams_info()
    assert {s.config.name for s in names} >= {s.name for s in LAYOUT.streams}
    watched = await operator.nc.subscribe(f"{SUBJECTS.prefix}.>")
    await operator.publish_refused(SUBJECTS.deadletter("aggregator"))
    await operator.publish_refused(SUBJECTS.runner("node-a", "i", 0, "memory"))
    with pytest.raises((TimeoutError, NatsError)):
        await operator.js.purge_stream(LAYOUT.deadletter_stream.name)
    await operator.refused("STREAM.PURGE")
    await watched.unsubscribe()
    await close(operator.nc)


async def test_the_operator_answers_no_query_or_probe_and_deletes_no_consumer(
    server: EmbeddedNats,
) -> None:
    operator = await _login(server, OPERATOR)
    asked = [SUBJECTS.query("diagnosis"), SUBJECTS.node_diagnostics("node-a")]

    async def forge(msg: Msg) -> None:
        await msg.respond(b'{"findings": [{"forged": true}]}')

    for subject in asked:
        await operator.nc.subscribe(subject, cb=forge)
    await operator.nc.flush()
    gateway = await _login(server, "gateway")
    aggregator = await _login(server, "aggregator")
    for session, subject in ((gateway, asked[0]), (aggregator, asked[1])):
        with pytest.raises((TimeoutError, NatsError)):
            await session.nc.request(subject, b"{}", timeout=0.5)
    await operator.refused("publish")  # its answers never left
    theirs = ConsumerConfig(name="theirs", ack_policy=AckPolicy.NONE, inactive_threshold=60)
    info = await aggregator.js.add_consumer(LAYOUT.runner_stream.name, theirs)
    with pytest.raises((TimeoutError, NatsError)):
        await operator.js.delete_consumer(LAYOUT.runner_stream.name, info.name)
    await operator.refused("CONSUMER.DELETE")
    for session in (operator, gateway, aggregator):
        await close(session.nc)


async def test_the_operator_joins_no_queue_group_so_every_query_reaches_the_aggregator(
    server: EmbeddedNats,
) -> None:
    aggregator = await _login(server, "aggregator")
    subject = SUBJECTS.query("diagnosis")

    async def answer(msg: Msg) -> None:
        await msg.respond(b"answered")

    await aggregator.nc.subscribe(subject, queue="q", cb=answer)  # nats.micro's group
    operator = await _login(server, OPERATOR)
    await operator.nc.subscribe(subject, queue="q", cb=_ignore)
    await operator.refused(f'subscription to "{subject}"')
    await operator.nc.subscribe(subject, cb=_ignore)  # watching it stays allowed
    await operator.nc.flush()
    gateway = await _login(server, "gateway")
    answers = [await gateway.nc.request(subject, b"{}", timeout=2) for _ in range(8)]
    assert [a.data for a in answers] == [b"answered"] * 8
    assert sum("subscription" in e for e in operator.errors) == 1
    for session in (operator, gateway, aggregator):
        await close(session.nc)


async def test_a_wrong_password_is_refused(server: EmbeddedNats) -> None:
    nc = Client()
    with pytest.raises(NatsError, match=r"(?i)authorization"):
        await nc.connect(server.url, user="gateway", password="guess", allow_reconnect=False)
    await nc.close()
