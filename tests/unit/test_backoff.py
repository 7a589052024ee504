from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from replicator.shared.backoff import Backoff


def draws(*values: float) -> Callable[[], float]:
    """An rng that returns exactly these draws, then fails the test if asked for more."""
    it = iter(values)

    def rng() -> float:
        try:
            return next(it)
        except StopIteration:
            raise AssertionError("rng asked for more draws than the test supplied") from None

    return rng


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def take(backoff: Backoff, n: int) -> list[float | None]:
    return [backoff.next_delay() for _ in range(n)]


def close(values: Iterable[float | None]) -> list[object]:
    return [v if v is None else pytest.approx(v, abs=1e-12) for v in values]


# Exact sequences per mode ---------------------------------------------------------------------------------------


def test_full_jitter_sequence_of_the_setup_site() -> None:
    b = Backoff(initial=0.4, maximum=30.0, floor=0.2, rng=lambda: 0.5)
    assert take(b, 10) == close([0.3, 0.5, 0.9, 1.7, 3.3, 6.5, 12.9, 15.1, 15.1, 15.1])
    assert b.attempts == 10


def test_full_jitter_spans_floor_to_ceiling() -> None:
    b = Backoff(initial=1.0, maximum=8.0, floor=0.5, rng=draws(0.0, 0.25, 0.999, 0.0, 0.5))
    # ceilings 1, 2, 4, 8, 8
    assert take(b, 5) == close([0.5, 0.5 + 0.25 * 1.5, 0.5 + 0.999 * 3.5, 0.5, 0.5 + 0.5 * 7.5])


def test_full_jitter_without_floor_can_draw_zero_which_is_not_exhaustion() -> None:
    b = Backoff(initial=1.0, maximum=4.0, rng=lambda: 0.0)
    assert take(b, 3) == [0.0, 0.0, 0.0]
    assert not b.exhausted


def test_equal_jitter_sequence() -> None:
    b = Backoff(initial=1.0, maximum=8.0, jitter="equal", rng=draws(0.0, 0.0, 0.5, 0.5, 0.999))
    # ceilings 1, 2, 4, 8, 8: draws in [ceiling / 2, ceiling)
    assert take(b, 5) == close([0.5, 1.0, 3.0, 6.0, 4.0 + 0.999 * 4.0])


def test_equal_jitter_respects_a_floor_above_half_the_ceiling() -> None:
    b = Backoff(initial=1.0, maximum=8.0, floor=0.8, jitter="equal", rng=draws(0.5, 0.5))
    # lo = max(0.8, 0.5) for the first attempt, max(0.8, 1.0) for the second
    assert take(b, 2) == close([0.9, 1.5])


def test_no_jitter_is_the_capped_ceiling() -> None:
    b = Backoff(initial=0.4, maximum=30.0, jitter="none", rng=draws())
    assert take(b, 9) == close([0.4, 0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 30.0, 30.0])


def test_floor_lifts_the_ceiling() -> None:
    b = Backoff(initial=0.1, maximum=1.0, floor=0.5, jitter="none")
    assert b.ceiling == 0.5
    assert take(b, 5) == close([0.5, 0.5, 0.5, 0.8, 1.0])


def test_factor_one_is_constant() -> None:
    b = Backoff(initial=2.0, maximum=5.0, factor=1.0, jitter="none")
    assert take(b, 4) == [2.0, 2.0, 2.0, 2.0]


def test_decorrelated_sequence() -> None:
    b = Backoff(initial=1.0, maximum=10.0, jitter="decorrelated", rng=lambda: 0.5)
    # d = min(10, max(0, 1 + 0.5 * (3 * d_prev - 1))), d_prev starting at 1
    assert take(b, 6) == close([2.0, 3.5, 5.75, 9.125, 10.0, 10.0])


def test_decorrelated_floor_and_ceiling() -> None:
    b = Backoff(initial=1.0, maximum=10.0, floor=2.5, jitter="decorrelated", rng=draws(0.0, 0.999))
    assert b.ceiling == 3.0  # the largest first draw: 3 * initial
    assert b.next_delay() == 2.5
    assert b.ceiling == 7.5
    assert b.next_delay() == pytest.approx(1.0 + 0.999 * 6.5)


