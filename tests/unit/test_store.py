from __future__ import annotations

import gc
import multiprocessing
import random
import shutil
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from replicator.shared import hlc
from replicator.shared.store import (
    BadName,
    BadRecord,
    Database,
    Origin,
    Store,
    UnknownDatabase,
)
from replicator.shared.wire import Entry

T0 = 1_700_000_000.0
MAX = hlc.MAX_VERSION


class FakeClock:
    """A wall clock in nanoseconds that moves only when told to."""

    def __init__(self, seconds: float = T0) -> None:
        self.ns = int(seconds * 1e9)

    def __call__(self) -> int:
        return self.ns

    def advance(self, seconds: float) -> None:
        self.ns += int(seconds * 1e9)

    @property
    def us(self) -> int:
        return self.ns // 1000


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(tmp_path: Path, clock: FakeClock) -> Iterator[Store]:
    with Store(tmp_path / "a", "a", clock=clock) as store:
        yield store


@pytest.fixture
def db(store: Store) -> Database:
    return store.database("main", create=True)


def rec(id: str, version: int, origin: str, value: bytes = b"v", table: str = "t", tomb: bool = False) -> Entry:
    return Entry(table, id, b"" if tomb else value, version, origin, tomb)


# The store has no reader for the audit log or the meta table: the tests look at the file with a connection of
# their own, as an operator's sqlite3 shell would.


def raw(path: Path) -> closing[sqlite3.Connection]:
    return closing(sqlite3.connect(path, isolation_level=None))


def whole_log(db: Database) -> list[tuple[int, Entry]]:
    with raw(db.path) as conn:
        rows = conn.execute("SELECT seq, tbl, id, value, version, origin, tombstone FROM audit ORDER BY seq")
        return [
            (seq, Entry(tbl, id, value, version, origin, bool(tomb)))
            for seq, tbl, id, value, version, origin, tomb in rows
        ]


def meta(db: Database, key: str) -> Any:
    with raw(db.path) as conn:
        row = conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row is not None else None


def all_of(db: Database, origin: str) -> list[Entry]:
    return db.origin_entries(origin, 0, 1_000_000)


def completes(db: Database) -> dict[str, int]:
    return {origin: held.complete for origin, held in db.origins().items()}


def tops(db: Database) -> dict[str, int]:
    return {origin: held.top for origin, held in db.origins().items()}


# -- local writes and reads ----------------------------------------------------------------------------------


def test_put_get_scan_delete(db: Database, clock: FakeClock) -> None:
    version = db.put("t", "x", b"1")
    assert version == clock.us
    assert db.get("t", "x") == Entry("t", "x", b"1", version, "a", False)
    assert db.get("t", "missing") is None
    assert db.put_many("t", [("b", b"2"), ("c", b"3"), ("a", b"4")]) == [version + 1, version + 2, version + 3]
    assert [e.id for e in db.scan("t", None, 10)] == ["a", "b", "c", "x"]
    assert [e.id for e in db.scan("t", "b", 2)] == ["c", "x"]

    tombstone = db.delete("t", "b")
    assert tombstone == version + 4
    assert db.get("t", "b") is None
    assert [e.id for e in db.scan("t", None, 10)] == ["a", "c", "x"]
    assert db.delete("t", "b") is None  # already a tombstone
    assert db.delete("t", "nope") is None
    assert db.last_seq() == 5  # the two refused deletes appended nothing

    revived = db.put("t", "b", b"5")
    assert revived > tombstone and db.get("t", "b") is not None
    assert db.tables() == ["t"]
    db.put("u", "z", b"")
    assert db.tables() == ["t", "u"]


def test_audit_keeps_every_local_commit_in_order(db: Database) -> None:
    db.put("t", "x", b"1")
    db.put("t", "x", b"2")
    db.delete("t", "x")
    log = whole_log(db)
    assert [seq for seq, _ in log] == [1, 2, 3]
    assert [(e.value, e.tombstone, e.origin) for _, e in log] == [
        (b"1", False, "a"),
        (b"2", False, "a"),
        (b"", True, "a"),
    ]
    assert [e.version for _, e in log] == sorted({e.version for _, e in log})
    assert (db.first_seq(), db.last_seq()) == (1, 3)


def test_rejects_empty_ids(db: Database) -> None:
    with pytest.raises(BadRecord):
        db.put("t", "", b"x")
    with pytest.raises(BadRecord):
        db.put_many("t", [("ok", b""), ("", b"")])
    assert db.last_seq() == 0 and db.get("t", "ok") is None


