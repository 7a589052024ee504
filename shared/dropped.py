"""Deleting a database cluster-wide: the markers in the system database's `dropped` table.

`DELETE /databases/{name}` writes a marker: record id the database's name, value a `Marker`. The marker's own
version V is the deletion floor: every record of that database at a version up to V is gone on every node and never
comes back, whichever node wrote it and whenever it arrives (`Database.drop_through`, and `apply_batch` ignores
what a floor covers). Records above V are writes made after the deletion: a database written to again is simply
there again, and replicates as before. The marker replicates like any record of the system database, so a node
that was down or cut off applies the deletion when it reaches it; each coordinator applies the markers to its own
files (`coordinator.drops`), and removes a database that is left holding nothing at all. Deleting the same name
again later writes a new marker, with a higher floor.
"""

from __future__ import annotations

import msgspec

from replicator.shared.config import NAME_RE
from replicator.shared.store import DROPPED, SYSTEM, Database, check_name

_PAGE = 1000


class Marker(msgspec.Struct, kw_only=True):
    """What a deletion marker says, for an operator reading it; the floor is the record's version."""

    name: str
    requested_by: str  # the node whose admin port took the request
    at: float  # its wall clock then, seconds since the epoch


def write(system: Database, name: str, requested_by: str, at: float, minimum: int = 0) -> int:
    """Record the deletion of database `name` at a floor above `minimum`; returns the floor (the marker's version).

    Each database file keeps its own clock, so the system database's clock says nothing of the versions the
    deleted database holds: the caller passes what the floor must cover (see `coordinator.drops`).
    """
    if check_name(name, "database") == SYSTEM:
        raise ValueError("the system database cannot be deleted")
    value = msgspec.msgpack.encode(Marker(name=name, requested_by=requested_by, at=at))
    return system.put_above(DROPPED, name, value, minimum)


def floors(system: Database) -> dict[str, int]:
    """The deletion floor of every database that has a marker, by name (the system database never has one)."""
    found: dict[str, int] = {}
    after: str | None = None
    while True:
        page = system.scan(DROPPED, after, _PAGE, skip_damaged=True)
        for entry in page:
            if entry.id != SYSTEM and NAME_RE.fullmatch(entry.id):
                found[entry.id] = entry.version
        if len(page) < _PAGE:
            return found
        after = page[-1].id
