from __future__ import annotations

import asyncio
import gc
import itertools
import json
import os
import subprocess
import sys
import time
import weakref
from collections import deque
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replicator.coordinator.setup_scheduler import SetupScheduler, Sweep
from tests.unit.fakeloop import VirtualTimeLoop

REPO = Path(__file__).resolve().parents[2]
STAGGER = 0.05
SPACING_SLACK = 1e-9  # a slot moved past a claim sits exactly `stagger` after it, up to float rounding


class Draws:
    """An rng fed by the test: each draw is the value the test queued for it."""

    def __init__(self, *values: float) -> None:
        self.queue: deque[float] = deque(values)

    def push(self, *values: float) -> None:
        self.queue.extend(values)

    def __call__(self) -> float:
        assert self.queue, "the scheduler drew more values than the test supplied"
        return self.queue.popleft()


class Recorder:
    def __init__(self, loop: VirtualTimeLoop) -> None:
        self.loop = loop
        self.dispatches: list[tuple[float, str, str, Any]] = []
        self.armed: list[tuple[float, str, str, Any, float]] = []

    def dispatch(self, url: str, database: str, payload: Any) -> None:
        self.dispatches.append((self.loop.time(), url, database, payload))

    def on_armed(self, url: str, database: str, payload: Any, delay: float) -> None:
        self.armed.append((self.loop.time(), url, database, payload, delay))

    def times(self, url: str | None = None) -> list[float]:
        return [t for t, u, _, _ in self.dispatches if url is None or u == url]


def make(loop: VirtualTimeLoop, rng: Any, **kwargs: Any) -> tuple[SetupScheduler, Recorder]:
    rec = Recorder(loop)
    scheduler = SetupScheduler(rec.dispatch, loop=loop, rng=rng, on_armed=rec.on_armed, **kwargs)
    return scheduler, rec


def assert_spaced(times: list[float], stagger: float = STAGGER) -> None:
    ordered = sorted(times)
    gaps = [b - a for a, b in itertools.pairwise(ordered)]
    assert all(gap >= stagger - SPACING_SLACK for gap in gaps), (ordered, gaps)


def url(n: int) -> str:
    return f"wss://peer{n}:9925"


# Invariant 1: the storm -----------------------------------------------------------------------------------------


def test_storm_of_60000_events_on_one_pair_dispatches_nine_times(loop: VirtualTimeLoop) -> None:
    scheduler, rec = make(loop, lambda: 0.5)
    most_pending = 0
    for i in range(60_000):
        loop.advance_to(i * 0.001)
        scheduler.schedule("wss://a:9925", "db", {"event": i})
        most_pending = max(most_pending, scheduler.pending, len(loop.pending_timers()))
    loop.advance_to(60.0)

    expected = [0.3, 0.8, 1.7, 3.4, 6.7, 13.2, 26.1, 41.2, 56.3]
    assert rec.times() == [pytest.approx(t) for t in expected]
    assert most_pending == 1
    # The payload of each dispatch is the newest one submitted before it fired.
    assert [p["event"] for _, _, _, p in rec.dispatches] == [round(t * 1000) - 1 for t in expected]
    assert scheduler.requests == 60_000
    assert scheduler.dispatched == 9
    # One setup per dispatch, and the one armed at 56.3 s that is still pending when the storm ends: the armed
    # callback (the log line) tracks attempts, not the 60,000 events.
    assert scheduler.armed == 10
    assert scheduler.pending == 1
    assert len(rec.armed) == 10
    assert [round(t, 6) for t, *_ in rec.armed] == [0.0, *expected]
    assert [d for *_, d in rec.armed] == [
        pytest.approx(d) for d in [0.3, 0.5, 0.9, 1.7, 3.3, 6.5, 12.9, 15.1, 15.1, 15.1]
    ]


def test_schedule_reports_newly_armed_and_replaces_the_payload(loop: VirtualTimeLoop) -> None:
    scheduler, rec = make(loop, lambda: 0.5)
    assert scheduler.schedule("wss://a:1", "db", "first") is True
    assert scheduler.is_armed("wss://a:1", "db")
    assert scheduler.schedule("wss://a:1", "db", "second") is False
    assert scheduler.schedule("wss://a:1", "db", "third") is False
    assert scheduler.pending == 1
    assert len(rec.armed) == 1
    loop.advance(0.3)
    assert rec.dispatches == [(pytest.approx(0.3), "wss://a:1", "db", "third")]
    assert not scheduler.is_armed("wss://a:1", "db")
    assert (scheduler.requests, scheduler.armed, scheduler.dispatched, scheduler.pending) == (3, 1, 1, 0)