# -- last-writer-wins ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "origin", "wins"),
    [
        (101, "a", True),  # newer version, smaller origin
        (99, "z", False),  # older version, larger origin
        (100, "c", True),  # same version: the larger origin breaks the tie
        (100, "a", False),  # same version, smaller origin
        (100, "b", False),  # identity tie: the very version held
    ],
)
def test_lww_matrix(db: Database, version: int, origin: str, wins: bool) -> None:
    assert db.apply_batch([rec("x", 100, "b", b"held")]) == 1
    head = db.last_seq()
    assert db.apply_batch([rec("x", version, origin, b"incoming")]) == int(wins)
    held = db.get("t", "x")
    assert held is not None
    assert (held.version, held.origin, held.value) == ((version, origin, b"incoming") if wins else (100, "b", b"held"))
    # A skipped record leaves no audit entry: that is what stops records looping around a mesh.
    assert db.last_seq() == head + int(wins)


@pytest.mark.parametrize(("version", "wins"), [(101, True), (99, False)])
def test_tombstones_resolve_like_records(db: Database, version: int, wins: bool) -> None:
    db.apply_batch([rec("x", 100, "b")])
    assert db.apply_batch([rec("x", version, "b", tomb=True)]) == int(wins)
    assert (db.get("t", "x") is None) == wins
    # And a live record beats an older tombstone.
    assert db.apply_batch([rec("x", 200, "b", b"back")]) == 1
    assert db.get("t", "x") is not None


def test_reapplied_batch_is_skipped_whole(db: Database) -> None:
    batch = [rec(f"k{i}", 10 + i, "b") for i in range(20)]
    assert db.apply_batch(batch, {"b": 29}) == 20
    head = db.last_seq()
    assert db.apply_batch(batch, {"b": 29}) == 0
    assert db.last_seq() == head
    assert completes(db)["b"] == 29


def test_several_versions_of_one_record_in_a_batch_apply_in_order(db: Database) -> None:
    won = db.apply_batch([rec("x", 5, "b", b"5"), rec("x", 7, "b", b"7"), rec("x", 6, "b", b"6")])
    assert won == 2
    held = db.get("t", "x")
    assert held is not None and held.value == b"7"
    assert [e.version for _, e in whole_log(db)] == [5, 7]


def test_applied_records_keep_their_origin(db: Database) -> None:
    db.apply_batch([rec("x", 5, "c")], {"c": 5})
    assert [e.origin for _, e in whole_log(db)] == ["c"]
    assert [e.id for e in all_of(db, "c")] == ["x"]


def _nothing_written(db: Database) -> None:
    assert db.get("t", "x") is None and db.last_seq() == 0
    assert db.progress() == {} and db.origins() == {}


def test_apply_checks_entries_before_writing(db: Database) -> None:
    marks = {"b": 50, "c": 50}
    with pytest.raises(BadName, match="bad/table"):
        db.apply_batch([rec("x", 5, "b"), rec("y", 5, "b", table="bad/table")], marks)
    with pytest.raises(BadName, match="not a node"):
        db.apply_batch([rec("x", 5, "b"), rec("y", 5, "not a node")], marks)
    with pytest.raises(BadRecord):
        db.apply_batch([rec("x", 5, "b"), rec("y", 0, "b")], marks)
    with pytest.raises(BadRecord):
        db.apply_batch([rec("x", 5, "b"), rec("y", 2**63, "b")], marks)
    with pytest.raises(BadRecord):
        db.apply_batch([rec("x", 5, "b"), rec("", 6, "b")], marks)
    # A refused batch raises no mark either.
    _nothing_written(db)


@pytest.mark.parametrize(
    ("marks", "error"),
    [
        ({"not a node": 5}, BadName),
        ({"": 5}, BadName),
        ({"b": 5, "x" * 65: 5}, BadName),
        ({"b": -1}, BadRecord),
        ({"b": 5, "c": 2**63}, BadRecord),
    ],
)
def test_apply_checks_marks_before_writing(db: Database, marks: dict[str, int], error: type[Exception]) -> None:
    with pytest.raises(error):
        db.apply_batch([rec("x", 5, "b")], marks)
    _nothing_written(db)


def test_marks_at_the_bounds_are_accepted(db: Database) -> None:
    db.apply_batch([], {"b": 0, "c": MAX})
    assert completes(db) == {"b": 0, "c": MAX}
    assert db.progress() == {"c": MAX}


# -- atomicity of a batch and its marks ----------------------------------------------------------------------


@pytest.mark.parametrize("failure", ["record", "mark"])
def test_failed_batch_moves_neither_records_nor_marks(db: Database, clock: FakeClock, failure: str) -> None:
    db.apply_batch([rec("x", 10, "b", b"old")], {"b": 10})
    future = clock.us + 10**9
    good = [rec("x", future, "b", b"new"), rec("y", future + 1, "b")]
    if failure == "record":
        # The last entry violates NOT NULL after the first ones were written inside the transaction.
        batch: list[Any] = [*good, Entry("t", "z", None, future + 2, "b")]  # type: ignore[arg-type]
    else:
        # Every record is written, then raising the mark fails.
        batch = good
        with raw(db.path) as conn:
            conn.execute(
                "CREATE TRIGGER refuse BEFORE UPDATE OF complete ON origins WHEN NEW.complete > 10 "
                "BEGIN SELECT RAISE(ABORT, 'refused'); END"
            )
    before = (db.origins(), db.last_seq(), db.data_version())
    with pytest.raises(sqlite3.IntegrityError):
        db.apply_batch(batch, {"b": future + 1})
    assert (db.origins(), db.last_seq(), db.data_version()) == before
    held = db.get("t", "x")
    assert held is not None and held.value == b"old"
    assert db.get("t", "y") is None
    # The clock did not move past the failed batch either, and the connection is usable again.
    assert db.put("t", "w", b"") == clock.us
    with raw(db.path) as conn:
        conn.execute("DROP TRIGGER IF EXISTS refuse")
    assert db.apply_batch(good, {"b": future + 1}) == 2
    assert completes(db)["b"] == future + 1


