"""The send-auth reprobe: a peer whose certificate is valid but whose registry row has not arrived yet.

A new node dials its peers as soon as it boots, often before its row (its own, or an introduction of it) has
spread to every node it dials. Refusing it at once would make it back off for up to 30 s for nothing; admitting it
unregistered would let any certificate in. So the node asks again, on the seed's schedule (0.5 s doubling to 5 s,
full jitter, a 30 s budget, at most 120 attempts), and admits the peer as soon as the row is there. When the schedule
runs out the answer stays no (fail closed), logged once as `send_auth_refused` with the reason. Anything else that
refuses a certificate (its name is this node's own, it is revoked) is final at once: there is nothing to wait for.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable

from replicator.shared.backoff import Backoff

INITIAL = 0.5
MAXIMUM = 5.0
BUDGET = 30.0
MAX_ATTEMPTS = 120


async def reprobe(
    check: Callable[[], str | None],
    waiting: Callable[[str], bool],
    *,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    rng: Callable[[], float] = random.random,
    clock: Callable[[], float] = time.monotonic,
    budget: float = BUDGET,
) -> tuple[str | None, int]:
    """Ask `check()` (None: admitted, else the reason) until it admits, its refusal is final (`waiting(reason)` is
    False), or the schedule runs out (`budget` seconds, `replication.send_auth_budget`; 0 asks once). Returns the
    last refusal (None when admitted) and how many times it asked."""
    backoff = Backoff(
        initial=INITIAL,
        maximum=MAXIMUM,
        jitter="full",
        budget=budget or None,
        max_attempts=MAX_ATTEMPTS,
        rng=rng,
        clock=clock,
    )
    attempts = 1
    refusal = check()
    while refusal is not None and budget > 0 and waiting(refusal):
        delay = backoff.next_delay()
        if delay is None:
            break
        await sleep(delay)
        attempts += 1
        refusal = check()
    return refusal, attempts