def test_pairs_are_independent(loop: VirtualTimeLoop) -> None:
    scheduler, rec = make(loop, lambda: 0.5)
    scheduler.schedule("wss://a:1", "db1", 1)
    scheduler.schedule("wss://a:1", "db2", 2)
    scheduler.schedule("wss://b:1", "db1", 3)
    assert scheduler.pending == 3
    loop.advance(0.3)
    assert sorted(p for *_, p in rec.dispatches) == [1, 2, 3]


def test_refresh_pending_replaces_only_an_armed_payload(loop: VirtualTimeLoop) -> None:
    scheduler, rec = make(loop, lambda: 0.5)
    assert scheduler.refresh_pending("wss://a:1", "db", "nothing armed") is False
    scheduler.schedule("wss://a:1", "db", "old")
    assert scheduler.refresh_pending("wss://a:1", "db", "enriched") is True
    assert scheduler.requests == 1  # a refresh is not a setup request
    loop.advance(0.3)
    assert [p for *_, p in rec.dispatches] == ["enriched"]
    assert scheduler.refresh_pending("wss://a:1", "db", "after fire") is False
    loop.advance(60)
    assert len(rec.dispatches) == 1


def test_dispatch_may_schedule_again_the_pair_is_no_longer_armed(loop: VirtualTimeLoop) -> None:
    seen: list[bool] = []

    def dispatch(url: str, database: str, payload: Any) -> None:
        seen.append(scheduler.is_armed(url, database))
        if payload < 2:
            scheduler.schedule(url, database, payload + 1)

    scheduler = SetupScheduler(dispatch, loop=loop, rng=lambda: 0.5)
    scheduler.schedule("wss://a:1", "db", 0)
    loop.advance(10)
    assert seen == [False, False, False]
    assert scheduler.dispatched == 3


# Invariant 3: connect resets without cancelling, cancellation ---------------------------------------------------


def test_note_connected_resets_the_delay_and_cancels_nothing(loop: VirtualTimeLoop) -> None:
    scheduler, rec = make(loop, lambda: 0.5)
    for _ in range(4):  # escalate: dispatches at 0.3, 0.8, 1.7, 3.4
        scheduler.schedule("wss://a:1", "db", "x")
        loop.advance(20)
    loop.advance_to(100.0)
    scheduler.schedule("wss://a:1", "db", "armed before the connect")  # attempt 4: 3.3 s
    scheduler.note_connected("wss://a:1", "db")
    assert scheduler.is_armed("wss://a:1", "db")
    loop.advance_to(103.3)
    assert rec.dispatches[-1] == (pytest.approx(103.3), "wss://a:1", "db", "armed before the connect")
    scheduler.schedule("wss://a:1", "db", "after reset")
    loop.advance(1)
    assert rec.dispatches[-1][0] == pytest.approx(103.6)  # back to the first delay, 0.3 s
    scheduler.note_connected("wss://unknown:1", "db")  # a report for a pair never scheduled is harmless


def test_cancel_disarms_and_forgets_the_schedule(loop: VirtualTimeLoop) -> None:
    scheduler, rec = make(loop, lambda: 0.5)
    scheduler.schedule("wss://a:1", "db", "x")
    loop.advance(0.3)
    scheduler.schedule("wss://a:1", "db", "second attempt")  # would fire at 0.8
    assert scheduler.cancel("wss://a:1", "db") is True
    assert scheduler.cancel("wss://a:1", "db") is False
    assert scheduler.pending == 0
    assert loop.pending_timers() == []
    loop.advance(60)
    assert len(rec.dispatches) == 1
    scheduler.schedule("wss://a:1", "db", "fresh")
    loop.advance(0.3)
    assert rec.dispatches[-1] == (pytest.approx(60.6), "wss://a:1", "db", "fresh")  # schedule forgotten


def test_cancel_peer_cancels_every_database_of_that_url_only(loop: VirtualTimeLoop) -> None:
    scheduler, rec = make(loop, lambda: 0.5)
    for database in ("db1", "db2", "db3"):
        scheduler.schedule("wss://a:1", database, database)
    scheduler.schedule("wss://b:1", "db1", "b")
    loop.advance(0.3)
    scheduler.schedule("wss://a:1", "db1", "again")
    assert scheduler.cancel_peer("wss://a:1") == 1  # one was armed; the others' schedules are forgotten too
    assert scheduler.pending == 0
    loop.advance(60)
    assert sorted(p for *_, p in rec.dispatches) == ["b", "db1", "db2", "db3"]
    scheduler.schedule("wss://a:1", "db2", "fresh")
    assert rec.armed[-1][-1] == pytest.approx(0.3)


