"""The admission gate between the worker's pipe reader and its handlers, until the worker is ready.

Before readiness (store open, server listening) a subscribe cannot run, and the coordinator may keep re-sending
setups for the same pairs while it waits. Attaching one continuation per message to the readiness await made the
retained work grow with the number of messages; here one continuation awaits readiness and the gate retains at
most one action per key (connection key + database, see `shared.keys.pair_key`), the newest, in an
insertion-ordered map that is drained in order once the worker is ready. After that the gate is a direct call.

Only subscribes are ever retained. Before readiness no connection can exist, so an unsubscribe has nothing to tear
down: it removes a retained subscribe and leaves no tombstone behind (seed finding #807: tombstones made the map
grow by one entry per historic key under a readiness that kept failing). A force-reconnect next to a retained
subscribe is already served by it, since a fresh subscribe is a connect; with nothing retained there is nothing to
bounce.

A readiness that raises arms exactly one re-attempt on the admission schedule (0.2 s floor, 0.4 -> 30 s, full
jitter), which starts over once readiness succeeds.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Any

from replicator.shared.backoff import Backoff
from replicator.shared.logs import log

ACTIONS: frozenset[str] = frozenset(("subscribe", "unsubscribe", "force_reconnect"))

Ready = Callable[[], Awaitable[object]]
Handle = Callable[[str, Any], object]

_MISSING: Any = object()


class WorkerAdmission:
    """Retains the newest action per key until `ready()` returns, then runs handlers inline."""

    def __init__(
        self,
        ready: Ready,
        handle: Handle,
        *,
        loop: asyncio.AbstractEventLoop,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self._ready = ready
        self._handle = handle
        self._loop = loop
        self._schedule = Backoff(initial=0.4, maximum=30.0, floor=0.2, jitter="full", rng=rng, clock=loop.time)
        # key -> message of the newest retained subscribe; the only action ever retained.
        self._retained: dict[str, Any] = {}
        self._admitted = False
        self._closed = False
        self._task: asyncio.Task[None] | None = None
        self._retry: asyncio.TimerHandle | None = None

    @property
    def pending(self) -> int:
        """Actions retained until readiness."""
        return len(self._retained)

    @property
    def admitted(self) -> bool:
        """Readiness succeeded and the retained actions were drained: submits run inline."""
        return self._admitted

    @property
    def readiness_attempts(self) -> int:
        """Readiness awaits that raised since the last success."""
        return self._schedule.attempts

    def submit(self, key: str, action: str, message: Any) -> None:
        if action not in ACTIONS:
            raise ValueError(f"action must be one of {sorted(ACTIONS)}, got {action!r}")
        if self._admitted:
            self._handle(action, message)
            return
        if self._closed:
            return
        if action == "subscribe":
            self._retained[key] = message
        elif action == "unsubscribe":
            self._retained.pop(key, None)
        if self._task is None:
            self._start()

    def close(self) -> None:
        """Cancel the readiness continuation and any armed re-attempt; retained actions are dropped."""
        self._closed = True
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._retained.clear()

    async def aclose(self) -> None:
        """`close()`, then wait until the continuation has unwound."""
        self.close()
        if self._task is not None and not self._task.done():
            await asyncio.wait((self._task,))

    def _start(self) -> None:
        self._retry = None
        if not self._closed:
            self._task = self._loop.create_task(self._await_ready())

    async def _await_ready(self) -> None:
        try:
            await self._ready()
        except Exception as exc:
            delay = self._schedule.next_delay()
            assert delay is not None  # no budget and no attempt cap: this schedule never exhausts
            log.warning(
                "admission_readiness_failed",
                error=repr(exc),
                attempt=self._schedule.attempts,
                delay_s=round(delay, 3),
            )
            self._retry = self._loop.call_later(delay, self._start)
            return
        self._schedule.reset()
        self._drain()

    def _drain(self) -> None:
        retained = self._retained
        # A handler may submit again; those land in the same map (the gate is not open yet) and are drained in
        # a further round, and an unsubscribe it submits removes a subscribe not yet handled.
        while retained:
            for key in list(retained):
                message = retained.pop(key, _MISSING)
                if message is _MISSING:
                    continue
                try:
                    self._handle("subscribe", message)
                except Exception as exc:
                    log.error("admission_handle_failed", key=key, action="subscribe", error=repr(exc))
        self._retained = {}  # let go of the table the backlog grew
        self._admitted = True
