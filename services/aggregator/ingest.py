"""Folding the streams into the views: placements, loaded dumps, tasks and telemetry,
replayed then followed; of a partition, only its own instances' tasks and telemetry."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable

from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext

from rankscope.services.aggregator.dumps import loaded
from rankscope.services.aggregator.parking import PARK_S, Parked, Parking
from rankscope.services.aggregator.views import ClusterState, Held
from rankscope.shared.deadletter import DeadLetters
from rankscope.shared.inputs import BadInputError, parse_placement, parse_task, parse_telemetry
from rankscope.shared.jetstream import Layout
from rankscope.shared.partitions import Partition
from rankscope.shared.replay import Follower, follow, stored_ns
from rankscope.shared.subjects import token
from rankscope.shared.wire import Finding, InstanceCreated, WireError, decode, encode
from rankscope.shared.wire.fr import FrLoad

__all__ = ["FOLLOW_RELEASED_S", "UNPLACED", "Ingest"]

log = logging.getLogger(__name__)

UNPLACED = "telemetry_unplaced"
"""The kind of bad input of a runner that no placement made."""
FOLLOW_RELEASED_S = 300.0
"""How long a partition still follows a released instance's telemetry (its last words)."""
UNPARK_S = 0.25
"""How often telemetry parked too long is refused."""


