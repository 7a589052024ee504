"""A real asyncio event loop on a virtual clock, for unit tests.

`VirtualTimeLoop` is a `SelectorEventLoop` whose `time()` is virtual and whose selector never blocks: when the loop
would wait for its next timer, the clock jumps to that timer instead. Coroutines, tasks, futures and `call_later`
behave as on a real loop, only in virtual time and instantly. `advance()` / `advance_to()` run the loop until the
clock reaches the target, firing everything due on the way, in order, and nothing later.

A loop that would block with no timer armed raises instead of hanging the test.
"""

from __future__ import annotations

import asyncio
import selectors
from typing import Any


class VirtualClockBlocked(RuntimeError):
    """The loop would wait for I/O forever: no ready callback and no timer."""


class _VirtualSelector(selectors.DefaultSelector):
    """Polls real file descriptors (the loop's self-pipe) without waiting; a wait becomes a jump of the clock."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualTimeLoop | None = None

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        events = super().select(0)
        if events or timeout == 0 or self.loop is None:
            return events
        if timeout is None:
            raise VirtualClockBlocked("the virtual-time loop would block forever: nothing is ready or scheduled")
        self.loop._jump(timeout)
        return events


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self, start: float = 0.0) -> None:
        selector = _VirtualSelector()
        super().__init__(selector)
        selector.loop = self
        self._now = float(start)
        # Timers due within this much of now fire now; covers float rounding in `now + delay`.
        self._clock_resolution = 1e-9
        self._target: float | None = None
        self._rounds = 0

    def time(self) -> float:
        return self._now

    def _jump(self, timeout: float) -> None:
        target = self._now + timeout
        scheduled: list[asyncio.TimerHandle] = self._scheduled  # type: ignore[attr-defined]
        if scheduled and scheduled[0].when() <= target + self._clock_resolution:
            # Land exactly on the timer's time rather than on now + (when - now), which can be off by an ulp.
            target = max(self._now, scheduled[0].when())
        self._now = target

    def pending_timers(self) -> list[asyncio.TimerHandle]:
        """Armed timers that have not been cancelled, earliest first."""
        scheduled: list[asyncio.TimerHandle] = self._scheduled  # type: ignore[attr-defined]
        return sorted((h for h in scheduled if not h.cancelled()), key=lambda h: h.when())

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"cannot advance by a negative time: {seconds!r}")
        self.advance_to(self._now + seconds)

    def advance_to(self, when: float) -> None:
        """Run until the clock reads `when`: every callback due at or before it runs, nothing after it."""
        if when < self._now:
            raise ValueError(f"cannot go back in time: {when!r} < {self._now!r}")
        ready: Any = self._ready  # type: ignore[attr-defined]
        scheduled: list[asyncio.TimerHandle] = self._scheduled  # type: ignore[attr-defined]
        if not ready and (not scheduled or scheduled[0].when() >= when + self._clock_resolution):
            self._now = when  # nothing due: skip the loop machinery
            return
        self._target = when
        self._rounds = 0
        self.call_at(when, self._arrive)
        try:
            self.run_forever()
        finally:
            self._target = None
        if self._rounds > 100_000:
            raise RuntimeError(f"callbacks kept rescheduling themselves at t={when}: a busy loop")
        self._now = when

    def _arrive(self) -> None:
        # Callbacks made ready at the target time (task steps, call_soon, call_later(0)) still belong to it.
        ready: Any = self._ready  # type: ignore[attr-defined]
        scheduled: list[asyncio.TimerHandle] = self._scheduled  # type: ignore[attr-defined]
        due = scheduled and scheduled[0].when() < self._now + self._clock_resolution
        self._rounds += 1
        if (ready or due) and self._rounds <= 100_000:
            self.call_soon(self._arrive)
        else:
            self.stop()

    def run(self, awaitable: Any) -> Any:
        """`run_until_complete`, in virtual time."""
        return self.run_until_complete(awaitable)

    def shutdown(self) -> None:
        """Cancel what tests left running, then close; safe to call twice."""
        if self.is_closed():
            return
        try:
            tasks = [t for t in asyncio.all_tasks(self) if not t.done()]
            for task in tasks:
                task.cancel()
            if tasks:
                self.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self.run_until_complete(self.shutdown_asyncgens())
        finally:
            self.close()

    def __enter__(self) -> VirtualTimeLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