def test_close_disarms_everything(loop: VirtualTimeLoop) -> None:
    scheduler, rec = make(loop, lambda: 0.5)
    scheduler.schedule("wss://a:1", "db", 1)
    scheduler.schedule("wss://b:1", "db", 2, sweep=scheduler.sweep())
    scheduler.close()
    assert scheduler.pending == 0
    assert loop.pending_timers() == []
    loop.advance(60)
    assert rec.dispatches == []


def test_a_dispatch_exception_is_logged_and_contained(
    loop: VirtualTimeLoop, capsys: pytest.CaptureFixture[str]
) -> None:
    loop_errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: loop_errors.append(context))
    calls: list[Any] = []

    def dispatch(url: str, database: str, payload: Any) -> None:
        calls.append(payload)
        if payload == "boom":
            raise RuntimeError("worker pipe closed (test_a_dispatch_exception_is_logged_and_contained)")

    scheduler = SetupScheduler(dispatch, loop=loop, rng=lambda: 0.5)
    scheduler.schedule("wss://a:1", "db", "boom")
    scheduler.schedule("wss://b:1", "db", "fine")
    loop.advance(0.3)
    assert sorted(calls) == ["boom", "fine"]
    assert loop_errors == []
    assert scheduler.dispatched == 2
    assert scheduler.pending == 0
    events = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    failures = [e for e in events if e["event"] == "subscription_setup_dispatch_failed"]
    assert len(failures) == 1
    assert failures[0]["level"] == "error"
    assert failures[0]["url"] == "wss://a:1" and failures[0]["database"] == "db"
    assert "worker pipe closed" in failures[0]["error"]
    assert scheduler.schedule("wss://a:1", "db", "retry") is True


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"floor": -1.0}, "floor"),
        ({"initial": 0.0}, "initial"),
        ({"maximum": 0.1}, "maximum"),
        ({"stagger": -0.05}, "stagger"),
        ({"stagger": float("nan")}, "stagger"),
    ],
)
def test_bad_schedule_arguments_fail_at_construction(
    loop: VirtualTimeLoop, kwargs: dict[str, float], name: str
) -> None:
    with pytest.raises(ValueError, match=name):
        SetupScheduler(lambda *_: None, loop=loop, rng=lambda: 0.5, **kwargs)


# Invariant 2: sweeps (seed finding #805) -------------------------------------------------------------------------


def test_sweep_over_fresh_escalated_and_armed_pairs_keeps_stagger(loop: VirtualTimeLoop) -> None:
    rng = Draws()
    scheduler, rec = make(loop, rng)
    # "c" escalated: two dispatches, so its next ceiling is 1.6 s.
    rng.push(0.5, 0.5)
    scheduler.schedule("wss://c:1", "db", "c")
    loop.advance_to(0.3)
    scheduler.schedule("wss://c:1", "db", "c")
    loop.advance_to(9.9)
    # "d" already armed outside the sweep, to fire at 10.22.
    rng.push(0.6)
    scheduler.schedule("wss://d:1", "db", "d")
    loop.advance_to(10.0)

    sweep = scheduler.sweep()
    rng.push(0.995, 0.0, 0.0725)  # own delays: a 0.399 s, b 0.2 s, c 0.3015 s
    assert scheduler.schedule("wss://a:1", "db", "a", sweep=sweep) is True
    assert scheduler.schedule("wss://b:1", "db", "b", sweep=sweep) is True
    assert scheduler.schedule("wss://c:1", "db", "c", sweep=sweep) is True
    assert scheduler.schedule("wss://d:1", "db", "d", sweep=sweep) is False
    assert not rng.queue

    # The seed's ladder (own delay + k * stagger; an armed setup untouched) would have fired a at 10.399 and c at
    # 10.4015, 2.5 ms apart, and b at 10.25 next to d at 10.22.
    naive = {"a": 10.399, "b": 10.2 + STAGGER, "c": 10.3015 + 2 * STAGGER, "d": 10.22}
    assert abs(naive["a"] - naive["c"]) < STAGGER and abs(naive["b"] - naive["d"]) < STAGGER

    loop.advance_to(20.0)
    fired = {p: t for t, _, _, p in rec.dispatches if t >= 10.0}
    assert fired == {
        "b": pytest.approx(10.2),
        "d": pytest.approx(10.25),  # moved off b's slot, to the earliest free time after its own
        "c": pytest.approx(10.3015),
        "a": pytest.approx(10.399),
    }
    assert_spaced(list(fired.values()))