class Ingest:
    """Follows placements, tasks and telemetry into `state`, refusing what cannot apply.

    Args:
        js: JetStream context.
        layout: streams and subjects.
        state: the views to fold events into.
        partition: the instances it folds.
        dead_letters: where refused messages go, with the reason.
        clock: monotonic seconds.
        wall: seconds since the epoch.
    """

    def __init__(
        self,
        *,
        js: JetStreamContext,
        layout: Layout,
        state: ClusterState,
        partition: Partition,
        dead_letters: DeadLetters,
        clock: Callable[[], float],
        wall: Callable[[], float],
    ) -> None:
        self._js = js
        self._layout = layout
        self._state = state
        self._partition = partition
        self._whole = partition.whole
        self._dead_letters = dead_letters
        self._clock = clock
        self._wall = wall
        self._arrived = False
        """Whether the state was told when the run of telemetry it folds now arrived."""
        self.placed_at: dict[str, float] = {}
        """When each of its instances was last placed, by its clock."""
        self.placed_elsewhere: dict[str, set[str]] = {}
        """The nodes of each instance of another partition."""
        self.folding: dict[str, Follower] = {}
        """The followers a snapshot covers, by stream name."""
        self.wanted: set[str] = set()
        """Its instances placed, whose tasks and telemetry it wants to follow."""
        self.followed: set[str] = set()
        """Its instances whose tasks and telemetry it follows."""
        self._released: dict[str, float] = {}
        """When each of its instances was released (followed a while longer)."""
        self._more = asyncio.Event()
        self._parking = Parking()
        """Telemetry of runners no placement read so far names, waiting for one."""
        self.loaded: deque[Finding] = deque()
        """The incidents of loaded dumps, for the findings to publish (once)."""
        state.refused = self._refused_when_filed

    def _reject(self, msg: Msg, error: BadInputError) -> None:
        self._dead_letters.reject(msg.subject, msg.data, error.kind, error)

    def _foreign(self, msg: Msg) -> bool:
        """Whether the message is of an instance of another partition (not decoded)."""
        return not self._partition.owns_subject(msg.subject, self._layout.subjects)

    def on_telemetry(self, msg: Msg) -> None:
        if not self._whole and self._foreign(msg):  # ingest's hottest call: spared if whole
            return
        try:
            event = parse_telemetry(msg.data, msg.subject, self._layout.subjects)
        except BadInputError as exc:
            self._reject(msg, exc)
            return
        stored = stored_ns(msg.reply)
        if not self._arrived:
            self._arrive()
            self._arrived = True
        try:  # settled by the follower: a runner's batches of a run filed at once
            self._state.apply_telemetry(event, msg.data, stored, settle=False)
        except BadInputError as exc:  # only now is it worth a `Parked`
            self._refused(Parked(msg.subject, msg.data, event, stored, self._clock()), exc)

    def _arrive(self) -> None:
        """Tell the state that the telemetry it folds until its next settle arrives now."""
        self._state.arrive(self._clock(), self._wall())

    def _settle(self) -> None:
        """The end of a run of telemetry: fold what it held; the next run arrives anew."""
        self._state.settle()
        self._arrived = False

    def _refused_when_filed(self, held: Held, error: BadInputError) -> None:
        """Refuse a batch `settle` could not file (of a placed runner: not parked)."""
        event, raw, _ = held
        ref = event.runner
        subject = self._layout.subjects.runner(ref.nodeId, ref.instanceId, ref.deviceRank, "phase")
        self._dead_letters.reject(subject, raw or b"", error.kind, error)

    def _apply_telemetry(self, item: Parked) -> None:
        """Apply a parked message, or park it again or refuse it."""
        try:
            self._state.apply_telemetry(item.event, item.data, item.stored_ns)
        except BadInputError as exc:
            self._refused(item, exc)

    def _refused(self, item: Parked, error: BadInputError) -> None:
        """Park a message while no placement read so far names its runner, else refuse it."""
        if error.kind != UNPLACED:
            self._dead_letters.reject(item.subject, item.data, error.kind, error)
            return
        for late in self._parking.park(item):
            self._dead_letters.reject(late.subject, late.data, UNPLACED, "parked too long")

    async def unpark_forever(self, stop: asyncio.Event) -> None:
        """Refuse what no placement claimed in time."""
        while not stop.is_set():
            for item in self._parking.expired(self._clock()):
                why = f"runner {item.event.runner.runnerId!r} is in no placement ({PARK_S:g}s)"
                self._dead_letters.reject(item.subject, item.data, UNPLACED, why)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), UNPARK_S)

    async def on_placement(self, msg: Msg) -> None:
        foreign = self._foreign(msg)
        try:
            event = parse_placement(msg.data)
        except BadInputError as exc:
            if not foreign:  # its own partition says so, once
                self._reject(msg, exc)
            return
        if foreign:  # only where it runs: its nodes are probed by its own partition
            if isinstance(event, InstanceCreated):
                self.placed_elsewhere[event.instanceId] = {a.nodeId for a in event.assignments}
            else:
                self.placed_elsewhere.pop(event.instanceId, None)
            return
        if not self._partition.whole:
            if isinstance(event, InstanceCreated):
                self.wanted.add(event.instanceId)
                self._released.pop(event.instanceId, None)
            else:
                self._released[event.instanceId] = self._clock()
            self._more.set()
        self._state.apply_placement(event, stored_ns(msg.reply))
        self.placed_at[event.instanceId] = self._clock()
        if isinstance(event, InstanceCreated):  # its runners' first messages, read before it
            self._arrive()
            for assignment in event.assignments:
                for item in self._parking.take(assignment.runnerId):
                    self._apply_telemetry(item)

    def on_dump(self, msg: Msg) -> None:
        """A job's loaded Flight Recorder dumps: its ranks and entries into the views, its
        verdict to the findings."""
        if self._foreign(msg):
            return
        try:
            made = loaded(decode(msg.data, FrLoad))
        except WireError as exc:
            self._reject(msg, BadInputError("dump_undecodable", str(exc)))
            return
        stored = stored_ns(msg.reply)
        self._state.apply_placement(made.instance, stored)
        self.placed_at[made.instance.instanceId] = self._clock()
        self._arrive()
        for batch in made.batches:
            try:
                self._state.apply_telemetry(batch, encode(batch), stored)
            except BadInputError as exc:
                self._reject(msg, exc)
        self.loaded.extend(made.incident)

    def on_task(self, msg: Msg) -> None:
        if self._foreign(msg):
            return
        try:
            self._state.apply_task(parse_task(msg.data))
        except BadInputError as exc:
            self._reject(msg, exc)

    async def follow(self, after: dict[str, int]) -> None:
        """Follow placements, tasks and telemetry from `after` (by stream). Of a partition,
        only its instances' tasks and telemetry: the server filters them by instance, once
        the placements it holds say which instances are its own."""
        layout, subjects = self._layout, self._layout.subjects
        for instance_id in self._state.instances:  # restored from a snapshot
            self.placed_at[instance_id] = self._clock()
        self.folding = {}  # each as it starts: a stop while catching up stops them
        for stream, subject, handle in (
            (layout.placement_stream.name, subjects.placement_all(), self.on_placement),
            (layout.recorded_stream.name, subjects.recorded_all(), self.on_placement),
            (layout.fr_stream.name, subjects.fr_load_all(), self.on_dump),  # loaded dumps
        ):
            placed = await follow(self._js, subject, handle, after=after.get(stream, 0))
            self.folding[stream] = placed
            await placed.caught_up.wait()  # telemetry counts once its rank is placed
        if self._partition.whole:
            runner, tasks = [subjects.runner_all()], [subjects.tasks_all()]
        else:
            followed = set(self._state.instances)  # restored from the snapshot
            if not after.get(layout.runner_stream.name):
                followed |= self.wanted  # from the start: nothing to go over again
            self.followed = followed
            runner, tasks = self._filters([None, *sorted(followed)])
        for name, (filters, handle) in {
            layout.tasks_stream.name: (tasks, self.on_task),
            layout.runner_stream.name: (runner, self.on_telemetry),
        }.items():
            self.folding[name] = await follow(
                self._js,
                filters[0],
                handle,
                also=filters[1:],
                after=after.get(name, 0),
                settle=self._settle,
            )

    def _filters(self, ids: list[str | None]) -> tuple[list[str], list[str]]:
        """The telemetry and task subjects of these instances; None's are subjects no
        message has, which keep a consumer's filter from ever being empty (it would then
        get everything)."""
        subjects = self._layout.subjects
        runner = [subjects.runner_of_instance(i) for i in ids]
        tasks = [subject for i in ids for subject in subjects.tasks_of_instance(i)]
        return runner, tasks

    async def follow_more_forever(self, stop: asyncio.Event) -> None:
        """Of a partition: follow the tasks and telemetry of its instances placed since it
        started too, from their first message (older ones are gone over again for them);
        stop following those released `FOLLOW_RELEASED_S` ago."""
        subjects = self._layout.subjects
        runner = self.folding[self._layout.runner_stream.name]
        tasks = self.folding[self._layout.tasks_stream.name]
        while not stop.is_set():
            if new := self.wanted - self.followed:
                tokens = {token(i) for i in new}

                def added(subject: str, tokens: set[str] = tokens) -> bool:
                    return subjects.instance_token(subject) in tokens

                runner_subjects, task_subjects = self._filters([*sorted(new)])
                try:
                    await runner.widen(runner_subjects, added)
                    await tasks.widen(task_subjects, added)
                except (NatsError, TimeoutError) as exc:
                    log.warning("cannot follow instances %s yet: %s", sorted(new), exc)
                    await asyncio.sleep(1.0)
                    continue
                self.followed |= new
            moment = self._clock()
            if done := {i for i, at in self._released.items() if moment - at > FOLLOW_RELEASED_S}:
                runner_subjects, task_subjects = self._filters([*sorted(done)])
                runner.narrow(runner_subjects)
                tasks.narrow(task_subjects)
                self.followed -= done
                self.wanted -= done
                for instance_id in done:
                    del self._released[instance_id]
            self._more.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._more.wait(), 1.0)
