"""A worker's side of confirmations and session tokens (issue 22; the rules: `shared.confirm`).

- `Relays`: what the node knows other nodes hold of each database, as the coordinator hands it over
  (`messages.Holders`); the subscriber sessions pass it on in their `wire.Holds`.
- `Waiters`: the writes of this worker waiting for confirmations. The coordinator counts them
  (`coordinator.confirmations`) and answers each ticket at once and whenever its count rises.
- `covered`: a read's wait until this node's file covers a token.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from replicator.shared import confirm, messages
from replicator.shared.store import Database
from replicator.workers.changes import ChangeFeed

# Requests of one worker that may wait at once for confirmations, and reads for a token: each costs a ticket at the
# coordinator or a look at the file per commit, so a crowd of clients is refused (503) before anything is written.
MAX_WAITING_WRITES = 4096
MAX_WAITING_READS = 1024


class Relays:
    """What the node knows each other node holds complete of each database: node -> origin -> complete."""

    def __init__(self) -> None:
        self._known: dict[str, dict[str, dict[str, int]]] = {}
        self._changed: dict[str, asyncio.Event] = {}

    def update(self, database: str, known: dict[str, dict[str, int]]) -> bool:
        """The coordinator's latest; True (and the sessions of the database woken) when it changed."""
        if self._known.get(database, {}) == known:
            return False
        self._known[database] = known
        event = self._changed.pop(database, None)
        if event is not None:
            event.set()
        return True

    def get(self, database: str, peer: str) -> dict[str, dict[str, int]]:
        """What a session to `peer` relays: everything known of the database but the peer's own position."""
        return {node: held for node, held in self._known.get(database, {}).items() if node != peer}

    async def wait(self, database: str, timeout: float) -> None:
        """Return when what is known of `database` changes, or after `timeout`."""
        event = self._changed.setdefault(database, asyncio.Event())
        try:
            async with asyncio.timeout(timeout):
                await event.wait()
        except TimeoutError:
            pass

    def forget(self, database: str) -> None:
        self._known.pop(database, None)
        event = self._changed.pop(database, None)
        if event is not None:
            event.set()


@dataclass
class Outcome:
    confirmed: int  # how many other nodes hold the write
    done: bool  # as many as it needed
    nodes: list[str] = field(default_factory=list)
    gone: bool = False  # the database stopped being held here meanwhile


@dataclass
class _Ticket:
    outcome: Outcome
    changed: asyncio.Event


class Waiters:
    """This worker's writes waiting for confirmations, by ticket."""

    def __init__(self, report: Callable[[msgspec.Struct], None]) -> None:
        self._report = report
        self._tickets: dict[int, _Ticket] = {}
        self._numbers = itertools.count(1)

    async def wait(self, database: str, origin: str, version: int, need: int, timeout: float) -> Outcome:
        """Wait until `need` other nodes hold `origin` complete up to `version`, at most `timeout` seconds; the
        outcome says how many did."""
        if need <= 0:
            return Outcome(confirmed=0, done=True)
        ticket = next(self._numbers)
        waiting = _Ticket(Outcome(confirmed=0, done=False), asyncio.Event())
        self._tickets[ticket] = waiting
        self._report(messages.ConfirmWait(ticket=ticket, database=database, origin=origin, version=version, need=need))
        try:
            async with asyncio.timeout(timeout):
                while not waiting.outcome.done:
                    await waiting.changed.wait()
                    waiting.changed.clear()
        except TimeoutError:
            pass
        finally:
            del self._tickets[ticket]
            if not waiting.outcome.done:
                # Timed out, or the client went away (cancelled): the coordinator stops counting.
                self._report(messages.ConfirmCancel(ticket=ticket))
        return waiting.outcome

    def answered(self, message: messages.Confirmed) -> None:
        """The coordinator's count for a ticket (one that timed out meanwhile is forgotten)."""
        waiting = self._tickets.get(message.ticket)
        if waiting is None:
            return
        waiting.outcome = Outcome(
            confirmed=message.confirmed, done=message.done or message.gone, nodes=message.nodes, gone=message.gone
        )
        waiting.changed.set()

    def pending(self) -> int:
        return len(self._tickets)

    def full(self) -> bool:
        return len(self._tickets) >= MAX_WAITING_WRITES


async def covered(db: Database, feed: ChangeFeed, token: dict[str, int], timeout: float) -> dict[str, int]:
    """Wait until `db` holds every origin of `token` complete up to its version, at most `timeout` seconds, woken
    by the file's commits (`workers.changes`, whichever process made them). Returns what is still missing: origin
    -> the version held of it ({} once covered)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        version = db.data_version()
        missing = confirm.missing(token, db.progress())
        left = deadline - loop.time()
        if not missing or left <= 0:
            return missing
        if db.data_version() == version:  # no commit since progress was read: it is current, wait for the next
            await feed.wait(left)
