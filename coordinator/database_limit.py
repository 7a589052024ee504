"""How many databases the peers' rows may make this node hold: `data.max_databases`, counted once per node.

A peer's registry row lists the databases it holds, and subscribing to one this node does not hold creates it here
when the session starts (`workers.dropped.open_for_subscription`). The coordinator subscribes to a database it
does not hold only while the node has room for it: the databases it holds and those its pairs are about to create
(`planned`) stay within the limit. What is left out is remembered per peer, reported (`database_limit_reached`,
`/status` `databases_over_limit`, `replicator_databases_over_limit`) and looked at again when room is made (a pair
of a database not held goes, a database is removed).

This is the plan; the workers' stores hold the limit itself: a file past it is never created, whoever asks (a
client, a subscription), under one lock of the data directory (`shared.store`). A client's create can take the room
a pair was planned for; that pair's sessions are then refused with the reason until room is made.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from replicator.shared.store import SYSTEM


class DatabaseLimit:
    def __init__(self) -> None:
        self._held: set[str] = set()  # the databases this node holds (the system database not counted)
        self._pairs: Counter[str] = Counter()  # database -> pairs this node has of it
        self._planned: set[str] = set()  # databases with a pair that are not held: a session will create them
        self._left_out: dict[str, tuple[str, ...]] = {}  # peer -> the databases it holds that were not taken

    @property
    def count(self) -> int:
        """The databases the node holds or has planned, as the limit counts them."""
        return len(self._held) + len(self._planned)

    def admit(self, peer: str, wanted: Iterable[str], limit: int) -> tuple[list[str], bool]:
        """Of the databases `wanted` from `peer`, in order, those to subscribe to: every one held or subscribed to
        already, and new ones while the node has room (each taken here counts against the room of the next); and
        whether what is left out of `peer`'s changed. The left out replace what was left out of `peer` before."""
        room = limit - self.count
        admitted: list[str] = []
        left: list[str] = []
        for database in wanted:
            if database == SYSTEM or database in self._held or database in self._pairs:
                admitted.append(database)
            elif room > 0:
                admitted.append(database)
                room -= 1
            else:
                left.append(database)
        before = self._left_out.get(peer, ())
        if left:
            self._left_out[peer] = tuple(left)
        else:
            self._left_out.pop(peer, None)
        return admitted, tuple(left) != before

    def left_out_of(self, peer: str) -> tuple[str, ...]:
        return self._left_out.get(peer, ())

    def left_out(self) -> list[str]:
        """Every database some peer holds that the limit kept off this node, sorted."""
        return sorted({database for databases in self._left_out.values() for database in databases})

    @property
    def waiting(self) -> bool:
        """Some peer holds a database the limit kept off this node: room made should be offered again."""
        return bool(self._left_out)

    def forget_peer(self, peer: str) -> None:
        self._left_out.pop(peer, None)

    def pair_added(self, database: str) -> None:
        self._pairs[database] += 1
        if database != SYSTEM and database not in self._held:
            self._planned.add(database)

    def pair_removed(self, database: str) -> bool:
        """True when this made room: the database's last pair went before any file of it was made here."""
        if database not in self._pairs:
            return False
        if self._pairs[database] == 1:
            del self._pairs[database]
            if database in self._planned:
                self._planned.discard(database)
                return True
            return False
        self._pairs[database] -= 1
        return False

    def held(self, database: str) -> None:
        """The node holds a file of `database` now (a worker opened or created it)."""
        if database == SYSTEM:
            return
        self._held.add(database)
        self._planned.discard(database)

    def removed(self, database: str) -> None:
        """The file of `database` is gone from this node."""
        self._held.discard(database)
        if database in self._pairs and database != SYSTEM:
            self._planned.add(database)