def test_sweep_moves_a_colliding_draw_to_the_next_free_slot(loop: VirtualTimeLoop) -> None:
    scheduler, rec = make(loop, Draws(0.5, 0.5, 0.5, 0.0, 0.75))
    sweep = scheduler.sweep()
    for n in range(5):
        scheduler.schedule(url(n), "db", n, sweep=sweep)
    # Own delays 0.3, 0.3, 0.3, 0.2, 0.35: the duplicates take the next free slots, 0.2 and 0.35 stay.
    assert [d for *_, d in rec.armed] == [pytest.approx(d) for d in (0.3, 0.35, 0.4, 0.2, 0.45)]
    assert sweep.claimed == pytest.approx((0.2, 0.3, 0.35, 0.4, 0.45))
    loop.advance(1)
    assert rec.times() == [pytest.approx(t) for t in (0.2, 0.3, 0.35, 0.4, 0.45)]
    assert_spaced(rec.times())


def test_a_pair_backed_off_past_20s_does_not_delay_healthy_pairs(loop: VirtualTimeLoop) -> None:
    rng = Draws()
    scheduler, rec = make(loop, rng)
    rng.push(*[0.5] * 7)
    for _ in range(7):  # 0.3 + 0.5 + 0.9 + 1.7 + 3.3 + 6.5 + 12.9: attempt 7 has a 30 s ceiling
        scheduler.schedule("wss://slow:1", "db", "slow")
        loop.advance(30)
    start = loop.time()
    sweep = scheduler.sweep()
    rng.push(0.9, 0.5, 0.5, 0.5, 0.0)
    scheduler.schedule("wss://slow:1", "db", "slow", sweep=sweep)  # 0.2 + 0.9 * 29.8 = 27.02 s
    for n in range(4):
        scheduler.schedule(url(n), "db", n, sweep=sweep)
    loop.advance(60)
    fired = {p: t - start for t, _, _, p in rec.dispatches if t > start}
    assert fired == {
        0: pytest.approx(0.3),
        1: pytest.approx(0.35),
        2: pytest.approx(0.4),
        3: pytest.approx(0.2),
        "slow": pytest.approx(27.02),
    }
    assert_spaced(list(fired.values()))


def test_an_armed_setup_keeps_its_time_when_it_does_not_collide(loop: VirtualTimeLoop) -> None:
    scheduler, rec = make(loop, Draws(0.5, 0.0))
    scheduler.schedule("wss://a:1", "db", "a")  # 0.3
    sweep = scheduler.sweep()
    scheduler.schedule("wss://b:1", "db", "b", sweep=sweep)  # 0.2
    assert scheduler.schedule("wss://a:1", "db", "a2", sweep=sweep) is False
    assert scheduler.schedule("wss://a:1", "db", "a3", sweep=sweep) is False  # already claimed: stays put
    assert len(loop.pending_timers()) == 2
    loop.advance(1)
    assert [(round(t, 9), p) for t, _, _, p in rec.dispatches] == [(0.2, "b"), (0.3, "a3")]


def test_an_armed_setup_in_two_sweeps_stays_clear_of_both(loop: VirtualTimeLoop) -> None:
    scheduler, rec = make(loop, Draws(0.5, 0.6, 0.35))
    first, second = scheduler.sweep(), scheduler.sweep()
    scheduler.schedule("wss://a:1", "db", "a", sweep=first)  # 0.3
    scheduler.schedule("wss://b:1", "db", "b", sweep=first)  # 0.32 -> 0.35
    scheduler.schedule("wss://c:1", "db", "c", sweep=second)  # 0.27
    # a joins the second sweep: 0.3 is too close to c at 0.27 there, and a still belongs to the first sweep,
    # where 0.35 is b's slot: the earliest time free in both is 0.4.
    scheduler.schedule("wss://a:1", "db", "a", sweep=second)
    loop.advance(1)
    fired = {p: t for t, _, _, p in rec.dispatches}
    assert fired == {"c": pytest.approx(0.27), "b": pytest.approx(0.35), "a": pytest.approx(0.4)}
    assert_spaced([fired["a"], fired["b"]])
    assert_spaced([fired["a"], fired["c"]])


