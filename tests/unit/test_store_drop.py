"""Deleting a database cluster-wide, as the store sees it: the deletion floors per origin (`Database.drop_through`),
the files born with them, and the removal of a database's file (`Store.block` / `Store.remove`)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import pytest

from replicator.shared import dropped
from replicator.shared.deletion import NO_DELETION, DeletionFloors
from replicator.shared.store import SYSTEM, BadName, BadRecord, Database, DatabaseRemoving, Store, UnknownDatabase
from replicator.shared.wire import Entry
from replicator.workers.dropped import DroppedDatabase
from tests.unit.test_store import FakeClock, rec


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(tmp_path: Path, clock: FakeClock) -> Iterator[Store]:
    with Store(tmp_path / "a", "a", clock=clock) as store:
        yield store


def _rows(db: Database) -> list[tuple]:
    with closing(sqlite3.connect(db.path)) as conn:
        return conn.execute("SELECT tbl, id, version, origin, tombstone FROM records ORDER BY tbl, id").fetchall()


def _audit_versions(db: Database) -> list[int]:
    with closing(sqlite3.connect(db.path)) as conn:
        return [version for (version,) in conn.execute("SELECT version FROM audit ORDER BY seq")]


def every(floor: int) -> DeletionFloors:
    """The floor of a marker of an earlier version: every origin up to it."""
    return DeletionFloors(every=floor)


def per_origin(**floors: int) -> DeletionFloors:
    return DeletionFloors(origins=floors)


def _mixed(db: Database) -> list[Entry]:
    """Records of three origins in two tables, tombstones among them, at versions 10..160; all applied to `db`."""
    entries = [
        rec(f"r{i}", 10 * (i + 1), origin, table=table, tomb=i % 5 == 4)
        for i, (origin, table) in enumerate((o, t) for o in ("b", "c", "d") for t in ("t", "u") for _ in range(3))
    ]
    assert db.apply_batch(entries) == len(entries)
    return entries


@pytest.mark.parametrize("chunk", [1, 3, 20_000])
@pytest.mark.parametrize("floors", [every(100), per_origin(b=60, c=120, d=170)], ids=["every", "per-origin"])
def test_drop_through_removes_everything_the_floors_cover(
    store: Store, tmp_path: Path, clock: FakeClock, chunk: int, floors: DeletionFloors
) -> None:
    db = store.database("main", create=True)
    entries = _mixed(db)
    survivors = [entry for entry in entries if not floors.covers(entry.origin, entry.version)]
    assert 0 < len(survivors) < len(entries)

    assert db.drop_through(floors, chunk=chunk) == len(entries) - len(survivors)

    assert _rows(db) == sorted((e.table, e.id, e.version, e.origin, int(e.tombstone)) for e in survivors)
    assert _audit_versions(db) == [entry.version for entry in survivors]
    assert db.dropped_floor == db.dropped_purged == floors
    # The bucket digests moved with every row that went: they are what a file that only ever held the survivors
    # has, and what the rows add up to.
    with Store(tmp_path / "fresh", "a", clock=clock) as fresh_store:
        fresh = fresh_store.database("main", create=True)
        fresh.apply_batch(survivors)
        assert db.digest() == fresh.digest()
        assert db.roots() == fresh.roots()
        for table in ("t", "u"):
            assert db.bucket_digests(table) == fresh.bucket_digests(table) == db.recount_digests(table)
    assert db.check_digests() == 0


def test_entries_the_floors_cover_do_not_win(store: Store) -> None:
    db = store.database("main", create=True)
    db.drop_through(per_origin(b=100, c=100))
    old = [rec("x", 50, "b"), rec("y", 100, "c", tomb=True)]
    assert db.apply_batch(old, {"b": 100}) == 0  # not an error: they just do not win
    assert _rows(db) == []
    assert db.origins()["b"].complete == 100  # the marks still count
    # Above an origin's floor, or of an origin the deleting node had not seen: written after the deletion.
    assert db.apply_batch([rec("x", 60, "b"), rec("z", 101, "c"), rec("w", 7, "d")]) == 2
    assert [row[1:4] for row in _rows(db)] == [("w", 7, "d"), ("z", 101, "c")]
    assert db.get("t", "x") is None and db.get("t", "z") is not None


def test_local_writes_land_above_the_own_floor_ahead_of_the_clock(store: Store, clock: FakeClock) -> None:
    db = store.database("main", create=True)
    ahead = clock.us + 30_000_000
    db.drop_through(per_origin(a=ahead, b=ahead + 10**9))
    assert db.put("t", "new", b"v") > ahead
    assert all(version > ahead for version in db.put_many("t", [("more", b"v"), ("most", b"v")]))
    assert db.delete("t", "new") > ahead
    assert db.get("t", "more") is not None  # not covered: the floor of this node's origin is below them


def test_the_floors_only_rise(store: Store) -> None:
    db = store.database("main", create=True)
    db.apply_batch([rec("x", 50, "b"), rec("y", 150, "b"), rec("z", 150, "c")])
    assert db.drop_through(per_origin(b=100)) == 1
    assert db.drop_through(per_origin(b=80)) == 0  # an older marker arriving late changes nothing
    assert db.dropped_floor == db.dropped_purged == per_origin(b=100)
    assert db.drop_through(per_origin(b=200, c=150)) == 2
    assert db.dropped_floor == db.dropped_purged == per_origin(b=200, c=150)
    assert db.is_empty()


def test_drop_through_refuses_a_floor_out_of_range(store: Store) -> None:
    db = store.database("main", create=True)
    with pytest.raises(BadRecord):
        db.drop_through(per_origin(b=-1))
    with pytest.raises(BadName):
        db.drop_through(per_origin(**{"bad name": 5}))
    assert db.dropped_floor == NO_DELETION


def test_an_interrupted_purge_is_not_counted_as_done(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    db = store.database("main", create=True)
    _mixed(db)
    calls = 0
    real = db._write

    def failing_after_the_floor():  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        if calls == 2:
            raise sqlite3.OperationalError("disk I/O error")
        return real()

    monkeypatch.setattr(db, "_write", failing_after_the_floor)
    with pytest.raises(sqlite3.OperationalError):
        db.drop_through(every(100), chunk=2)
    monkeypatch.undo()
    # The floor holds (nothing it covers is applied any more), but the file is not purged through it yet.
    assert db.dropped_floor == every(100) and db.dropped_purged == NO_DELETION
    assert db.apply_batch([rec("late", 90, "b")]) == 0
    db.drop_through(every(100))
    assert db.dropped_purged == every(100)
    assert all(row[2] > 100 for row in _rows(db))


def test_is_empty_counts_tombstones(store: Store) -> None:
    db = store.database("main", create=True)
    assert db.is_empty()
    db.apply_batch([rec("x", 10, "b", tomb=True)])
    assert not db.is_empty()


# -- markers and files born after a deletion ---------------------------------------------------------------------


def test_markers_give_each_deleted_database_its_floors(store: Store) -> None:
    system = store.database(SYSTEM, create=True)
    assert dropped.floors(system) == {} and store.dropped_floor("typo") == NO_DELETION
    dropped.write(system, "typo", requested_by="a", at=1.0, floors={"a": 10, "b": 20})
    assert dropped.floors(system) == {"typo": per_origin(a=10, b=20)}
    assert store.dropped_floor("typo") == per_origin(a=10, b=20)
    # Another node's deletion counts beside it; the same node's again covers what its first one did.
    dropped.write(system, "typo", requested_by="b", at=2.0, floors={"b": 15, "c": 30})
    assert dropped.floors(system) == {"typo": per_origin(a=10, b=20, c=30)}
    dropped.write(system, "typo", requested_by="a", at=3.0, floors={"a": 5, "d": 40})
    assert dropped.floors(system) == {"typo": per_origin(a=10, b=20, c=30, d=40)}
    with pytest.raises(ValueError):
        dropped.write(system, SYSTEM, requested_by="a", at=3.0, floors={})
    # A marker of an earlier version (its id the name, its version the floor of every origin) still counts.
    system.apply_batch([rec("old", 77, "b", value=b"\x80", table="dropped")])
    assert dropped.floors(system)["old"] == every(77)
    # A marker a peer sent under a name no database can have, for the system database, or that does not decode,
    # is not a floor.
    top = 10**6
    system.apply_batch([rec("bad name", top + 1, "b", value=b"\x80", table="dropped")])
    system.apply_batch([rec(SYSTEM, top + 2, "b", value=b"\x80", table="dropped")])
    system.apply_batch([rec("typo@z", top + 3, "z", value=b"\x80", table="dropped")])
    assert dropped.floors(system) == {"typo": per_origin(a=10, b=20, c=30, d=40), "old": every(77)}
    assert store.dropped_floor(SYSTEM) == NO_DELETION


def test_a_database_created_after_its_deletion_is_born_with_the_floors(store: Store, clock: FakeClock) -> None:
    system = store.database(SYSTEM, create=True)
    clock.advance(1)
    dropped.write(system, "typo", requested_by="b", at=1.0, floors={"b": 500})
    db = store.database("typo", create=True)
    assert db.dropped_floor == db.dropped_purged == per_origin(b=500)
    assert db.apply_batch([rec("old", 500, "b")]) == 0
    assert db.apply_batch([rec("new", 501, "b")]) == 1
    assert db.put("t", "mine", b"v") > 0
    other = store.database("other", create=True)
    assert other.dropped_floor == NO_DELETION


# -- removing a database's file --------------------------------------------------------------------------------


def test_a_blocked_database_is_neither_opened_nor_created(store: Store) -> None:
    store.database("main", create=True)
    store.block("main")
    store.block("absent")
    for name in ("main", "absent"):
        with pytest.raises(DatabaseRemoving):
            store.database(name)
        with pytest.raises(DatabaseRemoving):
            store.database(name, create=True)
    assert not store.path("absent").exists()
    store.unblock("main")
    store.unblock("absent")
    assert store.database("main") is not None
    with pytest.raises(ValueError):
        store.block(SYSTEM)


def test_remove_deletes_only_an_empty_blocked_file(store: Store) -> None:
    db = store.database("main", create=True)
    db.apply_batch([rec("x", 10, "b")])
    with pytest.raises(RuntimeError):
        store.remove("main")  # not blocked: another caller may still be using it
    store.block("main")
    assert not store.remove("main")
    assert store.path("main").exists()
    store.unblock("main")
    db = store.database("main")  # the handle was closed by remove(): a new one
    db.drop_through(per_origin(b=10))
    (store.data_dir / "main.blobs").mkdir()
    (store.data_dir / "main.blobs" / ("0" * 64)).write_bytes(b"\xc0")  # a blob file of a record that is gone
    store.block("main")
    assert store.remove("main")
    store.unblock("main")
    leftovers = [path.name for path in store.data_dir.iterdir() if path.name.startswith("main.")]
    assert leftovers == []
    assert "main" not in store.names()
    with pytest.raises(UnknownDatabase):
        store.database("main")


def test_a_subscription_to_a_stale_peer_creates_nothing_until_a_newer_record(store: Store, clock: FakeClock) -> None:
    class Ctx:  # what DroppedDatabase uses of a worker's context
        def __init__(self, store: Store) -> None:
            self.store = store
            self.opened: list[str] = []

        def database(self, name: str, create: bool = False) -> Database:
            self.opened.append(name)
            return self.store.database(name, create=create)

    ctx = Ctx(store)
    clock.advance(1)
    floor = 1000
    dropped.write(store.database(SYSTEM, create=True), "typo", requested_by="a", at=1.0, floors={"b": floor, "c": 9})
    floors = store.dropped_floor("typo")
    stand_in = DroppedDatabase(ctx, "typo", floors)  # type: ignore[arg-type]
    # It resumes at the floors: what they cover is deleted here, and a peer holding no more is not ahead of it.
    assert stand_in.progress() == {"b": floor, "c": 9} and stand_in.own_history().asks == 0
    assert stand_in.apply_batch([rec("old", floor - 5, "b"), rec("older", 7, "c")], {"b": floor}) == 0
    assert not store.path("typo").exists() and ctx.opened == []
    assert stand_in.apply_batch([rec("old", floor - 1, "b"), rec("new", floor + 1, "b")], {"b": floor + 1}) == 1
    assert stand_in.created and ctx.opened == ["typo"]
    db = store.database("typo")
    assert db.dropped_floor == floors
    assert [row[1] for row in _rows(db)] == ["new"]
    assert stand_in.progress() == {"b": floor + 1}


def test_a_mark_past_the_floors_creates_the_database_again(store: Store, clock: FakeClock) -> None:
    """A peer complete beyond what the deletion saw holds the database as written since (everything written since
    deleted and purged again, maybe): it exists again here too, empty, and stays."""

    class Ctx:
        def __init__(self, store: Store) -> None:
            self.store = store

        def database(self, name: str, create: bool = False) -> Database:
            return self.store.database(name, create=create)

    clock.advance(1)
    dropped.write(store.database(SYSTEM, create=True), "again", requested_by="a", at=1.0, floors={"b": 1000})
    floors = store.dropped_floor("again")
    stand_in = DroppedDatabase(Ctx(store), "again", floors)  # type: ignore[arg-type]
    assert stand_in.apply_batch([], {"b": 1000}) == 0 and not stand_in.created
    assert stand_in.apply_batch([], {"b": 1200}) == 0 and stand_in.created
    db = store.database("again")
    assert db.is_empty() and db.progress() == {"b": 1200}
    assert dropped.written_since(db.origins(), floors)


def test_a_recovering_file_is_not_left_empty_until_its_recovery_finishes(store: Store) -> None:
    """Seed 3603 of nemesis 3: a recovering file is complete of its own origin only as far as peers confirmed, so a
    peer may still hold own writes of it above the deletion's floor (versions it had replaced here by writes the
    deletion covers). Removed, the file would never ask for them back; kept, its recovery does, and it is removed
    only once recovery is done and nothing was written since."""
    db = store.database("x", create=True)
    db.apply_batch([rec("r1", 10, "b")])
    assert db.regress(50)  # a peer holds our own writes up to 50: the file recovers
    floors = per_origin(b=10)
    db.drop_through(floors)
    assert db.is_empty() and db.recovering
    assert not dropped.left_empty(db, floors)
    db.finish_recovery()
    assert not db.recovering
    assert dropped.left_empty(db, floors)


def test_a_version_the_floors_do_not_cover_comes_back_when_a_covered_one_had_replaced_it(
    store: Store, tmp_path: Path, clock: FakeClock
) -> None:
    # e wrote x at 500 (its clock ahead) and deleted the database covering it; b wrote x at 300 after the deletion,
    # and this node took b's write, then e's (the deletion not applied here yet), which replaced it. The floors take
    # e's version and give back b's, the newest they do not cover: what a node that took the floors first ends with.
    # y had only a covered version: it goes. z goes back to its newest uncovered version, c's delete.
    db = store.database("main", create=True)
    before = [rec("x", 300, "b"), rec("z", 100, "b"), rec("z", 200, "c", tomb=True)]
    covered = [rec("x", 500, "e"), rec("y", 450, "e"), rec("z", 600, "e")]
    assert db.apply_batch(before) == 3
    assert db.apply_batch(covered) == 3

    assert db.drop_through(per_origin(e=600)) == 1

    assert _rows(db) == [("t", "x", 300, "b", 0), ("t", "z", 200, "c", 1)]
    assert db.get("t", "x") == rec("x", 300, "b")
    assert _audit_versions(db) == [300, 100, 200]
    with Store(tmp_path / "first", "a", clock=clock) as first_store:
        first = first_store.database("main", create=True)
        first.drop_through(per_origin(e=600))
        first.apply_batch(before)
        assert first.apply_batch(covered) == 0
        assert _rows(db) == _rows(first)
        assert db.digest() == first.digest() and db.roots() == first.roots()
        assert db.bucket_digests("t") == first.bucket_digests("t") == db.recount_digests("t")
    assert db.check_digests() == 0
    # A later deletion covering b's version too takes it, and nothing older comes back for x.
    assert db.drop_through(per_origin(b=300, e=600)) == 1
    assert _rows(db) == [("t", "z", 200, "c", 1)]