def test_reset_starts_over() -> None:
    b = Backoff(initial=0.4, maximum=30.0, floor=0.2, rng=lambda: 0.5)
    take(b, 6)
    assert b.ceiling == 25.6
    b.reset()
    assert b.attempts == 0
    assert b.ceiling == 0.4
    assert b.next_delay() == pytest.approx(0.3)


def test_decorrelated_reset_forgets_the_previous_delay() -> None:
    b = Backoff(initial=1.0, maximum=10.0, jitter="decorrelated", rng=lambda: 0.5)
    take(b, 3)
    b.reset()
    assert b.next_delay() == 2.0


def test_a_schedule_that_never_exhausts_does_not_overflow() -> None:
    b = Backoff(initial=0.5, maximum=30.0, floor=0.5, jitter="none")
    delays = take(b, 5000)
    assert delays[:8] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert set(delays[6:]) == {30.0}
    assert b.attempts == 5000
    assert b.ceiling == 30.0


# Budget and attempt cap ---------------------------------------------------------------------------------------


def test_budget_is_a_deadline_and_clamps_the_last_delay() -> None:
    clock = Clock(100.0)
    b = Backoff(initial=4.0, maximum=30.0, jitter="none", budget=10.0, clock=clock)
    assert b.next_delay() == 4.0
    clock.now = 104.0
    assert b.next_delay() == 6.0  # ceiling 8, 6 s left
    clock.now = 110.0
    assert b.exhausted
    assert b.next_delay() is None
    assert b.next_delay() is None
    assert b.attempts == 2


def test_budget_counts_time_not_requested_sleeps() -> None:
    clock = Clock()
    b = Backoff(initial=0.5, maximum=5.0, jitter="none", budget=30.0, clock=clock)
    assert b.next_delay() == 0.5
    clock.now = 29.9  # the caller stalled for half a minute after asking for 0.5 s
    assert b.next_delay() == pytest.approx(0.1)
    clock.now = 30.0
    assert b.next_delay() is None


def test_reset_restarts_the_budget() -> None:
    clock = Clock()
    b = Backoff(initial=1.0, maximum=4.0, jitter="none", budget=5.0, clock=clock)
    clock.now = 7.0
    assert b.next_delay() is None
    b.reset()
    assert not b.exhausted
    assert b.next_delay() == 1.0
    clock.now = 11.5
    assert b.next_delay() == pytest.approx(0.5)
    clock.now = 12.0
    assert b.next_delay() is None


def test_max_attempts() -> None:
    b = Backoff(initial=1.0, maximum=4.0, jitter="none", max_attempts=3)
    assert take(b, 5) == [1.0, 2.0, 4.0, None, None]
    assert b.attempts == 3
    assert b.exhausted
    b.reset()
    assert take(b, 4) == [1.0, 2.0, 4.0, None]


def test_an_exhausted_schedule_does_not_draw() -> None:
    b = Backoff(initial=1.0, maximum=4.0, max_attempts=1, rng=draws(0.5))
    assert b.next_delay() == 0.5
    assert b.next_delay() is None  # `draws` would fail on a second draw