def test_a_slot_outside_schedule_keeps_the_spacing_and_is_given_back_when_cancelled(loop: VirtualTimeLoop) -> None:
    scheduler, rec = make(loop, Draws(0.5, 0.5))
    sweep = scheduler.sweep()
    fired: list[tuple[float, str]] = []

    def force(name: str) -> None:
        fired.append((round(loop.time(), 9), name))

    scheduler.schedule("wss://a:1", "db", "a", sweep=sweep)  # 0.3
    first = scheduler.call_at_slot(sweep, 0.3, force, "x")  # 0.3 is a's: 0.35
    second = scheduler.call_at_slot(sweep, 0.0, force, "y")  # 0.0 is free: nothing was claimed within 0.05
    third = scheduler.call_at_slot(sweep, 0.3, force, "z")  # 0.4
    assert (first.when, second.when, third.when) == (pytest.approx(0.35), 0.0, pytest.approx(0.4))
    third.cancel()
    assert third.cancelled() and not first.cancelled()
    assert sweep.claimed == pytest.approx((0.0, 0.3, 0.35))  # the cancelled slot is free again
    scheduler.schedule("wss://b:1", "db", "b", sweep=sweep)  # 0.3 -> 0.4, the slot z gave back
    loop.advance(0.35)
    first.cancel()  # after it fired: nothing to cancel, and the slot of a dispatch that happened stays claimed
    assert not first.cancelled()
    assert sweep.claimed == pytest.approx((0.0, 0.3, 0.35, 0.4))
    loop.advance(1)
    assert fired == [(0.0, "y"), (0.35, "x")]
    assert rec.times() == [pytest.approx(0.3), pytest.approx(0.4)]
    assert loop.pending_timers() == []


def test_a_dispatch_that_fired_late_keeps_the_next_ones_stagger_after_it(loop: VirtualTimeLoop) -> None:
    """Timers fire late, never early: a loop held 180 ms (a long callback, a busy host) makes every due dispatch
    fire at once when it is free. The spacing holds between the dispatches as they happened, setups and slots taken
    outside `schedule` alike (the integration test of a killed worker saw 0.139 s between two, stagger 0.2 s)."""
    scheduler, rec = make(loop, Draws(0.0, 0.0))
    sweep = scheduler.sweep()
    fired: list[tuple[float, str]] = []
    scheduler.schedule("wss://a:1", "db", "a", sweep=sweep)  # due 0.2
    scheduler.schedule("wss://b:1", "db", "b", sweep=sweep)  # 0.2 is a's: due 0.25
    scheduler.call_at_slot(sweep, 0.25, lambda: fired.append((round(loop.time(), 9), "z")))  # due 0.3

    def hold_the_loop() -> None:
        loop._now = 0.33  # the callback ran 180 ms

    loop.call_at(0.15, hold_the_loop)
    loop.advance(1)
    assert rec.times() == [pytest.approx(0.33), pytest.approx(0.38)]
    assert fired == [(0.43, "z")]
    assert_spaced([*rec.times(), 0.43])
    assert loop.pending_timers() == []


