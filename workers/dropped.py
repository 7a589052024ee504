"""A subscription to a database this node deleted and removed, from a peer that still holds it.

The peer may not have applied the deletion yet (it was down, or cut off): it still serves the records the deletion
covers, which this node ignores. Creating the file for them would only see it removed again, and again for as long as
the peer keeps advertising the database; so nothing is created here until the peer sends a record written after
the deletion (one its floors do not cover), or a mark past the floors (it holds the database complete beyond what
the deletion saw: written since, if deleted and purged again). From then on the database simply exists again, born
with its floors (`Store.database`), and is not removed while empty (`coordinator.drops`).
"""

from __future__ import annotations

from replicator.shared import own_writes, wire
from replicator.shared.deletion import DeletionFloors
from replicator.shared.store import Database, DatabaseRemoving, RefusedFile, TooManyDatabases
from replicator.shared.wire import Entry
from replicator.workers.context import SYSTEM, WorkerContext


class DroppedDatabase:
    """Stands in for the database a subscription applies to, until a record the deletion does not cover arrives."""

    def __init__(self, ctx: WorkerContext, name: str, floors: DeletionFloors) -> None:
        self._ctx = ctx
        self.name = name
        self.floors = floors
        self._db: Database | None = None

    @property
    def created(self) -> bool:
        return self._db is not None

    def own_history(self) -> own_writes.OwnHistory:
        """Nothing of this node's own writes is asked back: the deletion covers them."""
        if self._db is not None:
            return self._db.own_history()
        return own_writes.OwnHistory(floor=0, recovering=False, top=0, confirmed=0)

    def progress(self) -> dict[str, int]:
        """Where the subscription resumes each origin: at the deletion's floors until the file exists (everything up
        to them is deleted here), so the peer serves only what was written after the deletion, and a peer holding
        nothing more is not ahead of this node."""
        if self._db is not None:
            return self._db.progress()
        return {origin: floor for origin, floor in self.floors.origins.items() if floor > 0}

    def apply_batch(self, entries: list[Entry], marks: dict[str, int] | None = None, peer: str | None = None) -> int:
        """Apply a peer's batch; until a record the floors do not cover comes, or a mark past them (the peer holds
        writes made after the deletion, deleted and purged since, maybe), it is all covered by the deletion."""
        if self._db is None:
            covered = all(self.floors.covers(entry.origin, entry.version) for entry in entries)
            if covered and all(mark <= self.floors.floor_of(origin) for origin, mark in (marks or {}).items()):
                return 0
            try:
                self._db = self._ctx.database(self.name, create=True)
            except (DatabaseRemoving, RefusedFile, TooManyDatabases) as exc:
                raise wire.Refused(str(exc)) from None
        return self._db.apply_batch(entries, marks, peer=peer)


def open_for_subscription(ctx: WorkerContext, name: str) -> Database | DroppedDatabase:
    """The database a subscription to a peer applies to: the file, created when it has none, unless the database
    was deleted cluster-wide and removed from this node (then a stand-in that creates it only for newer records)."""
    try:
        if name != SYSTEM and not ctx.store.path(name).exists():
            floor = ctx.store.dropped_floor(name)
            if floor:
                return DroppedDatabase(ctx, name, floor)
        return ctx.database(name, create=True)
    except (DatabaseRemoving, RefusedFile, TooManyDatabases) as exc:
        # The limit holds whoever asks: the coordinator plans within it, and a client's create may have taken the
        # last place since.
        raise wire.Refused(str(exc)) from None