def test_complete_only_rises(db: Database) -> None:
    db.apply_batch([], {"b": 100})
    assert completes(db)["b"] == 100
    db.apply_batch([rec("x", 120, "b")], {"b": 50})  # a lower mark, from another sender, moves nothing back
    assert completes(db)["b"] == 100
    db.apply_batch([], {"b": 200, "c": 7})
    assert completes(db) == {"b": 200, "c": 7}
    assert db.progress() == {"b": 200, "c": 7}


def test_marks_without_entries_and_entries_without_marks(db: Database) -> None:
    db.apply_batch([rec("x", 30, "b")])
    assert db.origins() == {"b": Origin(complete=0, top=30)}
    assert db.progress() == {}
    db.apply_batch([], {"b": 30})
    assert db.origins() == {"b": Origin(complete=30, top=30)}


# -- origins: complete and top -------------------------------------------------------------------------------


def test_top_is_the_highest_version_held_per_origin(db: Database) -> None:
    first = db.put("t", "x", b"")
    assert tops(db) == {"a": first}
    second = db.put_many("t", [("y", b""), ("z", b"")])[-1]
    assert tops(db) == {"a": second}
    gone = db.delete("t", "y")  # a tombstone is a version like any other
    assert gone is not None and tops(db) == {"a": gone}

    db.apply_batch([rec("p", 100, "b"), rec("q", 90, "b")])
    assert tops(db) == {"a": gone, "b": 100}
    db.apply_batch([rec("r", 60, "b")])  # lower than the top: the top stays
    assert tops(db)["b"] == 100
    db.apply_batch([rec("p", 50, "c")])  # loses to b's version of p: nothing of c is held
    assert "c" not in tops(db)
    db.apply_batch([rec("p", 150, "c")])  # wins over b's: c's top rises, b's stays
    assert tops(db) == {"a": gone, "b": 100, "c": 150}


def test_own_complete_is_the_stored_value_while_recovering(db: Database) -> None:
    assert db.recovering
    db.put("t", "x", b"")
    assert completes(db) == {"a": 0}
    assert db.progress() == {}
    db.apply_batch([rec("y", 5, "a")], {"a": 5})  # a peer confirms our own writes up to 5
    assert completes(db) == {"a": 5}
    assert db.progress() == {"a": 5}


def test_own_complete_follows_the_newest_own_write_when_not_recovering(db: Database, clock: FakeClock) -> None:
    db.finish_recovery()
    assert completes(db) == {}  # nothing written yet
    mine = db.put("t", "x", b"")
    assert db.origins()["a"] == Origin(complete=mine, top=mine)
    # Receiving a later version moves the clock but not what this node holds of itself: a peer that holds more
    # of our writes than our newest shows that our file went back in time (see regress).
    db.apply_batch([rec("y", mine + 1000, "b")])
    assert db.origins()["a"] == Origin(complete=mine, top=mine)
    assert db.progress() == {"a": mine}
    # A mark above it is kept.
    db.apply_batch([], {"a": mine + 5000})
    assert completes(db)["a"] == mine + 5000


def test_a_peer_holding_more_of_our_writes_than_the_file_means_it_went_back_in_time(
    db: Database, clock: FakeClock
) -> None:
    db.finish_recovery()
    mine = db.put("t", "x", b"")
    assert not db.regress(mine)  # what we hold: nothing to do
    assert db.regress(mine + 50)
    assert db.recovering and db.own_floor == mine + 50
    assert db.put("t", "y", b"") > mine + 50  # new writes are above what the peer holds
    assert not db.regress(mine + 10)  # at or below the floor: already asked for
    assert db.regress(mine + 80) and db.own_floor == mine + 80


def test_finish_recovery_counts_live_records(db: Database) -> None:
    db.put_many("t", [("x", b""), ("y", b""), ("z", b"")])
    db.put("u", "w", b"")
    db.delete("t", "y")
    db.apply_batch([rec("p", 5, "b"), rec("q", 6, "b", tomb=True)], {"b": 6})
    assert db.recovering and completes(db)["a"] == 0
    assert db.finish_recovery() == 4  # x, z, w and p; the tombstones are not records
    assert not db.recovering
    assert completes(db) == {"a": tops(db)["a"], "b": 6}
    assert db.finish_recovery() == 4


# -- serving by origin ---------------------------------------------------------------------------------------


