"""What cluster-wide deletions of a database cover, as one file keeps it (`shared.dropped` writes the markers,
`Database.drop_through` applies them). The floors live in the file's meta table: `dropped_floors` (what the file
ignores from now on) and `dropped_purged_floors` (what it has been purged through); `dropped_floor` and
`dropped_purged` are the single floors of an earlier version, read as every origin up to them."""

from __future__ import annotations

import sqlite3

import msgspec


class DeletionFloors(msgspec.Struct, frozen=True):
    """What cluster-wide deletions of a database cover (`shared.dropped`): by origin, every version up to its floor,
    which is what the deleting node held of that origin when the deletion was asked for (invariant 20: a deletion
    removes what the deleting node had seen, and a write acknowledged after it survives). `every`: every origin up
    to it, the floor of a marker written before floors were kept per origin."""

    origins: dict[str, int] = {}
    every: int = 0

    def covers(self, origin: str, version: int) -> bool:
        return version <= self.every or version <= self.origins.get(origin, 0)

    def merge(self, other: DeletionFloors) -> DeletionFloors:
        origins = dict(self.origins)
        for origin, floor in other.origins.items():
            if floor > origins.get(origin, 0):
                origins[origin] = floor
        return DeletionFloors(origins=origins, every=max(self.every, other.every))

    def within(self, other: DeletionFloors) -> bool:
        """Does `other` cover everything these floors do?"""
        if self.every > other.every:
            return False
        return all(floor <= max(other.every, other.origins.get(origin, 0)) for origin, floor in self.origins.items())

    def __bool__(self) -> bool:
        return self.every > 0 or any(floor > 0 for floor in self.origins.values())

    def floor_of(self, origin: str) -> int:
        return max(self.every, self.origins.get(origin, 0))


NO_DELETION = DeletionFloors()
_decoder = msgspec.msgpack.Decoder(DeletionFloors)


def _meta(conn: sqlite3.Connection, key: str) -> object:
    row = conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
    return row[0] if row is not None else None


def _read(conn: sqlite3.Connection, key: str, legacy: str) -> DeletionFloors:
    raw = _meta(conn, key)
    found = _decoder.decode(raw) if isinstance(raw, bytes) else NO_DELETION
    every = _meta(conn, legacy)
    return found.merge(DeletionFloors(every=every)) if isinstance(every, int) and every > 0 else found


def floors(conn: sqlite3.Connection) -> DeletionFloors:
    """What the file ignores: nothing these cover is applied."""
    return _read(conn, "dropped_floors", "dropped_floor")


def purged(conn: sqlite3.Connection) -> DeletionFloors:
    """What the file has been purged through: it holds nothing these cover."""
    return _read(conn, "dropped_purged_floors", "dropped_purged")


def set_purged(conn: sqlite3.Connection, covered: DeletionFloors) -> None:
    encoded = msgspec.msgpack.encode(covered)
    conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('dropped_purged_floors', ?)", (encoded,))


def raise_floors(conn: sqlite3.Connection, node: str, covered: DeletionFloors) -> DeletionFloors:
    """Inside a write transaction: nothing the floors cover is applied from now on, and the clock moves past this
    node's own floor, so every later local write survives the deletion. Returns the floors now held."""
    held = floors(conn).merge(covered)
    conn.execute(
        "INSERT OR REPLACE INTO meta (key, value) VALUES ('dropped_floors', ?)", (msgspec.msgpack.encode(held),)
    )
    conn.execute("UPDATE meta SET value = max(value, ?) WHERE key = 'hlc'", (held.floor_of(node),))
    return held
