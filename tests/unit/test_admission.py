from __future__ import annotations

import asyncio
import json
import tracemalloc
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replicator.workers import admission as admission_module
from replicator.workers.admission import WorkerAdmission
from tests.unit.fakeloop import VirtualTimeLoop


class Readiness:
    """A readiness the test controls: each await fails while `failures` is positive, or waits for `open()`."""

    def __init__(
        self, loop: VirtualTimeLoop, failures: int = 0, opened: bool = False, error: str = "store not open yet"
    ) -> None:
        self.loop = loop
        self.failures = failures
        self.error = error
        self.calls: list[float] = []
        self._opened = asyncio.Event()
        if opened:
            self._opened.set()

    def open(self) -> None:
        self._opened.set()

    async def __call__(self) -> None:
        self.calls.append(self.loop.time())
        if self.failures:
            self.failures -= 1
            raise OSError(self.error)
        await self._opened.wait()


class Handled:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def __call__(self, action: str, message: Any) -> None:
        self.calls.append((action, message))


def tasks_of(loop: VirtualTimeLoop) -> set[asyncio.Task[Any]]:
    return {t for t in asyncio.all_tasks(loop) if not t.done()}


def test_60000_actions_before_readiness_give_one_dispatch_the_latest(loop: VirtualTimeLoop) -> None:
    ready, handled = Readiness(loop), Handled()
    gate = WorkerAdmission(ready, handled, loop=loop, rng=lambda: 0.5)
    for i in range(60_000):
        action = "force_reconnect" if i % 7 == 3 else "subscribe"
        gate.submit("wss://a:9925#db", action, {"n": i})
        if i % 1000 == 0:
            loop.advance(0.001)
    assert gate.pending == 1
    assert len(tasks_of(loop)) == 1  # one continuation, not one per message
    assert ready.calls == [0.0]
    ready.open()
    loop.advance(0.001)
    assert handled.calls == [("subscribe", {"n": 59_999})]
    assert gate.admitted and gate.pending == 0
    assert tasks_of(loop) == set()


def test_subscribe_then_unsubscribe_leaves_nothing(loop: VirtualTimeLoop) -> None:
    ready, handled = Readiness(loop), Handled()
    gate = WorkerAdmission(ready, handled, loop=loop)
    gate.submit("k#db", "subscribe", "s")
    assert gate.pending == 1
    gate.submit("k#db", "unsubscribe", "u")
    assert gate.pending == 0
    gate.submit("k#db", "unsubscribe", "u again")
    assert gate.pending == 0
    ready.open()
    loop.advance(0)
    assert gate.admitted
    assert handled.calls == []


def test_force_reconnect_rides_on_a_retained_subscribe_and_is_dropped_alone(loop: VirtualTimeLoop) -> None:
    ready, handled = Readiness(loop), Handled()
    gate = WorkerAdmission(ready, handled, loop=loop)
    gate.submit("a#db", "force_reconnect", "bounce a")
    assert gate.pending == 0
    gate.submit("b#db", "subscribe", "sub b")
    gate.submit("b#db", "force_reconnect", "bounce b")
    assert gate.pending == 1
    ready.open()
    loop.advance(0)
    assert handled.calls == [("subscribe", "sub b")]


def test_retained_actions_drain_in_insertion_order(loop: VirtualTimeLoop) -> None:
    ready, handled = Readiness(loop), Handled()
    gate = WorkerAdmission(ready, handled, loop=loop)
    for key in ("a", "b", "c", "d"):
        gate.submit(key, "subscribe", f"{key}1")
    gate.submit("b", "subscribe", "b2")  # newest message, same place
    gate.submit("c", "unsubscribe", None)
    gate.submit("c", "subscribe", "c2")  # removed, then retained again: now last
    ready.open()
    loop.advance(0)
    assert handled.calls == [("subscribe", m) for m in ("a1", "b2", "d1", "c2")]


@pytest.mark.parametrize("admitted", [False, True])
def test_unknown_actions_are_rejected(loop: VirtualTimeLoop, admitted: bool) -> None:
    ready, handled = Readiness(loop, opened=True), Handled()
    gate = WorkerAdmission(ready, handled, loop=loop)
    if admitted:
        gate.submit("k", "unsubscribe", None)
        loop.advance(0)
        assert gate.admitted
    with pytest.raises(ValueError, match="action"):
        gate.submit("k", "resubscribe", None)
    assert gate.pending == 0
    assert handled.calls == []


