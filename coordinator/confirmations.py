"""Who holds what: the positions of the other nodes, and the writes waiting for confirmations (issue 22).

A write asked to be confirmed by N other nodes is answered once N of them hold it durably: their position
(`complete`) for the write's origin has reached its version. The node learns positions two ways:

- **Directly**, from its senders (`messages.PeerHolds`): a subscriber acknowledges each batch once it has applied
  it with its marks, so the sender knows at once how far the subscriber is complete for what it serves; its `Holds`
  adds what it gets over other links.
- **Relayed**, for a node this one has no session with (a cut link with its origin failed over, a line): every
  subscriber's `Holds` carries what its own node knows of the others (`others`), which this node's coordinator
  merges here and hands to its workers (`messages.Holders`), whose sessions pass it on the same way. So knowledge
  flows along the same paths as the data does.

Positions only rise here (the highest report wins). A report from before a node lost its file stays, and it can
never confirm a later write: a version is above every position reported before it was made.

The waiters belong to the worker that took the write (`slot`, `ticket`). Each is answered at once with the count it
has, and again whenever the count rises, with `done` once it reaches what the write needs; the worker answers its
client (or a 504 at its timeout, and cancels). A worker that exits takes its waiters with it. Relayed knowledge is
pushed to the workers at most every PUSH_DELAY, for the databases that changed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from replicator.shared import messages
from replicator.shared.confirm import count

PUSH_DELAY = 0.02  # seconds: changes of one burst of reports reach the workers together


@dataclass
class Waiter:
    origin: str
    version: int
    need: int
    reported: int = -1  # the count the worker was last told


@dataclass
class Confirmations:
    name: str  # this node
    loop: asyncio.AbstractEventLoop
    # Sends a message to a worker slot; False when it cannot be delivered.
    send: Callable[[int, messages.Confirmed | messages.Holders], bool]
    # The worker slots alive now, for the relay pushes.
    slots: Callable[[], Collection[int]]
    # database -> node -> origin -> complete
    known: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    _waiting: dict[str, dict[tuple[int, int], Waiter]] = field(default_factory=dict)
    _changed: set[str] = field(default_factory=set)
    _push: asyncio.TimerHandle | None = None
    confirmed: int = 0  # writes whose confirmations were all in (for tests and /status)

    # -- positions ------------------------------------------------------------------------------------------------

    def held(self, database: str, node: str, complete: Mapping[str, int]) -> None:
        """A subscriber's position, from this node's sender of its pair."""
        if self._merge(database, node, complete):
            self._settle(database)

    def relayed(self, database: str, others: Mapping[str, Mapping[str, int]], registry: Collection[str]) -> None:
        """What a subscriber's node knows of other nodes; only nodes of the registry are kept (a peer cannot make
        this node remember names without end)."""
        changed = False
        for node, complete in others.items():
            if node != self.name and node in registry:
                changed = self._merge(database, node, complete) or changed
        if changed:
            self._settle(database)

    def _merge(self, database: str, node: str, complete: Mapping[str, int]) -> bool:
        held = self.known.setdefault(database, {}).setdefault(node, {})
        changed = False
        for origin, version in complete.items():
            if version > held.get(origin, 0):
                held[origin] = version
                changed = True
        if changed:
            self._changed.add(database)
            self._arm()
        return changed

    def _arm(self) -> None:
        if self._push is None:
            self._push = self.loop.call_later(PUSH_DELAY, self._push_changes)

    def forget_node(self, node: str) -> None:
        """The node left the registry: what it held no longer confirms anything."""
        for database, nodes in self.known.items():
            if nodes.pop(node, None) is not None:
                self._changed.add(database)
                self._arm()

    def forget_database(self, database: str) -> None:
        """The database is no longer held here (deleted, removed): its positions and waiters go."""
        if self.known.pop(database, None) is not None:
            self._changed.add(database)  # the workers forget it too
            self._arm()
        for (slot, ticket), waiter in self._waiting.pop(database, {}).items():
            self.send(slot, messages.Confirmed(ticket=ticket, confirmed=max(waiter.reported, 0), done=True, gone=True))

    def holders(self, database: str) -> dict[str, dict[str, int]]:
        """What this node knows each other node holds complete of `database` (a copy)."""
        return {node: dict(complete) for node, complete in self.known.get(database, {}).items()}

    def _push_changes(self) -> None:
        self._push = None
        changed, self._changed = self._changed, set()
        for database in sorted(changed):
            self.push(database)

    def push(self, database: str, slots: Collection[int] | None = None) -> None:
        """Hand what the node knows of `database` to the workers (or to `slots`), for their sessions to relay."""
        message = messages.Holders(database=database, known=self.holders(database))
        for slot in self.slots() if slots is None else slots:
            self.send(slot, message)

    def worker_ready(self, slot: int) -> None:
        """A worker (re)started: it relays what the node knows from now on."""
        for database in sorted(self.known):
            self.push(database, [slot])

    # -- waiters --------------------------------------------------------------------------------------------------

    def wait(self, slot: int, message: messages.ConfirmWait) -> None:
        """A write waits for `need` confirmations: answered with the count now, and as it rises."""
        waiter = Waiter(origin=message.origin, version=message.version, need=message.need)
        key = (slot, message.ticket)
        self._waiting.setdefault(message.database, {})[key] = waiter
        self._answer(message.database, key, waiter)

    def cancel(self, slot: int, ticket: int) -> None:
        """The write's client was answered without them (its timeout): stop counting for it."""
        for database, waiters in list(self._waiting.items()):
            if waiters.pop((slot, ticket), None) is not None and not waiters:
                del self._waiting[database]

    def worker_gone(self, slot: int) -> None:
        """The worker exited: its clients are gone with their connections."""
        for database, waiters in list(self._waiting.items()):
            for key in [key for key in waiters if key[0] == slot]:
                del waiters[key]
            if not waiters:
                del self._waiting[database]

    def waiting(self) -> int:
        return sum(len(waiters) for waiters in self._waiting.values())

    def close(self) -> None:
        if self._push is not None:
            self._push.cancel()
            self._push = None

    def _settle(self, database: str) -> None:
        for key, waiter in list(self._waiting.get(database, {}).items()):
            self._answer(database, key, waiter)

    def _answer(self, database: str, key: tuple[int, int], waiter: Waiter) -> None:
        # Only senders' subscribers and nodes of the registry are known, and a node leaving it is forgotten.
        held = count(self.known.get(database, {}), waiter.origin, waiter.version)
        nodes = [node for node in held if node != self.name]
        confirmed = len(nodes)
        if confirmed == waiter.reported:
            return
        waiter.reported = confirmed
        done = confirmed >= waiter.need
        slot, ticket = key
        delivered = self.send(slot, messages.Confirmed(ticket=ticket, confirmed=confirmed, done=done, nodes=nodes))
        if done or not delivered:
            waiters = self._waiting.get(database, {})
            waiters.pop(key, None)
            if not waiters:
                self._waiting.pop(database, None)
            if done:
                self.confirmed += 1
