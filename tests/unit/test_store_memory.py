"""What a process's connection to an idle database keeps (issue 12): `Database.trim` drops the connection's references
to cursors that are gone, busy or idle, and the connection goes on as before."""

from __future__ import annotations

import gc
import sqlite3
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from replicator.shared.store import Database, Store


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