def test_a_rejected_readiness_arms_exactly_one_reattempt_at_the_backoff_time(loop: VirtualTimeLoop) -> None:
    ready, handled = Readiness(loop, failures=4, opened=True), Handled()
    gate = WorkerAdmission(ready, handled, loop=loop, rng=lambda: 0.5)
    gate.submit("k#db", "subscribe", "m")
    loop.advance(0)
    assert ready.calls == [0.0]
    assert len(loop.pending_timers()) == 1
    assert tasks_of(loop) == set()
    for _ in range(50):  # more submits while the re-attempt is armed start nothing new
        gate.submit("k#db", "subscribe", "newest")
    assert len(loop.pending_timers()) == 1 and tasks_of(loop) == set()
    assert gate.readiness_attempts == 1

    loop.advance(30)
    # 0.2 floor, 0.4 -> 30 s ceiling, full jitter, draw 0.5: 0.3, 0.5, 0.9, 1.7 after each failure.
    assert ready.calls == [pytest.approx(t) for t in (0.0, 0.3, 0.8, 1.7, 3.4)]
    assert gate.admitted
    assert gate.readiness_attempts == 0  # the schedule starts over on success
    assert handled.calls == [("subscribe", "newest")]
    assert loop.pending_timers() == []


def test_a_zero_draw_still_waits_the_floor(loop: VirtualTimeLoop) -> None:
    ready = Readiness(loop, failures=2, opened=True)
    gate = WorkerAdmission(ready, Handled(), loop=loop, rng=lambda: 0.0)
    gate.submit("k", "subscribe", None)
    loop.advance(1)
    assert ready.calls == [pytest.approx(t) for t in (0.0, 0.2, 0.4)]
    assert gate.admitted


def test_a_readiness_failure_is_logged(loop: VirtualTimeLoop, capsys: pytest.CaptureFixture[str]) -> None:
    ready = Readiness(loop, failures=1, opened=True, error="test_a_readiness_failure_is_logged")
    gate = WorkerAdmission(ready, Handled(), loop=loop, rng=lambda: 0.5)
    gate.submit("k", "subscribe", None)
    loop.advance(0)
    events = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    failures = [e for e in events if e["event"] == "admission_readiness_failed"]
    assert len(failures) == 1
    assert failures[0]["delay_s"] == 0.3 and failures[0]["attempt"] == 1


def test_after_readiness_handlers_run_inline(loop: VirtualTimeLoop) -> None:
    ready = Readiness(loop, opened=True)
    inside: list[tuple[str, Any, int]] = []

    def handle(action: str, message: Any) -> None:
        inside.append((action, message, gate.pending))

    gate = WorkerAdmission(ready, handle, loop=loop)
    gate.submit("a", "subscribe", "before")
    loop.advance(0)
    assert gate.admitted
    gate.submit("a", "force_reconnect", "bounce")
    assert inside[-1] == ("force_reconnect", "bounce", 0)  # ran before submit returned
    gate.submit("a", "unsubscribe", "bye")
    assert inside[-1] == ("unsubscribe", "bye", 0)
    assert tasks_of(loop) == set()
    assert loop.pending_timers() == []


def test_after_readiness_submit_allocates_nothing(loop: VirtualTimeLoop) -> None:
    count = 0

    def handle(action: str, message: Any) -> None:
        nonlocal count
        count += 1

    gate = WorkerAdmission(Readiness(loop, opened=True), handle, loop=loop)
    gate.submit("a", "subscribe", None)
    loop.advance(0)
    message = object()
    for _ in range(100):  # warm up
        gate.submit("a", "subscribe", message)
    in_admission = [tracemalloc.Filter(True, admission_module.__file__)]
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot().filter_traces(in_admission)
        for _ in range(10_000):
            gate.submit("a", "subscribe", message)
            gate.submit("a", "unsubscribe", message)
        after = tracemalloc.take_snapshot().filter_traces(in_admission)
    finally:
        tracemalloc.stop()
    grown = [stat for stat in after.compare_to(before, "lineno") if stat.size_diff > 0]
    assert grown == []
    assert count == 100 + 1 + 20_000
    assert gate.pending == 0


def test_a_handler_exception_during_the_drain_is_contained(
    loop: VirtualTimeLoop, capsys: pytest.CaptureFixture[str]
) -> None:
    ready = Readiness(loop)
    seen: list[str] = []

    def handle(action: str, message: str) -> None:
        seen.append(message)
        if message == "bad":
            raise KeyError("test_a_handler_exception_during_the_drain_is_contained")

    loop_errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: loop_errors.append(context))
    gate = WorkerAdmission(ready, handle, loop=loop)
    for key, message in (("a", "ok1"), ("b", "bad"), ("c", "ok2")):
        gate.submit(key, "subscribe", message)
    ready.open()
    loop.advance(0)
    assert seen == ["ok1", "bad", "ok2"]
    assert gate.admitted
    assert loop_errors == []
    events = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    assert [e["key"] for e in events if e["event"] == "admission_handle_failed"] == ["b"]


