"""Deleting a database cluster-wide: the markers in the system database's `dropped` table.

`DELETE /databases/{name}` on node N writes a marker, record id `{name}@{N}`, whose value (a `Marker`) carries the
deletion's floors: per origin, how far N held it (`seen`: complete, or the newest version if higher). Every record of
that database that a floor covers is gone on every node and never comes back, whichever node holds it and whenever it
arrives (`Database.drop_through`, and `apply_batch` ignores what the floors cover). What N had not seen is not
covered: a write made anywhere after the deletion returned (on a node that was down or cut off, say) is above its
origin's floor and survives, as do writes concurrent with it that N had not received, as in any observed-remove
design (invariant 20). A database written to again is simply there again, and replicates as before.

The marker replicates like any record of the system database, so a node that was down or cut off applies the
deletion when it reaches it; each coordinator applies the markers to its own files (`coordinator.drops`), and
removes a database that is left holding nothing at all. Each deleting node has its own marker, so deletions asked on
two nodes at once both count; deleting the same name again on N rewrites N's marker with floors that cover the
earlier ones too. A marker of an earlier version (record id `{name}`) covers every origin up to its own version.
"""

from __future__ import annotations

import msgspec

from replicator.shared.config import NAME_RE
from replicator.shared.deletion import NO_DELETION, DeletionFloors
from replicator.shared.store import DROPPED, SYSTEM, DamagedRecord, Database, Origin, check_name

_PAGE = 1000


class Marker(msgspec.Struct, kw_only=True):
    """What a deletion marker says: who asked, when, and the floors (for an operator reading it, and the nodes)."""

    name: str
    requested_by: str  # the node whose admin port took the request
    at: float  # its wall clock then, seconds since the epoch
    floors: dict[str, int] = {}  # per origin, the newest version the node held of the database


_decoder = msgspec.msgpack.Decoder(Marker)


def seen(held: dict[str, Origin]) -> dict[str, int]:
    """The floors a deletion by a node holding `held` writes: per origin, what the node holds complete of it (every
    version up to there, or something newer of the record), or its newest version held if that is higher."""
    floors = {origin: max(state.complete, state.top) for origin, state in held.items()}
    return {origin: floor for origin, floor in floors.items() if floor > 0}


def written_since(held: dict[str, Origin], floors: DeletionFloors) -> bool:
    """Does a file holding `held` hold positions beyond the deletion's floors: was the database written after the
    deletion (whatever was written since deleted and purged again, maybe)? Then it exists again, empty or not.

    Only complete positions count: they are what marks carry, so a peer whose file went gets the same answer once
    its subscription brings the marks (`workers.dropped`). The newest version an origin shows (`top`) does not: a
    node's own top follows its clock, which no other node sees, and would keep the file on that node alone."""
    return any(state.complete > floors.floor_of(origin) for origin, state in held.items())


def left_empty(db: Database, floors: DeletionFloors) -> bool:
    """May the deletion remove this file now? Only when it is empty and was not written after the deletion (its
    positions do not pass the floors): a database written since exists again, empty or not, as on the nodes that
    hold what was written since.

    Not while the file recovers: its own origin is complete only as far as peers have confirmed, so own writes
    above the deletion's floor may still be out there, on a peer that holds versions this file had replaced by
    writes the deletion covers. Removed, the file would never ask for them back (a removed database's
    subscriptions ask for none of this node's own writes), and that peer would keep them alone."""
    return db.is_empty() and not db.recovering and not written_since(db.origins(), floors)


def marker_id(name: str, requested_by: str) -> str:
    return f"{name}@{requested_by}"


def write(system: Database, name: str, requested_by: str, at: float, floors: dict[str, int]) -> int:
    """Record the deletion of database `name` by this node, covering `floors` (and whatever this node's earlier
    deletion of it covered); returns the marker's version."""
    if check_name(name, "database") == SYSTEM:
        raise ValueError("the system database cannot be deleted")
    record_id = marker_id(name, requested_by)
    try:
        earlier = system.get(DROPPED, record_id)
    except DamagedRecord:
        earlier = None
    merged = dict(floors)
    marker = _marker(earlier.value) if earlier is not None else None
    for origin, floor in marker.floors.items() if marker is not None else ():
        merged[origin] = max(floor, merged.get(origin, 0))
    value = msgspec.msgpack.encode(Marker(name=name, requested_by=requested_by, at=at, floors=merged))
    return system.put(DROPPED, record_id, value)


def _marker(value: bytes) -> Marker | None:
    try:
        return _decoder.decode(value)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def floors(system: Database) -> dict[str, DeletionFloors]:
    """What the deletions of every database that has a marker cover, by name (the system database never has one).
    A marker whose value does not decode, or names an origin that cannot be one, counts for nothing."""
    found: dict[str, DeletionFloors] = {}
    after: str | None = None
    while True:
        page = system.scan(DROPPED, after, _PAGE, skip_damaged=True)
        for entry in page:
            name, _, by = entry.id.partition("@")
            if name == SYSTEM or not NAME_RE.fullmatch(name):
                continue
            if not by:
                covered = DeletionFloors(every=entry.version)  # a marker of an earlier version
            else:
                marker = _marker(entry.value)
                if marker is None or not all(NAME_RE.fullmatch(origin) for origin in marker.floors):
                    continue
                covered = DeletionFloors(origins=dict(marker.floors))
            found[name] = found.get(name, NO_DELETION).merge(covered)
        if len(page) < _PAGE:
            return found
        after = page[-1].id
