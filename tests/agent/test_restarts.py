"""When a runner that exited is started again, on virtual time: its own crashes trip the
breaker, three in a minute; a rank that only gave up on its peers backs off and never
trips it; an error that would recur on every start is not retried."""

from __future__ import annotations

from rankscope.services.agent.restarts import (
    CRASH_LIMIT,
    CRASH_WINDOW_S,
    VICTIM_BACKOFF_MAX_S,
    Restart,
    Restarts,
)


def test_three_crashes_in_a_minute_give_up_and_crashes_a_minute_apart_do_not() -> None:
    spaced = Restarts()
    assert [spaced.exited(t, victim=False, permanent=False) for t in (0, 61, 122, 183)] == [
        Restart(1.0)
    ] * 4
    looping = Restarts()
    said = [looping.exited(t, victim=False, permanent=False) for t in (0, 10, 20)]
    assert said[:2] == [Restart(1.0)] * 2
    assert said[2] == Restart(None, f"gave up after {CRASH_LIMIT} crashes in {CRASH_WINDOW_S:g}s")


def test_a_victim_backs_off_doubling_up_to_its_cap_without_tripping_the_breaker() -> None:
    victim = Restarts()
    delays = [victim.exited(t, victim=True, permanent=False).delay for t in range(8)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, VICTIM_BACKOFF_MAX_S, VICTIM_BACKOFF_MAX_S, 30.0]
    victim.ready()  # ready again: its next wait starts short
    assert victim.exited(9, victim=True, permanent=False) == Restart(1.0)
    assert victim.exited(10, victim=False, permanent=False) == Restart(1.0)  # one crash


def test_an_error_that_recurs_on_every_start_is_not_retried() -> None:
    said = Restarts().exited(0, victim=False, permanent=True)
    assert said.delay is None
    assert said.why_not == "not restarted: the same error would recur on every start"