pair_states = st.tuples(
    st.sampled_from(["fresh", "escalated", "armed"]),
    st.integers(1, 7),  # dispatches before the sweep, for "escalated"
    st.floats(0.0, 1.0, exclude_max=True),  # the draw for the sweep (or for arming, for "armed")
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(pair_states, min_size=2, max_size=16),
    st.sampled_from([0.0, 0.01, 0.05, 0.2]),
    st.lists(st.floats(0.0, 1.0, exclude_max=True), min_size=1, max_size=8),
)
def test_property_a_sweep_dispatches_at_least_stagger_apart(
    states: list[tuple[str, int, float]], stagger: float, escalation_draws: list[float]
) -> None:
    with VirtualTimeLoop() as loop:
        rng = Draws()
        scheduler, rec = make(loop, rng, stagger=stagger)
        for n, (state, dispatches, _) in enumerate(states):
            if state == "escalated":
                for k in range(dispatches):
                    rng.push(escalation_draws[k % len(escalation_draws)])
                    scheduler.schedule(url(n), "db", "escalate")
                    loop.advance(31)
        loop.advance(1)
        sweep_at = loop.time() + 0.15
        armed_at: dict[int, float] = {}
        for n, (state, _, draw) in enumerate(states):
            if state == "armed":
                rng.push(draw)
                scheduler.schedule(url(n), "db", "armed")
                armed_at[n] = loop.time() + rec.armed[-1][-1]
        loop.advance_to(sweep_at)
        assert scheduler.pending == len(armed_at)  # armed ones are still armed: every delay is >= 0.2 s
        sweep = scheduler.sweep()
        for n, (state, _, draw) in enumerate(states):
            if state != "armed":
                rng.push(draw)
            scheduler.schedule(url(n), "db", n, sweep=sweep)
        assert not rng.queue
        loop.advance(100)
        fired = {p: t for t, _, _, p in rec.dispatches if t >= sweep_at}
        assert sorted(fired) == list(range(len(states)))
        assert_spaced(list(fired.values()), stagger)
        for n, when in armed_at.items():
            assert fired[n] >= when - SPACING_SLACK  # an armed setup is never pulled earlier


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.floats(0.0, 1.0, exclude_max=True), min_size=2, max_size=10),
    st.lists(st.integers(0, 9), max_size=10),
    st.lists(st.floats(0.0, 1.0, exclude_max=True), min_size=1, max_size=10),
)
def test_property_overlapping_sweeps_each_keep_their_spacing(
    first_draws: list[float], rejoin: list[int], second_draws: list[float]
) -> None:
    with VirtualTimeLoop() as loop:
        rng = Draws(*first_draws, *second_draws)
        scheduler, rec = make(loop, rng)
        first, second = scheduler.sweep(), scheduler.sweep()
        members: dict[int, set[int]] = {0: set(), 1: set()}
        for n in range(len(first_draws)):
            scheduler.schedule(url(n), "db", n, sweep=first)
            members[0].add(n)
        loop.advance(0.01)
        for n in rejoin:
            if n < len(first_draws):
                scheduler.schedule(url(n), "db", n, sweep=second)
                members[1].add(n)
        for k in range(len(second_draws)):
            n = 100 + k
            scheduler.schedule(url(n), "db", n, sweep=second)
            members[1].add(n)
        loop.advance(100)
        fired = {p: t for t, _, _, p in rec.dispatches}
        assert len(fired) == len(members[0] | members[1])
        for sweep_members in members.values():
            assert_spaced([fired[n] for n in sweep_members])


def test_sweep_tokens_do_not_grow_or_outlive_their_setups(loop: VirtualTimeLoop) -> None:
    scheduler, _ = make(loop, lambda: 0.5)
    long_lived = scheduler.sweep()
    for n in range(1000):  # a caller that keeps one token forever
        scheduler.schedule(url(n), "db", n, sweep=long_lived)
        loop.advance(1)
    assert len(long_lived.claimed) <= 2

    token: Sweep | None = scheduler.sweep()
    ref = weakref.ref(token)
    for n in range(5):
        scheduler.schedule(url(n), "other", n, sweep=token)
    token = None
    gc.collect()
    assert ref() is not None  # armed setups still need the claims to stay spaced
    loop.advance(1)
    gc.collect()
    assert ref() is None


# Invariant 11: no timer keeps a process alive -------------------------------------------------------------------

EXIT_SCRIPT = """
import asyncio
from replicator.coordinator.setup_scheduler import SetupScheduler

async def main():
    loop = asyncio.get_running_loop()
    scheduler = SetupScheduler(lambda *a: None, loop=loop, floor=30.0, initial=30.0, maximum=30.0)
    assert scheduler.schedule("wss://a:9925", "db", None) is True
    assert scheduler.pending == 1

asyncio.run(main())
print("exited")
"""


def test_a_process_with_an_armed_30s_setup_exits_promptly() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", EXIT_SCRIPT],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=25,
        check=False,
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "exited"
    assert elapsed < 10.0


def test_an_armed_setup_does_not_hold_asyncio_run_open() -> None:
    dispatched: list[str] = []

    async def main() -> int:
        scheduler = SetupScheduler(
            lambda *_: dispatched.append("x"),
            loop=asyncio.get_running_loop(),
            floor=30.0,
            initial=30.0,
            maximum=30.0,
        )
        scheduler.schedule("wss://a:9925", "db", None)
        return scheduler.pending

    started = time.monotonic()
    assert asyncio.run(main()) == 1
    assert time.monotonic() - started < 5.0
    assert dispatched == []
