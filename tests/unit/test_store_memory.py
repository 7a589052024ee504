"""What a process's connection to an idle database keeps (issue 12): `Database.trim` drops the connection's references
to cursors that are gone, busy or idle, and the connection goes on as before; `Store.trim` closes the connections
of databases idle for a whole round that nothing holds."""

from __future__ import annotations

import gc
import sqlite3
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from replicator.shared.store import RELEASE_PER_ROUND, SYSTEM, Database, Store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(tmp_path / "a", "a") as store:
        yield store


def _cursor_references(db: Database) -> list[weakref.ref[sqlite3.Cursor]]:
    """The references the connection keeps to the cursors it made (seen through the garbage collector)."""
    lists = [held for held in gc.get_referents(db._conn) if type(held) is list and held]
    assert len(lists) == 1, lists
    return lists[0]


def test_trim_drops_the_references_to_cursors_that_are_gone(store: Store) -> None:
    db = store.database("idle", create=True)
    db.trim()
    for _ in range(150):
        db.data_version()  # a sender's safety poll: a cursor per look
    assert sum(ref() is None for ref in _cursor_references(db)) >= 100
    held = db._conn.cursor()

    assert db.trim() is False  # lean already: only the references go
    assert [ref() for ref in _cursor_references(db)] == [held]
    held.close()

    # The connection goes on as before: reads, writes, its change count, and the module's own pruning.
    before = db.data_version()
    version = db.put("t", "k", b"v")
    entry = db.get("t", "k")
    assert entry is not None and entry.version == version
    assert db.data_version() != before
    for _ in range(450):
        db.data_version()
    assert len(_cursor_references(db)) <= 201


def test_a_database_written_to_has_its_references_dropped_too(store: Store) -> None:
    db = store.database("busy", create=True)
    for index in range(60):
        db.put("t", f"k{index}", b"v")
    assert db.trim() is False  # committed to since it was opened: it keeps its cache
    assert all(ref() is None for ref in _cursor_references(db)) and len(_cursor_references(db)) <= 1


def _value(n: int) -> bytes:
    return msgspec.msgpack.encode(n)


def test_a_database_idle_for_two_rounds_and_held_by_nobody_is_closed_and_opens_again(store: Store) -> None:
    """A process keeps a connection to every database it touched; one that stayed lean for a whole trim round and
    that no object holds is closed. The next `database()` opens the file again, with everything in it."""
    store.database("idle", create=True).put("t", "a", _value(1))
    assert store.trim() == 0  # committed to since it opened: keeps its full cache
    assert store.trim() == 1  # no commit for a round: lean
    assert "idle" in store._databases
    assert store.trim() == 1  # lean for a whole round and held by nobody: closed
    assert "idle" not in store._databases
    assert store.trim() == 0  # nothing left to do
    again = store.database("idle")
    assert again.get("t", "a") is not None and again.get("t", "a").value == _value(1)
    again.put("t", "b", _value(2))
    assert [e.id for e in again.origin_entries("a", 0, 10)] == ["a", "b"]


def test_a_trim_round_closes_at_most_its_share_of_idle_databases_and_the_next_rounds_the_rest(store: Store) -> None:
    """Closing a database syncs its file on the process's loop: a round closes at most RELEASE_PER_ROUND, however
    many went idle together, and the following rounds close the others."""
    count = 2 * RELEASE_PER_ROUND + 3
    for i in range(count):
        store.database(f"db{i}", create=True).put("t", "a", _value(i))
    store.trim()
    assert store.trim() == count  # lean, none closed yet
    closed = []
    while any(name.startswith("db") for name in store._databases):
        before = len(store._databases)
        store.trim()
        closed.append(before - len(store._databases))
    assert closed == [RELEASE_PER_ROUND, RELEASE_PER_ROUND, 3]
    assert all(store.database(f"db{i}").get("t", "a").value == _value(i) for i in range(count))


def test_a_database_someone_holds_or_uses_is_never_closed(store: Store) -> None:
    held = store.database("held", create=True)  # a session's, a sender's feed: this reference
    store.database(SYSTEM, create=True)
    damaged = store.database("damaged", create=True)
    damaged.checksum_failures = 1  # found, not counted by the metrics yet
    del damaged
    busy = store.database("busy", create=True)
    for _ in range(3):
        store.trim()
    assert set(store._databases) == {"held", SYSTEM, "damaged", "busy"}
    del busy
    # In use by another thread (its lock held): left for a later round, never waited for.
    inside, leave = threading.Event(), threading.Event()

    def use() -> None:
        with store._databases["busy"]._lock:
            inside.set()
            leave.wait(10)

    user = threading.Thread(target=use)
    user.start()
    assert inside.wait(10)
    try:
        assert store.trim() == 0 and "busy" in store._databases
    finally:
        leave.set()
        user.join(10)
    assert store.trim() == 1 and "busy" not in store._databases
    held.put("t", "x", _value(1))  # the held one was never closed under its holder
    assert store.take_checksum_failures() == {"damaged": 1}
    store.trim()
    assert "damaged" not in store._databases and "held" in store._databases