def test_origin_entries_in_version_order_after_a_version(db: Database) -> None:
    # Written out of version order, across two tables, tombstones among them, other origins interleaved.
    versions = random.Random(5).sample(range(100, 200), 30)
    db.apply_batch(
        [
            rec(f"k{i:02d}", version, "b" if i % 3 else "c", table="tu"[i % 2], tomb=i % 4 == 0)
            for i, version in enumerate(versions)
        ]
    )
    of_b = sorted((v for i, v in enumerate(versions) if i % 3), key=int)
    assert [e.version for e in all_of(db, "b")] == of_b
    assert all(e.origin == "b" for e in all_of(db, "b"))
    assert any(e.tombstone for e in all_of(db, "b"))
    pivot = of_b[6]
    assert [e.version for e in db.origin_entries("b", pivot, 5)] == of_b[7:12]
    assert [e.version for e in db.origin_entries("b", pivot - 1, 1)] == [pivot]
    assert db.origin_entries("b", of_b[-1], 10) == []
    assert db.origin_entries("nobody", 0, 10) == []

    paged: list[Entry] = []
    after = 0
    while page := db.origin_entries("c", after, 3):
        assert len(page) <= 3
        paged.extend(page)
        after = page[-1].version
    assert paged == all_of(db, "c") and len(paged) == 10


def test_origin_entries_serve_only_what_is_held_now(db: Database) -> None:
    db.apply_batch([rec("x", 10, "b"), rec("y", 11, "b")])
    db.apply_batch([rec("x", 20, "c")])  # c's version of x replaces b's
    assert [(e.id, e.version) for e in all_of(db, "b")] == [("y", 11)]
    assert [(e.id, e.version) for e in all_of(db, "c")] == [("x", 20)]


def test_origin_entries_use_the_origin_index(db: Database) -> None:
    db.apply_batch([rec(f"k{i}", 10 + i, "bc"[i % 2]) for i in range(200)])
    statements: list[str] = []
    db._conn.set_trace_callback(statements.append)
    try:
        assert len(db.origin_entries("b", 50, 10)) == 10
    finally:
        db._conn.set_trace_callback(None)
    (query,) = [s for s in statements if s.lstrip().upper().startswith("SELECT")]
    with raw(db.path) as conn:
        plan = [row[3] for row in conn.execute(f"EXPLAIN QUERY PLAN {query}")]
    assert any("USING INDEX records_by_origin" in step for step in plan), plan
    assert not any(step.startswith("SCAN") or "TEMP B-TREE" in step for step in plan), plan


# -- ownership of the file -----------------------------------------------------------------------------------


def test_new_file_is_recovering_and_stays_so_until_finished(tmp_path: Path, clock: FakeClock) -> None:
    with Store(tmp_path, "a", clock=clock) as store:
        db = store.database("d", create=True)
        assert db.recovering and db.origins() == {} and db.progress() == {}
        assert meta(db, "owner") == "a"
        mine = db.put("t", "x", b"")
    with Store(tmp_path, "a", clock=clock) as store:
        db = store.database("d")
        assert db.recovering
        assert db.origins() == {"a": Origin(complete=0, top=mine)}
        db.finish_recovery()
    with Store(tmp_path, "a", clock=clock) as store:
        db = store.database("d")
        assert not db.recovering
        assert db.origins() == {"a": Origin(complete=mine, top=mine)}


@pytest.mark.parametrize("create", [False, True])
def test_zero_byte_file_is_new(tmp_path: Path, clock: FakeClock, create: bool) -> None:
    (tmp_path / "d.sqlite").touch()
    with Store(tmp_path, "a", clock=clock) as store:
        db = store.database("d", create=create)
        assert db.recovering and db.origins() == {}
        assert len(db.epoch) == 32 and meta(db, "owner") == "a"
        assert db.put("t", "x", b"") == clock.us


def _pre_ownership(path: Path) -> None:
    """Make the file look like one an earlier version wrote: no owner, no origins table."""
    with raw(path) as conn:
        conn.execute("DELETE FROM meta WHERE key IN ('owner', 'recovering')")
        conn.execute("DROP TABLE origins")


def test_file_of_an_earlier_version_is_intact(tmp_path: Path, clock: FakeClock) -> None:
    with Store(tmp_path, "a", clock=clock) as store:
        db = store.database("d", create=True)
        epoch = db.epoch
        db.put_many("t", [("x", b""), ("y", b"")])
        gone = db.delete("t", "y")
        db.apply_batch([rec("p", 50, "b"), rec("q", 70, "b"), rec("r", 60, "c")], {"b": 70, "c": 60})
        held = {origin: all_of(db, origin) for origin in "abc"}
        clock_value = int(meta(db, "hlc"))
    _pre_ownership(tmp_path / "d.sqlite")
    with Store(tmp_path, "a", clock=clock) as store:
        db = store.database("d")
        assert db.epoch == epoch
        assert not db.recovering and meta(db, "owner") == "a"
        # The tops are rebuilt from the records; the completes start from nothing, but our own origin is whole.
        assert db.origins() == {
            "a": Origin(complete=clock_value, top=gone),
            "b": Origin(complete=0, top=70),
            "c": Origin(complete=0, top=60),
        }
        assert db.progress() == {"a": clock_value}
        assert {origin: all_of(db, origin) for origin in "abc"} == held


