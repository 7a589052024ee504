"""The recovery of a database whose file may lack this node's own writes: from `recovering` to `recovered`.

A file is recovering when it is a lost one (a new file of a database this node held before, a file moved aside as
damaged, one adopted from another node) or when a peer showed it went back in time (`DatabaseRegressed`, see
`shared.own_writes`). Its own origin counts only what peers have confirmed, and its subscriptions ask every peer to
serve the node's own writes back up to the file's floor. The recovery is over when every peer it replicates the
database with has served it: each of its pairs has connected since the recovery began (or since the latest
regression), asking for the own writes up to the latest regression's floor, and caught up. A peer that is down, or was
never dialled, is waited for: it may hold the only copy of an acknowledged write of this node (invariant 19), and
ending the recovery without it would promise peers a position past that write. The wait ends when the peer has
served, or when it is no longer a pair (removed from the registry, no longer holding the database).

A peer whose own file of the database is recovering too (`wire.Batch.recovering`) holds what it has got so far,
which may be less than it will: outside a full mesh, the only copy of one of this node's writes may lie beyond it,
on a node this one never talks to. Its caught-up counts once it is whole again, or when some other peer that is
whole has served, or when no node of the registry beyond the peers holds the database (every holder lost it: there
is nothing more to wait for, and two such nodes do not wait for each other). While a database recovers, its
subscriptions exclude no origin (`Node._payload`): whatever a peer holds of any origin comes, the node's own writes
that other links carry among it. Which peers hold a database is what the registry says, so no recovery
but the system database's own ends before the registry is whole (the system database recovered): a registry
taken from one peer may not know yet that another holds the database. A database that no peer holds has nothing
to wait for once the registry says so.

    RECOVERING --every pair served--> RECOVERED      (Database.finish_recovery, `database_recovered`)
    RECOVERED  --regression--------> RECOVERING      (a higher floor: every pair must serve again)
    RECOVERING --regression--------> RECOVERING      (likewise)
    any        --removed-----------> (forgotten)

The coordinator (`coordinator.node`) feeds it what the workers report and asks `ready` when something changed.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


class Phase(enum.Enum):
    RECOVERING = "recovering"
    RECOVERED = "recovered"


_ALLOWED: dict[Phase, frozenset[Phase]] = {
    Phase.RECOVERING: frozenset({Phase.RECOVERING, Phase.RECOVERED}),
    Phase.RECOVERED: frozenset({Phase.RECOVERING}),
}


class PairView(Protocol):
    """What the decision needs of a pair (`coordinator.replication_map.PairState`)."""

    connected: bool
    caught_up: bool
    connected_at: float | None
    own_upto: int
    peer_recovering: bool


@dataclass
class Recovery:
    database: str
    phase: Phase
    since: float  # wall clock: when this recovery began
    started: float  # loop clock: only sessions connected from then on can serve it
    floor: int = 0  # the floor of the latest regression (0: a lost file; its own floor is in the file)
    served: set[str] = field(default_factory=set)  # peers whose pair caught up in a session since `started`
    whole: set[str] = field(default_factory=set)  # ... at a time their own file of it was not recovering
    records: int = 0
    at: float | None = None  # wall clock: when it ended


class Recoveries:
    """Every recovery of this node's databases, in one place."""

    def __init__(self) -> None:
        self._recoveries: dict[str, Recovery] = {}

    def __contains__(self, database: str) -> bool:
        recovery = self._recoveries.get(database)
        return recovery is not None and recovery.phase is Phase.RECOVERING

    def recovering(self) -> list[str]:
        """The databases recovering now, the system database first (the registry it holds decides the others)."""
        names = [name for name, r in self._recoveries.items() if r.phase is Phase.RECOVERING]
        return sorted(names, key=lambda name: (name != "system", name))

    def get(self, database: str) -> Recovery | None:
        return self._recoveries.get(database)

    def floor(self, database: str) -> int:
        """The regression floor the database's subscriptions carry (0 when it never regressed)."""
        recovery = self._recoveries.get(database)
        return recovery.floor if recovery is not None else 0

    def _enter(self, recovery: Recovery, phase: Phase) -> None:
        if phase not in _ALLOWED[recovery.phase]:
            raise RuntimeError(f"recovery of {recovery.database}: {recovery.phase.value} -> {phase.value}")
        recovery.phase = phase

    # -- what the node tells ---------------------------------------------------------------------------------

    def begin(self, database: str, *, wall: float, now: float) -> None:
        """The database's file is recovering (found so at boot, or created so): a recovery starts unless one runs."""
        if database in self:
            return
        previous = self._recoveries.get(database)
        floor = previous.floor if previous is not None else 0
        self._recoveries[database] = Recovery(database, Phase.RECOVERING, since=wall, started=now, floor=floor)

    def regressed(self, database: str, floor: int, *, wall: float, now: float) -> bool:
        """A peer showed the file went back in time, to `floor`: True when that is above the known floor (the
        subscriptions must ask again, and every pair must serve again)."""
        recovery = self._recoveries.get(database)
        if recovery is not None and floor <= recovery.floor:
            return False
        if recovery is None:
            recovery = Recovery(database, Phase.RECOVERING, since=wall, started=now)
            self._recoveries[database] = recovery
        else:
            if recovery.phase is Phase.RECOVERED:
                recovery.since = wall
                recovery.at = None
            self._enter(recovery, Phase.RECOVERING)
        recovery.floor = floor
        recovery.started = now
        recovery.served.clear()
        recovery.whole.clear()
        return True

    def caught_up(self, database: str, peer: str, pair: PairView) -> None:
        """The pair with `peer` reported caught up: it served the recovery if its session began after it did."""
        recovery = self._recoveries.get(database)
        if recovery is None or recovery.phase is not Phase.RECOVERING:
            return
        _note(recovery, peer, pair)

    def forget(self, database: str) -> None:
        """The database is no longer held here."""
        self._recoveries.pop(database, None)

    # -- the decision ----------------------------------------------------------------------------------------

    def ready(
        self,
        database: str,
        pairs: Mapping[str, PairView],
        *,
        holders: Callable[[], Collection[str]],
        registry_trusted: bool,
    ) -> bool:
        """May the recovery of `database` end? `pairs`: by peer, the pairs this node has for it now.
        `holders`: the other nodes of the registry that hold the database (asked only when it matters);
        `registry_trusted`: the registry this node holds is whole (its system database is not recovering). Records
        the pairs that serve it now."""
        recovery = self._recoveries.get(database)
        if recovery is None or recovery.phase is not Phase.RECOVERING:
            return False
        for peer, pair in pairs.items():
            _note(recovery, peer, pair)
        if database != "system" and not registry_trusted:
            return False  # who else holds it is not known yet
        if not pairs:
            # No peer to hear from: for the system database the registry it holds is all there is.
            return database == "system" or not holders()
        if not all(peer in recovery.served for peer in pairs):
            return False
        if any(peer in recovery.whole for peer in pairs):
            return True
        # Every peer served it while recovering it too: what lies beyond them reaches this node once they are whole.
        return not set(holders()) - set(pairs)

    def waiting_for(self, database: str, peers: Iterable[str]) -> list[str]:
        """Of `peers` (the database's pairs), those the recovery still waits for: the ones that have not served
        it, or, when all have but each while recovering it too, all of them (for one to be whole)."""
        recovery = self._recoveries.get(database)
        if recovery is None or recovery.phase is not Phase.RECOVERING:
            return []
        peers = sorted(peers)
        missing = [peer for peer in peers if peer not in recovery.served]
        if missing or any(peer in recovery.whole for peer in peers):
            return missing
        return peers

    def finish(self, database: str, records: int, *, wall: float) -> None:
        recovery = self._recoveries[database]
        self._enter(recovery, Phase.RECOVERED)
        recovery.records = records
        recovery.at = wall
        recovery.served.clear()
        recovery.whole.clear()

    # -- what the node shows ---------------------------------------------------------------------------------

    def status(self, pairs_of: Mapping[str, Iterable[str]]) -> dict[str, dict[str, Any]]:
        """`/status` `recovery`: per database, its state and, while it recovers, the peers it waits for."""
        shown: dict[str, dict[str, Any]] = {}
        for name, recovery in sorted(self._recoveries.items()):
            if recovery.phase is Phase.RECOVERING:
                shown[name] = {
                    "state": "recovering",
                    "since": recovery.since,
                    "records": recovery.records,
                    "waiting_for": self.waiting_for(name, pairs_of.get(name, ())),
                }
            else:
                shown[name] = {"state": "recovered", "at": recovery.at, "records": recovery.records}
        return shown


def _serves(pair: PairView, recovery: Recovery) -> bool:
    """Caught up in a session that asked for what the file lacks: one connected since the recovery began (or last
    regressed) that asked for the own writes up to the latest floor. The order of the reports does not tell it
    alone: the session in whose handshake a file restored from an old backup was found gone back in time reports
    connected after the regression, yet it asked for none of them (an unknown file's sessions ask for all)."""
    return (
        pair.connected
        and pair.caught_up
        and (pair.connected_at or 0.0) >= recovery.started
        and pair.own_upto >= recovery.floor
    )


def _note(recovery: Recovery, peer: str, pair: PairView) -> None:
    """The pair is caught up in a session that serves the recovery (`_serves`): it served, and if its peer's own
    file is not recovering, it served whole."""
    if _serves(pair, recovery):
        recovery.served.add(peer)
        if not pair.peer_recovering:
            recovery.whole.add(peer)
