from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from replicator.shared.retry_budget import RetryBudget
from tests.unit.fakeloop import VirtualTimeLoop


class Clock:
    """Only `time()`: what the budget needs of a loop."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def time(self) -> float:
        return self.now


def test_a_full_bucket_grants_its_burst_at_once_then_skips(loop: VirtualTimeLoop) -> None:
    budget = RetryBudget(2.0, 3.0, loop=loop)
    assert [budget.take() for _ in range(5)] == [True, True, True, False, False]
    assert budget.tokens == 0.0
    assert (budget.granted, budget.deferred) == (3, 2)


def test_a_skipped_retry_takes_nothing_and_the_next_token_comes_a_refill_interval_later(
    loop: VirtualTimeLoop,
) -> None:
    budget = RetryBudget(4.0, 1.0, loop=loop)
    assert budget.take()
    loop.advance(0.125)
    assert budget.tokens == 0.5
    assert not budget.take()  # half a token: skipped, and the half stays
    loop.advance(0.125)
    assert budget.tokens == 1.0
    assert budget.take()
    assert not budget.take()


def test_tokens_refill_at_the_rate_up_to_the_burst(loop: VirtualTimeLoop) -> None:
    budget = RetryBudget(0.5, 4.0, loop=loop)
    for _ in range(4):
        assert budget.take()
    loop.advance(3.0)
    assert budget.tokens == 1.5
    loop.advance(1000.0)
    assert budget.tokens == 4.0


def test_a_refund_hands_a_token_back_but_never_past_the_burst(loop: VirtualTimeLoop) -> None:
    budget = RetryBudget(1.0, 2.0, loop=loop)
    assert budget.take() and budget.take()
    assert not budget.take()
    budget.refund()  # the retry connected: it costs nothing
    assert budget.tokens == 1.0
    budget.refund()
    budget.refund()
    assert budget.tokens == 2.0
    assert budget.refunded == 3


@pytest.mark.parametrize(
    ("rate", "burst", "error"),
    [
        (0.0, 1.0, ValueError),
        (-1.0, 1.0, ValueError),
        (math.inf, 1.0, ValueError),
        (math.nan, 1.0, ValueError),
        (1.0, 0.5, ValueError),
        (1.0, math.inf, ValueError),
        (True, 1.0, TypeError),
        ("1", 1.0, TypeError),
    ],
)
def test_a_bad_rate_or_burst_fails_at_construction(rate: object, burst: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        RetryBudget(rate, burst, loop=Clock())  # type: ignore[arg-type]


@given(
    rate=st.floats(0.01, 100.0),
    burst=st.integers(1, 20),
    steps=st.lists(st.tuples(st.floats(0.0, 5.0), st.booleans()), min_size=1, max_size=200),
)
def test_by_any_time_t_at_most_burst_plus_rate_t_failed_retries_have_gone(
    rate: float, burst: int, steps: list[tuple[float, bool]]
) -> None:
    """Whatever the retries ask when, and whichever of them connect (and hand their token back), the failed ones
    that went number at most burst + rate * t by time t."""
    clock = Clock()
    budget = RetryBudget(rate, float(burst), loop=clock)
    failed: list[float] = []
    for gap, connects in steps:
        clock.now += gap
        if budget.take():
            if connects:
                budget.refund()
            else:
                failed.append(clock.now)
    for count, when in enumerate(failed, start=1):
        assert count <= burst + rate * when + 1e-9