def _node_file(tmp_path: Path, clock: FakeClock, *, finished: bool) -> tuple[Path, int, str]:
    """A file of node b holding writes of b, a and c; returns its path, its clock and its epoch."""
    with Store(tmp_path / "b", "b", clock=clock) as store:
        db = store.database("d", create=True)
        db.put_many("t", [("x", b"b"), ("y", b"b")])
        db.apply_batch([rec("p", 50, "a"), rec("q", 70, "a")], {"a": 60})
        db.apply_batch([rec("r", 40, "c")], {"c": 40})
        if finished:
            db.finish_recovery()
        return db.path, int(meta(db, "hlc")), db.epoch


@pytest.mark.parametrize("finished", [True, False])
def test_file_of_another_node_is_adopted(tmp_path: Path, clock: FakeClock, finished: bool) -> None:
    path, b_clock, epoch = _node_file(tmp_path, clock, finished=finished)
    (tmp_path / "a").mkdir()
    shutil.copy(path, tmp_path / "a" / "d.sqlite")
    with Store(tmp_path / "a", "a", clock=clock) as store:
        db = store.database("d")
        assert db.epoch == epoch and meta(db, "owner") == "a"
        # Our own writes in it are only what b had been confirmed; b's are whole up to b's clock if b knew them so.
        assert db.recovering
        assert completes(db) == {"a": 60, "b": b_clock if finished else 0, "c": 40}
        assert db.progress() == ({"a": 60, "b": b_clock, "c": 40} if finished else {"a": 60, "c": 40})
        assert tops(db) == {"a": 70, "b": b_clock, "c": 40}
        mine = db.put("t", "z", b"a")
        assert mine > b_clock
    with Store(tmp_path / "a", "a", clock=clock) as store:
        db = store.database("d")  # reopened by its new owner: nothing is adopted twice
        assert db.recovering and completes(db)["a"] == 60
        assert db.finish_recovery() == 6
        assert completes(db)["a"] == mine


# -- retention -----------------------------------------------------------------------------------------------


def test_prune_by_retention(db: Database, clock: FakeClock) -> None:
    db.put_many("t", [(f"old{i}", b"") for i in range(10)])  # seqs 1-10
    clock.advance(1000)
    db.put_many("t", [(f"new{i}", b"") for i in range(10)])  # seqs 11-20
    now = clock() / 1e9
    head = db.last_seq()

    assert db.prune_audit(retention_seconds=5000, now=now) == 0
    assert db.first_seq() == 1
    assert db.prune_audit(retention_seconds=500, now=now) == 10
    assert db.first_seq() == 11
    assert [seq for seq, _ in whole_log(db)] == list(range(11, 21))
    assert db.prune_audit(retention_seconds=500, now=now) == 0
    assert db.prune_audit(retention_seconds=0.0, now=now + 1) == 10
    assert whole_log(db) == []
    assert db.last_seq() == head and db.first_seq() == head + 1  # sequences are never reused
    db.put("t", "after", b"")
    assert whole_log(db)[0][0] == head + 1


def test_pruning_never_changes_what_is_served(db: Database, clock: FakeClock) -> None:
    db.put_many("t", [(f"k{i}", b"1") for i in range(20)])
    db.apply_batch([rec(f"k{i}", clock.us + 100 + i, "b") for i in range(0, 20, 3)], {"b": clock.us + 200})
    clock.advance(1000)
    db.put_many("t", [(f"k{i}", b"2") for i in range(0, 20, 2)])
    db.delete("t", "k1")
    db.apply_batch([rec("late", 5, "c")])

    def served() -> dict[str, list[Entry]]:
        return {origin: all_of(db, origin) for origin in "abc"}

    before, held, digest = served(), db.origins(), db.digest()
    now = clock() / 1e9
    assert db.prune_audit(retention_seconds=500, now=now) > 0
    assert (served(), db.origins(), db.digest()) == (before, held, digest)
    assert db.prune_audit(retention_seconds=0.0, now=now + 1) > 0
    assert whole_log(db) == []
    assert (served(), db.origins(), db.digest()) == (before, held, digest)


# -- hybrid logical clock ------------------------------------------------------------------------------------


def test_hlc_functions() -> None:
    assert hlc.tick(5, lambda: 10_000) == 10
    assert hlc.tick(50, lambda: 10_000) == 51
    assert hlc.tick(50, lambda: 10_000, count=3) == 51
    assert hlc.receive(50, 40) == 50 and hlc.receive(50, 60) == 60
    assert hlc.physical_seconds(1_500_000) == 1.5


