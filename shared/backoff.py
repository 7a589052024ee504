"""The one retry schedule of the code base.

Every retry site (reconnect, subscription setup, admission, watcher restart, send-auth reprobe, flush retry, clone
probes, blob repair, worker respawn) draws its delays from a `Backoff`; no other module computes an exponential, so
there is one place to read, test and tune how the node paces itself.

Full jitter is the default because the failures that trigger retries are correlated: a peer restarts, a resolver
hiccups or a worker exits, and every affected pair starts its schedule at the same instant. Drawing uniformly below
the ceiling decorrelates those pairs from the first retry on; a deterministic exponential keeps a whole fleet in
lockstep, so each retry wave hits the recovering peer all at once (seed issue #327: a storm that ended in an OOM).
The optional floor keeps a zero draw from becoming a busy retry.

A budget is a deadline on the injected monotonic clock, set at creation and at `reset()`, not a sum of the delays
handed out: a caller that stalls (a resolver hang, a blocked event loop) between retries cannot stretch a grace
period past what it advertises, and the last delay is clamped to the time left. An exhausted schedule answers
`None`, never 0, so a caller that forgets the check fails loudly instead of spinning.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from typing import Literal

Jitter = Literal["full", "equal", "decorrelated", "none"]
JITTERS: frozenset[str] = frozenset(("full", "equal", "decorrelated", "none"))


def _finite(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, not {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


class Backoff:
    """An exponential schedule with jitter, an optional floor, deadline budget and attempt cap.

    ceiling(n) = max(floor, min(initial * factor**n, maximum)) for attempt n (0-based), and a delay is drawn
    within it: "full" uniformly in [floor, ceiling), "equal" in [max(floor, ceiling / 2), ceiling), "none" is the
    ceiling itself, and "decorrelated" grows from the previous delay instead of the attempt count:
    d = min(maximum, max(floor, initial + r * (3 * d_prev - initial))), d_prev starting at initial.
    """

    __slots__ = (
        "_attempts",
        "_budget",
        "_clock",
        "_deadline",
        "_factor",
        "_floor",
        "_growth_limit",
        "_initial",
        "_jitter",
        "_max_attempts",
        "_maximum",
        "_previous",
        "_rng",
    )

    def __init__(
        self,
        initial: float = 0.4,
        maximum: float = 30.0,
        floor: float = 0.0,
        factor: float = 2.0,
        jitter: Jitter = "full",
        budget: float | None = None,
        max_attempts: int | None = None,
        rng: Callable[[], float] = random.random,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        initial = _finite("initial", initial)
        maximum = _finite("maximum", maximum)
        floor = _finite("floor", floor)
        factor = _finite("factor", factor)
        if initial <= 0:
            raise ValueError(f"initial must be > 0, got {initial!r}")
        if maximum < initial:
            raise ValueError(f"maximum must be >= initial ({initial!r}), got {maximum!r}")
        if floor < 0 or floor > maximum:
            raise ValueError(f"floor must be within [0, maximum ({maximum!r})], got {floor!r}")
        if factor < 1:
            raise ValueError(f"factor must be >= 1, got {factor!r}")
        if jitter not in JITTERS:
            raise ValueError(f"jitter must be one of {sorted(JITTERS)}, got {jitter!r}")
        if budget is not None:
            budget = _finite("budget", budget)
            if budget <= 0:
                raise ValueError(f"budget must be > 0 seconds, got {budget!r}")
        if max_attempts is not None:
            if isinstance(max_attempts, bool) or not isinstance(max_attempts, int):
                raise TypeError(f"max_attempts must be an int, not {type(max_attempts).__name__}")
            if max_attempts < 1:
                raise ValueError(f"max_attempts must be >= 1, got {max_attempts!r}")
        if not callable(rng):
            raise TypeError("rng must be callable")
        if not callable(clock):
            raise TypeError("clock must be callable")
        self._initial = initial
        self._maximum = maximum
        self._floor = floor
        self._factor = factor
        self._jitter: str = jitter
        self._budget = budget
        self._max_attempts = max_attempts
        self._rng = rng
        self._clock = clock
        # Past this exponent initial * factor**n is certainly >= maximum; capping n keeps a schedule that never
        # exhausts (reconnect to a dead peer for weeks) from overflowing a float.
        if factor == 1.0:
            self._growth_limit = 0
        else:
            self._growth_limit = max(0, math.ceil(math.log(maximum / initial) / math.log(factor))) + 1
        self._attempts = 0
        self._previous = initial
        self._deadline = None if budget is None else clock() + budget

    def _ceiling_at(self, n: int) -> float:
        grown = self._initial * self._factor ** min(n, self._growth_limit)
        return max(self._floor, min(grown, self._maximum))

    @property
    def attempts(self) -> int:
        """Delays handed out since creation or the last reset."""
        return self._attempts

    @property
    def ceiling(self) -> float:
        """The largest delay the next attempt can draw (before a budget clamp)."""
        if self._jitter == "decorrelated":
            return min(self._maximum, max(self._floor, 3.0 * self._previous))
        return self._ceiling_at(self._attempts)

    @property
    def exhausted(self) -> bool:
        if self._max_attempts is not None and self._attempts >= self._max_attempts:
            return True
        return self._deadline is not None and self._clock() >= self._deadline

    def next_delay(self) -> float | None:
        """The next delay in seconds, advancing the schedule; None once exhausted (which advances nothing)."""
        if self._max_attempts is not None and self._attempts >= self._max_attempts:
            return None
        left = None
        if self._deadline is not None:
            left = self._deadline - self._clock()
            if left <= 0:
                return None
        jitter = self._jitter
        floor = self._floor
        if jitter == "decorrelated":
            initial = self._initial
            delay = min(self._maximum, max(floor, initial + self._rng() * (3.0 * self._previous - initial)))
            self._previous = delay
        else:
            ceiling = self._ceiling_at(self._attempts)
            if jitter == "full":
                delay = floor + self._rng() * (ceiling - floor)
            elif jitter == "equal":
                low = max(floor, ceiling / 2.0)
                delay = low + self._rng() * (ceiling - low)
            else:
                delay = ceiling
        self._attempts += 1
        if left is not None and delay > left:
            return left
        return delay

    def reset(self) -> None:
        """Back to the first attempt; a budget starts over from now."""
        self._attempts = 0
        self._previous = self._initial
        if self._budget is not None:
            self._deadline = self._clock() + self._budget

    def __repr__(self) -> str:
        return f"Backoff(jitter={self._jitter!r}, attempts={self._attempts}, ceiling={self.ceiling:.3f})"