# Validation -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"initial": 0.0}, "initial"),
        ({"initial": -1.0}, "initial"),
        ({"initial": math.nan}, "initial"),
        ({"maximum": math.inf}, "maximum"),
        ({"initial": 2.0, "maximum": 1.0}, "maximum"),
        ({"floor": -0.1}, "floor"),
        ({"floor": 31.0}, "floor"),
        ({"factor": 0.5}, "factor"),
        ({"jitter": "random"}, "jitter"),
        ({"budget": 0.0}, "budget"),
        ({"budget": -5.0}, "budget"),
        ({"max_attempts": 0}, "max_attempts"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        Backoff(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"initial": "1"}, "initial"),
        ({"max_attempts": 2.5}, "max_attempts"),
        ({"max_attempts": True}, "max_attempts"),
        ({"rng": 0.5}, "rng"),
        ({"clock": None}, "clock"),
    ],
)
def test_arguments_of_the_wrong_type_are_named(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(TypeError, match=name):
        Backoff(**kwargs)  # type: ignore[arg-type]


# Properties ------------------------------------------------------------------------------------------------------

EPS = 1e-9
unit_draws = st.lists(st.floats(0.0, 1.0, exclude_max=True), min_size=1, max_size=40)


@st.composite
def schedules(draw: st.DrawFn) -> dict[str, object]:
    initial = draw(st.floats(0.01, 10.0))
    maximum = draw(st.floats(initial, 100.0))
    floor = draw(st.floats(0.0, maximum))
    factor = draw(st.floats(1.0, 4.0))
    jitter = draw(st.sampled_from(["full", "equal", "decorrelated", "none"]))
    return {"initial": initial, "maximum": maximum, "floor": floor, "factor": factor, "jitter": jitter}


@given(schedules(), unit_draws)
def test_every_delay_is_within_its_mode_bounds(params: dict[str, object], rs: list[float]) -> None:
    it = iter(rs)
    b = Backoff(**params, rng=lambda: next(it))  # type: ignore[arg-type]
    floor, maximum, jitter = params["floor"], params["maximum"], params["jitter"]
    assert isinstance(floor, float) and isinstance(maximum, float)
    previous_ceiling = b.ceiling
    for n in range(len(rs)):
        ceiling = b.ceiling
        delay = b.next_delay()
        assert delay is not None
        assert b.attempts == n + 1
        assert floor - EPS <= delay <= ceiling + EPS
        assert delay <= maximum + EPS
        assert ceiling <= maximum
        if jitter == "equal":
            assert delay >= max(floor, ceiling / 2) - EPS
        elif jitter == "none":
            assert delay == ceiling
        if jitter != "decorrelated":
            # the exponential ceiling only grows, and stops at the maximum
            assert ceiling >= previous_ceiling
            previous_ceiling = ceiling


@given(schedules(), st.integers(0, 200))
def test_ceiling_is_capped_however_long_the_schedule_runs(params: dict[str, object], n: int) -> None:
    b = Backoff(**params, rng=lambda: 0.999)  # type: ignore[arg-type]
    for _ in range(n):
        b.next_delay()
    assert b.ceiling <= params["maximum"]  # type: ignore[operator]
    assert b.ceiling >= params["floor"]  # type: ignore[operator]


@given(
    schedules(),
    st.floats(0.1, 60.0),
    st.lists(st.tuples(st.floats(0.0, 1.0, exclude_max=True), st.floats(0.0, 20.0)), min_size=1, max_size=40),
)
def test_budget_clamps_to_the_deadline(
    params: dict[str, object], budget: float, steps: list[tuple[float, float]]
) -> None:
    clock = Clock(1000.0)
    rs = iter([r for r, _ in steps])
    b = Backoff(**params, budget=budget, rng=lambda: next(rs), clock=clock)  # type: ignore[arg-type]
    deadline = 1000.0 + budget
    for _, elapsed in steps:
        attempts = b.attempts
        exhausted = b.exhausted
        delay = b.next_delay()
        if clock.now >= deadline:
            assert exhausted
            assert delay is None
            assert b.attempts == attempts  # exhaustion does not advance the schedule
        else:
            assert not exhausted
            assert delay is not None
            assert delay <= deadline - clock.now + EPS
            assert b.attempts == attempts + 1
        clock.now += elapsed


@given(st.floats(0.1, 60.0), st.floats(0.0, 1000.0))
def test_reset_restarts_the_budget_from_now(budget: float, later: float) -> None:
    clock = Clock()
    b = Backoff(initial=0.5, maximum=5.0, budget=budget, rng=lambda: 0.5, clock=clock)
    clock.now = budget + later
    assert b.next_delay() is None
    b.reset()
    assert not b.exhausted
    delay = b.next_delay()
    assert delay is not None and 0 < delay <= budget + EPS
    clock.now += budget
    assert b.exhausted
    assert b.next_delay() is None


@given(schedules(), st.integers(1, 20), st.integers(0, 10))
def test_max_attempts_exhausts_without_advancing(params: dict[str, object], cap: int, extra: int) -> None:
    b = Backoff(**params, max_attempts=cap, rng=lambda: 0.5)  # type: ignore[arg-type]
    delays = take(b, cap + extra)
    assert all(d is not None for d in delays[:cap])
    assert delays[cap:] == [None] * extra
    assert b.attempts == cap