def test_hlc_tick_refuses_to_pass_64_bits() -> None:
    stopped = lambda: 0  # noqa: E731
    assert hlc.tick(MAX - 1, stopped) == MAX
    assert hlc.tick(MAX - 3, stopped, count=3) == MAX - 2
    with pytest.raises(hlc.ClockExhausted):
        hlc.tick(MAX, stopped)
    with pytest.raises(hlc.ClockExhausted):
        hlc.tick(MAX - 3, stopped, count=4)
    assert hlc.tick(0, lambda: MAX * 1000 + 999) == MAX
    with pytest.raises(hlc.ClockExhausted):
        hlc.tick(0, lambda: (MAX + 1) * 1000)
    assert issubclass(hlc.ClockExhausted, OverflowError)


def test_writes_at_the_end_of_the_clock_fail_whole(db: Database, clock: FakeClock) -> None:
    db.put("t", "x", b"1")
    clock.ns = (MAX - 1) * 1000  # two versions left
    before = (db.origins(), db.last_seq(), db.data_version(), meta(db, "hlc"), db.digest())
    with pytest.raises(hlc.ClockExhausted):
        db.put_many("t", [("y", b""), ("z", b""), ("x", b"2")])
    assert (db.origins(), db.last_seq(), db.data_version(), meta(db, "hlc"), db.digest()) == before
    assert db.get("t", "y") is None

    assert db.put_many("t", [("y", b""), ("z", b"")]) == [MAX - 1, MAX]
    before = (db.origins(), db.last_seq(), db.data_version(), meta(db, "hlc"), db.digest())
    with pytest.raises(hlc.ClockExhausted):
        db.put("t", "w", b"")
    with pytest.raises(hlc.ClockExhausted):
        db.delete("t", "x")
    assert (db.origins(), db.last_seq(), db.data_version(), meta(db, "hlc"), db.digest()) == before
    held = db.get("t", "x")
    assert held is not None and held.value == b"1"
    # Peers' records still apply: the clock only refuses to count on.
    assert db.apply_batch([rec("x", MAX, "b")], {"b": MAX}) == 1


def test_hlc_strictly_increasing_across_two_stores(tmp_path: Path) -> None:
    frozen = FakeClock()  # a wall clock that never moves: only the shared last value keeps versions apart
    with Store(tmp_path, "a", clock=frozen) as one, Store(tmp_path, "a", clock=frozen) as two:
        first = one.database("main", create=True)
        second = two.database("main")
        versions: list[int] = []
        for i in range(50):
            db = first if i % 2 == 0 else second
            if i % 5 == 0:
                versions.extend(db.put_many("t", [(f"k{i}", b""), (f"j{i}", b"")]))
            else:
                versions.append(db.put("t", f"k{i}", b""))
            if i == 25:
                frozen.advance(-3600)  # the wall clock steps back
        assert versions == sorted(set(versions))
        assert versions[0] == frozen.us + 3600 * 1_000_000


def test_hlc_moves_past_received_version(db: Database, clock: FakeClock) -> None:
    future = clock.us + 60_000_000
    db.apply_batch([rec("x", future, "b")])
    assert db.put("t", "y", b"") == future + 1
    # A write after the remote one wins over it, even on the same record.
    version = db.put("t", "x", b"mine")
    held = db.get("t", "x")
    assert held is not None and held.version == version > future and held.origin == "a"
    # A losing (older) remote record does not move the clock back.
    db.apply_batch([rec("z", 5, "b")])
    assert db.put("t", "z2", b"") == version + 1


# -- digest --------------------------------------------------------------------------------------------------


def _conflicting_entries() -> list[Entry]:
    # Many versions of few records, from several origins; an origin never reuses a version.
    rng = random.Random(3)
    versions = rng.sample(range(1, 100), 99) * 3
    origins = ["b"] * 99 + ["c"] * 99 + ["d"] * 99
    return [
        rec(f"k{rng.randrange(40)}", version, origin, bytes([i % 256]), rng.choice("tu"), rng.random() < 0.2)
        for i, (version, origin) in enumerate(zip(versions, origins, strict=True))
    ]


def test_digest_equal_whatever_the_order(tmp_path: Path) -> None:
    entries = _conflicting_entries()
    with Store(tmp_path / "one", "one") as one, Store(tmp_path / "two", "two") as two:
        first, second = one.database("d", create=True), two.database("d", create=True)
        first.apply_batch(entries)
        shuffled = entries[:]
        random.Random(11).shuffle(shuffled)
        for start in range(0, len(shuffled), 17):
            second.apply_batch(shuffled[start : start + 17])
        assert first.digest() == second.digest()
        assert set(first.digest()) == {"t", "u"}
        assert first.digest()["t"]["count"] == len(first.scan("t", None, 1000))

        live = first.scan("t", None, 1)[0]
        second.apply_batch([Entry("t", live.id, b"", live.version + 1, "z", True)])
        assert first.digest()["t"] != second.digest()["t"]
        assert first.digest()["u"] == second.digest()["u"]
        first.apply_batch([Entry("t", live.id, b"", live.version + 1, "z", True)])
        assert first.digest() == second.digest()


