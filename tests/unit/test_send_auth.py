"""The send-auth reprobe in virtual time: 0.5 s doubling to 5 s with full jitter, a 30 s budget, at most 120
attempts; admitted as soon as the row is there, final refusals at once, fail closed when the schedule runs out."""

from __future__ import annotations

import asyncio

from replicator.workers import send_auth
from tests.unit.fakeloop import VirtualTimeLoop

MISSING = "certificate name 'c' is not in the registry"


def _run(loop: VirtualTimeLoop, arrives_at: float | None, reason: str = MISSING) -> tuple[str | None, int, list[float]]:
    asked: list[float] = []

    def check() -> str | None:
        asked.append(round(loop.time(), 6))
        return None if arrives_at is not None and loop.time() >= arrives_at else reason

    async def main() -> tuple[str | None, int]:
        return await send_auth.reprobe(
            check,
            lambda why: why.endswith("is not in the registry"),
            sleep=asyncio.sleep,
            rng=lambda: 0.5,
            clock=loop.time,
        )

    refusal, attempts = loop.run_until_complete(main())
    return refusal, attempts, asked


def test_a_row_that_arrives_within_the_budget_admits_the_peer(loop: VirtualTimeLoop) -> None:
    refusal, attempts, asked = _run(loop, arrives_at=3.0)
    # Draws of 0.5 x the ceiling: 0.25, 0.5, 1, 2 ... the row is there at the fifth look.
    assert asked == [0.0, 0.25, 0.75, 1.75, 3.75]
    assert refusal is None and attempts == 5


def test_the_schedule_runs_out_after_the_budget_and_refuses(loop: VirtualTimeLoop) -> None:
    refusal, attempts, asked = _run(loop, arrives_at=None)
    assert refusal == MISSING
    # 0.25, 0.5, 1, 2, then 2.5 each (half the 5 s ceiling); the last wait ends at the 30 s budget, one last look.
    assert asked == [0.0, 0.25, 0.75, 1.75, 3.75] + [3.75 + 2.5 * k for k in range(1, 11)] + [30.0]
    assert attempts == 16


def test_a_final_refusal_is_not_asked_again(loop: VirtualTimeLoop) -> None:
    refusal, attempts, asked = _run(loop, arrives_at=None, reason="certificate of c (serial 1f) is revoked: c: all")
    assert refusal.startswith("certificate of c") if refusal else False
    assert attempts == 1 and asked == [0.0]


def test_the_attempt_cap_holds_even_with_tiny_delays(loop: VirtualTimeLoop) -> None:
    asked: list[float] = []

    def check() -> str | None:
        asked.append(loop.time())
        return MISSING

    async def main() -> tuple[str | None, int]:
        return await send_auth.reprobe(check, lambda why: True, sleep=asyncio.sleep, rng=lambda: 0.0, clock=loop.time)

    refusal, attempts = loop.run_until_complete(main())
    assert refusal == MISSING and attempts == send_auth.MAX_ATTEMPTS + 1 == len(asked)


def test_a_budget_of_zero_refuses_at_once(loop: VirtualTimeLoop) -> None:
    asked: list[float] = []

    def check() -> str | None:
        asked.append(loop.time())
        return MISSING

    async def main() -> tuple[str | None, int]:
        return await send_auth.reprobe(check, lambda why: True, sleep=asyncio.sleep, clock=loop.time, budget=0.0)

    assert loop.run_until_complete(main()) == (MISSING, 1) and asked == [0.0]