def test_a_handler_may_submit_during_the_drain(loop: VirtualTimeLoop) -> None:
    ready = Readiness(loop)
    seen: list[tuple[str, str]] = []

    def handle(action: str, message: str) -> None:
        seen.append((action, message))
        if message == "a":
            gate.submit("c", "unsubscribe", "drop c")  # c has not been handled yet
            gate.submit("a", "subscribe", "a again")

    gate = WorkerAdmission(ready, handle, loop=loop)
    for key in ("a", "b", "c"):
        gate.submit(key, "subscribe", key)
    ready.open()
    loop.advance(0)
    assert seen == [("subscribe", "a"), ("subscribe", "b"), ("subscribe", "a again")]
    assert gate.admitted and gate.pending == 0


def test_close_cancels_the_continuation_and_the_armed_reattempt(loop: VirtualTimeLoop) -> None:
    ready, handled = Readiness(loop, failures=1), Handled()
    gate = WorkerAdmission(ready, handled, loop=loop, rng=lambda: 0.5)
    gate.submit("k", "subscribe", "m")
    loop.advance(0)
    assert len(loop.pending_timers()) == 1
    gate.close()
    assert loop.pending_timers() == []
    assert gate.pending == 0
    gate.submit("k", "subscribe", "after close")
    assert gate.pending == 0
    loop.advance(60)
    assert ready.calls == [0.0]
    assert handled.calls == []

    waiting = Readiness(loop)
    other = WorkerAdmission(waiting, handled, loop=loop)
    other.submit("k", "subscribe", "m")
    loop.advance(1)
    (task,) = tasks_of(loop)
    loop.run(other.aclose())
    assert task.cancelled()
    assert tasks_of(loop) == set()


def test_churn_of_10000_keys_against_a_rejecting_readiness_stays_bounded(loop: VirtualTimeLoop) -> None:
    ready, handled = Readiness(loop, failures=10**9, opened=True), Handled()
    gate = WorkerAdmission(ready, handled, loop=loop, rng=lambda: 0.5)
    live: dict[str, int] = {}
    most = 0
    for n in range(10_000):
        key = f"wss://peer{n}:9925#db{n % 7}"
        gate.submit(key, "subscribe", n)
        if n % 100 == 0:
            live[key] = n  # one in a hundred stays subscribed
        else:
            gate.submit(key, "force_reconnect", n)
            gate.submit(key, "unsubscribe", n)
        most = max(most, gate.pending)
        assert gate.pending == len(live)
        loop.advance(0.01)
    assert most == 100
    assert len(ready.calls) > 5  # readiness kept being re-attempted, and kept failing
    assert len(loop.pending_timers()) == 1
    ready.failures = 0
    loop.advance(60)
    assert gate.admitted
    assert handled.calls == [("subscribe", n) for n in live.values()]


keys = st.sampled_from(["a#db", "b#db", "c#db", "a#other", "e#db"])
actions = st.sampled_from(["subscribe", "unsubscribe", "force_reconnect"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(keys, actions), max_size=60))
def test_property_pending_is_bounded_by_subscribed_keys_and_exactly_those_are_handled(
    steps: list[tuple[str, str]],
) -> None:
    with VirtualTimeLoop() as loop:
        ready, handled = Readiness(loop), Handled()
        gate = WorkerAdmission(ready, handled, loop=loop, rng=lambda: 0.5)
        last_change: dict[str, tuple[str, int]] = {}  # key -> (last subscribe/unsubscribe, its step)
        for n, (key, action) in enumerate(steps):
            gate.submit(key, action, (key, n))
            if action != "force_reconnect":
                last_change[key] = (action, n)
            subscribed = {k for k, (a, _) in last_change.items() if a == "subscribe"}
            assert gate.pending <= len({k for k, _ in steps[: n + 1]})
            assert gate.pending == len(subscribed)
        ready.open()
        loop.advance(0)
        expected = {("subscribe", (k, n)) for k, (a, n) in last_change.items() if a == "subscribe"}
        assert sorted(handled.calls) == sorted(expected)
        assert len(handled.calls) == len(expected)
        assert gate.pending == 0