def test_digest_tells_a_tombstone_from_a_record(tmp_path: Path) -> None:
    with Store(tmp_path / "one", "one") as one, Store(tmp_path / "two", "two") as two:
        first, second = one.database("d", create=True), two.database("d", create=True)
        first.apply_batch([rec("x", 5, "b", b""), rec("y", 5, "b", tomb=True)])
        second.apply_batch([rec("x", 5, "b", tomb=True), rec("y", 5, "b", tomb=True)])
        assert first.digest()["t"]["count"] == 1 and second.digest()["t"]["count"] == 0
        assert first.digest()["t"]["digest"] != second.digest()["t"]["digest"]


# -- names, files, epochs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["", "a/b", "../etc", "a b", "x" * 65, "é", "a.sqlite"])
def test_bad_names(store: Store, db: Database, name: str) -> None:
    with pytest.raises(BadName) as error:
        store.database(name, create=True)
    assert repr(name) in str(error.value)
    assert isinstance(error.value, ValueError)
    with pytest.raises(BadName, match="table"):
        db.put(name, "id", b"")
    assert store.names() == ["main"]


def test_unknown_database(store: Store, tmp_path: Path) -> None:
    with pytest.raises(UnknownDatabase) as error:
        store.database("nope")
    assert str(error.value) == "unknown database 'nope'"
    assert isinstance(error.value, LookupError) and not isinstance(error.value, KeyError)
    assert not (tmp_path / "a" / "nope.sqlite").exists()
    assert store.names() == []
    created = store.database("nope", create=True)
    assert created.path == tmp_path / "a" / "nope.sqlite" and created.path.exists()
    assert store.database("nope") is created
    assert store.names() == ["nope"]


def test_epoch_survives_reopening_and_changes_on_recreation(tmp_path: Path) -> None:
    with Store(tmp_path, "a") as store:
        epoch = store.database("d", create=True).epoch
        assert len(epoch) == 32
    with Store(tmp_path, "a") as store:
        assert store.database("d").epoch == epoch
    for suffix in ("", "-wal", "-shm"):
        (tmp_path / f"d.sqlite{suffix}").unlink(missing_ok=True)
    with Store(tmp_path, "a") as store:
        assert store.database("d", create=True).epoch != epoch


def test_data_version_sees_every_commit(tmp_path: Path) -> None:
    with Store(tmp_path, "a") as one, Store(tmp_path, "a") as two:
        mine, other = one.database("d", create=True), two.database("d")
        start = mine.data_version()
        assert mine.data_version() == start
        other.put("t", "x", b"")
        after_other = mine.data_version()
        assert after_other != start
        mine.put("t", "y", b"")
        after_mine = mine.data_version()
        assert after_mine != after_other
        assert mine.delete("t", "absent") is None
        assert mine.data_version() == after_mine


# -- several processes ---------------------------------------------------------------------------------------


def _write_from_process(data_dir: str, prefix: str, count: int, barrier: Any) -> None:
    barrier.wait(timeout=30)
    with Store(data_dir, "a") as store:
        db = store.database("shared", create=True)
        for i in range(count):
            db.put("t", f"{prefix}{i:04d}", prefix.encode())


