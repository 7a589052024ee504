"""A retry budget: one token bucket shared by the retries a node makes toward one peer.

A `Backoff` paces one pair. It cannot see the other pairs of the same node, so a node holding P databases of a peer
that went away redials it P times per round, each pair on its own schedule. A budget bounds what the pairs spend
together: a redial takes a token, tokens come back at `rate` per second up to `burst`, and a redial that finds the
bucket empty is skipped: the pair waits another delay of its own schedule and asks again. By time t after a full
bucket at most `burst + rate * t` redials have gone.

Skipping rather than queueing is what keeps a node's recovery fast. A queue of reservations would hold its last pair
P / rate seconds (200 s for 1,000 pairs at 5 per second), long after the peer came back; a skipped pair comes back
within its own schedule, and the caller (`workers/session.py`) hands back the token of every redial that connected,
so once the peer accepts dials again the tokens flow back and the pairs get through on their schedules. Only
failed redials spend the budget. Like gRPC's retry throttling it drops a retry when the budget is spent; unlike it,
the link is never given up: the pair's own schedule brings the next attempt.

Time is injected: `loop.time()` (monotonic).
"""

from __future__ import annotations

import math
from typing import Protocol


class Clock(Protocol):
    """What the budget needs of a loop; an asyncio event loop qualifies."""

    def time(self) -> float: ...


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, not {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


class RetryBudget:
    """Tokens for retries: `rate` per second, at most `burst` saved up; see the module docstring."""

    __slots__ = ("_burst", "_loop", "_rate", "_stamp", "_tokens", "deferred", "granted", "refunded")

    def __init__(self, rate: float, burst: float, *, loop: Clock) -> None:
        rate = _positive("rate", rate)
        burst = _positive("burst", burst)
        if burst < 1:
            raise ValueError(f"burst must be >= 1 (one dial must be possible), got {burst!r}")
        self._rate = rate
        self._burst = burst
        self._loop = loop
        self._tokens = burst
        self._stamp = loop.time()
        self.granted = 0  # retries that found a token
        self.deferred = 0  # retries skipped: the bucket was spent
        self.refunded = 0

    @property
    def rate(self) -> float:
        return self._rate

    @property
    def burst(self) -> float:
        return self._burst

    @property
    def tokens(self) -> float:
        """Tokens in the bucket now."""
        self._refill(self._loop.time())
        return self._tokens

    def _refill(self, now: float) -> None:
        if now > self._stamp:
            self._tokens = min(self._burst, self._tokens + (now - self._stamp) * self._rate)
            self._stamp = now

    def take(self) -> bool:
        """Take a token for one retry if there is one now; False (nothing taken) when the bucket is spent."""
        self._refill(self._loop.time())
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            self.granted += 1
            return True
        self.deferred += 1
        return False

    def refund(self) -> None:
        """Hand back the token of a retry that succeeded (or was not made), never past the burst."""
        self._refill(self._loop.time())
        self._tokens = min(self._burst, self._tokens + 1.0)
        self.refunded += 1

    def __repr__(self) -> str:
        return f"RetryBudget(rate={self._rate!r}, burst={self._burst!r}, tokens={self.tokens:.3f})"