def test_two_processes_write_one_database(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(2)
    processes = [
        context.Process(target=_write_from_process, args=(str(tmp_path), prefix, 500, barrier)) for prefix in ("p", "q")
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=90)
    assert [process.exitcode for process in processes] == [0, 0]

    with Store(tmp_path, "a") as store:
        db = store.database("shared")
        records = db.scan("t", None, 5000)
        assert len(records) == 1000
        assert len({e.version for e in records}) == 1000
        log = whole_log(db)
        assert len(log) == 1000 and len({seq for seq, _ in log}) == 1000
        # Writers are serialized and the clock is read inside the write transaction: versions follow commit order.
        versions = [e.version for _, e in log]
        assert versions == sorted(versions)
        assert {e.id[0] for _, e in log} == {"p", "q"}
        assert all(e.value == e.id[0].encode() and e.origin == "a" for e in records)
        # Every write of both processes is served from the origin index, in version order.
        assert [e.version for e in all_of(db, "a")] == sorted(e.version for e in records)


def test_a_recovering_file_starts_its_clock_max_clock_skew_ahead(tmp_path: Path, clock: FakeClock) -> None:
    with Store(tmp_path / "a", "a", clock=clock, clock_lead=60.0) as store:
        new = store.database("d", create=True)
        assert new.recovering
        assert new.put("t", "x", b"") == clock.us + 60_000_000
        new.finish_recovery()
    clock.advance(1)
    with Store(tmp_path / "a", "a", clock=clock, clock_lead=60.0) as store:
        # Reopening an intact file keeps its clock: no second lead.
        assert store.database("d").put("t", "y", b"") == clock.us - 1_000_000 + 60_000_000 + 1
    with Store(tmp_path / "b", "b", clock=clock, clock_lead=60.0) as store:
        (tmp_path / "b").mkdir(exist_ok=True)
    for suffix in ("", "-wal", "-shm"):
        source = tmp_path / "a" / f"d.sqlite{suffix}"
        if source.exists():
            (tmp_path / "b" / f"d.sqlite{suffix}").write_bytes(source.read_bytes())
    clock.advance(100)
    with Store(tmp_path / "b", "b", clock=clock, clock_lead=60.0) as store:
        adopted = store.database("d")
        assert adopted.recovering
        assert adopted.put("t", "z", b"") == clock.us + 60_000_000


def test_marks_move_the_clock_past_what_peers_hold(db: Database, clock: FakeClock) -> None:
    ahead = clock.us + 30_000_000
    db.apply_batch([], {"main-peer": ahead})
    assert db.put("t", "x", b"") == ahead + 1


def _cache_size(db: Database) -> int:
    return db._conn.execute("PRAGMA cache_size").fetchone()[0]


def _statements(db: Database) -> int:
    """How many statements the connection keeps prepared (its LRU cache, seen through the garbage collector)."""
    (cache,) = [held for held in gc.get_referents(db._conn) if hasattr(held, "cache_info")]
    return cache.cache_info().currsize


def test_a_database_nobody_commits_to_becomes_lean_and_a_commit_brings_its_cache_back(store: Store) -> None:
    db = store.database("main", create=True)
    idle = store.database("idle", create=True)
    for i in range(50):
        db.put("t", f"k{i}", b"v" * 100)
    full = _cache_size(db)
    assert store.trim() == 1  # idle had no commit since it was opened; main had some: it stays as it is
    assert _cache_size(idle) == 2 and _statements(idle) == 1  # only the PRAGMA just asked
    assert _cache_size(db) == full and _statements(db) > 1
    assert store.trim() == 1 and _cache_size(db) == 2 and _statements(db) == 1  # now main too
    assert store.trim() == 0  # lean already

    # Lean, a database reads and writes as before; a commit gives its cache back on the next call.
    assert db.get("t", "k7") is not None and len(db.scan("t", None, 100)) == 50
    db.put("t", "again", b"v")
    assert db.trim() is False and _cache_size(db) == full
    assert db.trim() is True and _cache_size(db) == 2


def test_trim_never_waits_for_a_caller_and_skips_a_closed_database(store: Store) -> None:
    db = store.database("main", create=True)
    db.trim()
    seen: list[bool] = []

    def value(version: int) -> bytes:
        # Inside the write transaction: a trim from another thread finds the connection in use and skips it.
        trimmer = threading.Thread(target=lambda: seen.append(db.trim()))
        trimmer.start()
        trimmer.join()
        return b"during"

    db.put_versioned("t", "busy", value)
    assert seen == [False] and db.get("t", "busy") is not None
    db.close()
    assert db.trim() is False  # closed: nothing to trim, no error


# -- closing ----------------------------------------------------------------------------------------------------


def test_the_store_closes_its_databases_at_once_and_each_close_still_checkpoints(
    tmp_path: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Closing a file's last connection checkpoints its WAL and syncs the file: one at a time, a worker holding a
    # thousand databases spent longer than its shutdown deadline here. A close that waits at a barrier for three
    # others to have begun passes only when closes run at once; one after another the barrier breaks.
    store = Store(tmp_path / "a", "a", clock=clock)
    names = [f"db{index}" for index in range(8)]
    versions = {name: store.database(name, create=True).put("t", "x", name.encode()) for name in names}
    assert all((tmp_path / "a" / f"{name}.sqlite-wal").exists() for name in names)
    together = threading.Barrier(4, timeout=10.0)  # a deadline on the condition, not a measure of speed
    closing_threads: set[str] = set()
    close = Database.close

    def close_together(self: Database) -> None:
        closing_threads.add(threading.current_thread().name)
        together.wait()
        close(self)

    monkeypatch.setattr(Database, "close", close_together)
    store.close()
    monkeypatch.undo()

    assert len(closing_threads) > 1
    assert not list((tmp_path / "a").glob("*-wal")), "a close skipped its checkpoint"
    with Store(tmp_path / "a", "a", clock=clock) as again:
        for name in names:
            assert again.database(name).get("t", "x") == Entry("t", "x", name.encode(), versions[name], "a", False)


def test_a_failed_close_does_not_keep_the_others_open(
    tmp_path: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(tmp_path / "a", "a", clock=clock)
    databases = [store.database(f"db{index}", create=True) for index in range(6)]
    for db in databases:
        db.put("t", "x", b"1")
    close = Database.close

    def close_or_fail(self: Database) -> None:
        close(self)
        if self is databases[2]:
            raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(Database, "close", close_or_fail)
    with pytest.raises(sqlite3.OperationalError, match="disk I/O error"):
        store.close()
    monkeypatch.undo()
    assert not list((tmp_path / "a").glob("*-wal"))
