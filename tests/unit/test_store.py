from __future__ import annotations

import multiprocessing
import random
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from shared import hlc
from shared.store import (
    BadName,
    BadRecord,
    Cursor,
    Database,
    NodeRow,
    Store,
    UnknownDatabase,
    delete_node,
    read_nodes,
    write_node,
)
from shared.wire import Entry

T0 = 1_700_000_000.0


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


def whole_log(db: Database) -> list[tuple[int, Entry]]:
    rows, _ = db.audit_after(0, 1_000_000)
    return rows


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
    assert db.entry_version_at(2) == log[1][1].version
    assert db.entry_version_at(99) is None


def test_rejects_empty_ids(db: Database) -> None:
    with pytest.raises(BadRecord):
        db.put("t", "", b"x")
    assert db.last_seq() == 0


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
    assert db.apply_batch("p", [rec("x", 100, "b", b"held")], None) == 1
    head = db.last_seq()
    assert db.apply_batch("p", [rec("x", version, origin, b"incoming")], None) == int(wins)
    held = db.get("t", "x")
    assert held is not None
    assert (held.version, held.origin, held.value) == ((version, origin, b"incoming") if wins else (100, "b", b"held"))
    # A skipped record leaves no audit entry: that is what stops records looping around a mesh.
    assert db.last_seq() == head + int(wins)


@pytest.mark.parametrize(("version", "wins"), [(101, True), (99, False)])
def test_tombstones_resolve_like_records(db: Database, version: int, wins: bool) -> None:
    db.apply_batch("p", [rec("x", 100, "b")], None)
    assert db.apply_batch("p", [rec("x", version, "b", tomb=True)], None) == int(wins)
    assert (db.get("t", "x") is None) == wins
    # And a live record beats an older tombstone.
    assert db.apply_batch("p", [rec("x", 200, "b", b"back")], None) == 1
    assert db.get("t", "x") is not None


def test_reapplied_batch_is_skipped_whole(db: Database) -> None:
    batch = [rec(f"k{i}", 10 + i, "b") for i in range(20)]
    assert db.apply_batch("p", batch, 20) == 20
    head = db.last_seq()
    assert db.apply_batch("p", batch, 20) == 0
    assert db.last_seq() == head


def test_several_versions_of_one_record_in_a_batch_apply_in_order(db: Database) -> None:
    won = db.apply_batch("p", [rec("x", 5, "b", b"5"), rec("x", 7, "b", b"7"), rec("x", 6, "b", b"6")], None)
    assert won == 2
    held = db.get("t", "x")
    assert held is not None and held.value == b"7"
    assert [e.version for _, e in whole_log(db)] == [5, 7]


def test_applied_records_keep_their_origin_in_the_log(db: Database) -> None:
    db.apply_batch("p", [rec("x", 5, "c")], 1)
    assert [e.origin for _, e in whole_log(db)] == ["c"]


def test_apply_checks_peer_input_before_writing(db: Database) -> None:
    with pytest.raises(BadName, match="bad/table"):
        db.apply_batch("p", [rec("x", 5, "b"), rec("y", 5, "b", table="bad/table")], 1)
    with pytest.raises(BadName, match="not a node"):
        db.apply_batch("p", [rec("x", 5, "not a node")], 1)
    with pytest.raises(BadRecord):
        db.apply_batch("p", [rec("x", 0, "b")], 1)
    with pytest.raises(BadRecord):
        db.apply_batch("p", [rec("x", 2**63, "b")], 1)
    assert db.get("t", "x") is None and db.cursor("p") is None and db.last_seq() == 0


# -- atomicity of a batch and its cursor ---------------------------------------------------------------------


@pytest.mark.parametrize("failure", ["record", "cursor"])
def test_failed_batch_moves_neither_records_nor_cursor(db: Database, clock: FakeClock, failure: str) -> None:
    db.apply_batch("p", [rec("x", 10, "b", b"old")], 7, 10, "e1")
    before = (db.cursor("p"), db.last_seq(), db.data_version())
    future = clock.us + 10**9
    good = [rec("x", future, "b", b"new"), rec("y", future + 1, "b")]
    if failure == "record":
        # The last entry violates NOT NULL after the first ones were written inside the transaction.
        batch: list[Any] = [*good, Entry("t", "z", None, future + 2, "b")]  # type: ignore[arg-type]
        cursor_seq: Any = 9
    else:
        # Every record is written, then the cursor update fails.
        batch, cursor_seq = good, object()
    with pytest.raises((sqlite3.IntegrityError, sqlite3.ProgrammingError)):
        db.apply_batch("p", batch, cursor_seq, 22, "e1")
    assert (db.cursor("p"), db.last_seq(), db.data_version()) == before
    held = db.get("t", "x")
    assert held is not None and held.value == b"old"
    assert db.get("t", "y") is None
    # The clock did not move past the failed batch either, and the connection is usable again.
    assert db.put("t", "w", b"") == clock.us
    assert db.apply_batch("p", good, 9, future + 1, "e1") == 2
    assert db.cursor("p") == Cursor(seq=9, version=future + 1, epoch="e1")


def test_batch_without_cursor_leaves_cursor_alone(db: Database) -> None:
    db.apply_batch("p", [rec("x", 10, "b")], 7, 10, "e1")
    db.apply_batch("p", [rec("y", 11, "a")], None)
    cursor = db.cursor("p")
    assert cursor is not None and cursor.seq == 7
    # An all-excluded batch still moves the cursor.
    db.apply_batch("p", [], 12, 30, "e1")
    assert db.cursor("p") == Cursor(seq=12, version=30, epoch="e1")


# -- hybrid logical clock ------------------------------------------------------------------------------------


def test_hlc_functions() -> None:
    assert hlc.tick(5, lambda: 10_000) == 10
    assert hlc.tick(50, lambda: 10_000) == 51
    assert hlc.receive(50, 40) == 50 and hlc.receive(50, 60) == 60
    assert hlc.physical_seconds(1_500_000) == 1.5


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
    db.apply_batch("p", [rec("x", future, "b")], None)
    assert db.put("t", "y", b"") == future + 1
    # A write after the remote one wins over it, even on the same record.
    version = db.put("t", "x", b"mine")
    held = db.get("t", "x")
    assert held is not None and held.version == version > future and held.origin == "a"
    # A losing (older) remote record does not move the clock back.
    db.apply_batch("p", [rec("z", 5, "b")], None)
    assert db.put("t", "z2", b"") == version + 1


def test_copy_batch_moves_the_clock(db: Database, clock: FakeClock) -> None:
    db.begin_copy("p", 10, "e")
    db.apply_copy_batch("p", [rec("x", clock.us + 1000, "b")], "t", "x")
    assert db.put("t", "y", b"") == clock.us + 1001


# -- streaming -----------------------------------------------------------------------------------------------


def test_audit_after_exclusions_and_highest_scanned(db: Database) -> None:
    origins = ["a", "b", "b", "a", "b"]
    db.apply_batch("p", [rec(f"k{i}", 10 + i, origin) for i, origin in enumerate(origins)], None)
    skip_b = frozenset({"b"})

    rows, scanned = db.audit_after(0, 10, skip_b)
    assert [(seq, e.origin) for seq, e in rows] == [(1, "a"), (4, "a")]
    assert scanned == 5  # past the trailing excluded entry too

    assert [seq for seq, _ in db.audit_after(0, 1, skip_b)[0]] == [1]
    assert db.audit_after(0, 1, skip_b)[1] == 1  # a full batch stops at its last entry
    assert db.audit_after(1, 1, skip_b) == ([(4, rows[1][1])], 4)
    assert db.audit_after(4, 1, skip_b) == ([], 5)
    assert db.audit_after(5, 1, skip_b) == ([], 5)

    rows, scanned = db.audit_after(0, 2)
    assert [seq for seq, _ in rows] == [1, 2] and scanned == 2
    assert db.audit_after(5, 10) == ([], 5)
    assert db.audit_after(2, 10, frozenset({"a", "b"})) == ([], 5)


def test_audit_after_bounds_a_long_excluded_run(db: Database) -> None:
    db.apply_batch("p", [rec(f"k{i:05d}", 10 + i, "b") for i in range(20_000)], None)
    db.apply_batch("p", [rec("last", 50_000, "c")], None)
    head = db.last_seq()
    cursor, calls, found = 0, 0, []
    while cursor < head:
        rows, scanned = db.audit_after(cursor, 10, frozenset({"b"}))
        assert scanned > cursor
        found.extend(rows)
        cursor = scanned
        calls += 1
    assert [(seq, e.id) for seq, e in found] == [(head, "last")]
    assert calls > 1  # no single call read the whole run


def test_audit_after_skips_a_pruned_prefix(db: Database, clock: FakeClock) -> None:
    db.put_many("t", [(f"k{i}", b"") for i in range(10)])
    clock.advance(100)
    db.put("t", "young", b"")
    assert db.prune_audit([], retention_seconds=50, now=clock() / 1e9) == 10
    assert db.first_seq() == 11
    rows, scanned = db.audit_after(0, 5, frozenset({"b"}))
    assert [seq for seq, _ in rows] == [11] and scanned == 11


def test_copy_walk_order_resume_and_exclusions(db: Database) -> None:
    ids = [f"r{i:03d}" for i in range(40)]
    shuffled = ids[:]
    random.Random(7).shuffle(shuffled)
    entries = [
        rec(record_id, 100 + i, "c" if i % 4 == 0 else "b", tomb=i % 5 == 0) for i, record_id in enumerate(shuffled)
    ]
    db.apply_batch("p", entries, None)
    db.put("other", "x", b"")

    walked: list[Entry] = []
    after = ""
    while page := db.copy_walk("t", after, 7, frozenset({"c"})):
        assert len(page) <= 7
        walked.extend(page)
        after = page[-1].id
    expected = sorted((e for e in entries if e.origin != "c"), key=lambda e: e.id)
    assert walked == expected
    assert any(e.tombstone for e in walked)  # tombstones travel in a copy
    assert len(db.copy_walk("t", None, 100)) == 40
    assert db.copy_walk("t", "r039", 10) == []


def test_records_by_origin_after_pages(db: Database) -> None:
    db.apply_batch("p", [rec(f"k{i:02d}", 100 + i, "a" if i % 2 else "b") for i in range(20)], None)
    db.apply_batch("p", [rec("z", 500, "a", table="s", tomb=True)], None)
    got: list[Entry] = []
    after: tuple[str, str] | None = None
    while page := db.records_by_origin_after("a", 105, 3, after):
        got.extend(page)
        after = (page[-1].table, page[-1].id)
    assert [(e.table, e.id) for e in got] == [("s", "z")] + [("t", f"k{i:02d}") for i in range(7, 20, 2)]
    assert got[0].tombstone


def test_last_own_version(db: Database) -> None:
    assert db.last_own_version() == 0
    mine = db.put("t", "x", b"")
    db.apply_batch("p", [rec("y", mine + 100, "b")], None)
    assert db.last_own_version() == mine
    db.apply_batch("p", [rec("z", mine + 200, "a")], None)  # our own record relayed back
    assert db.last_own_version() == mine + 200


# -- cursors -------------------------------------------------------------------------------------------------


def test_cursor_copy_lifecycle(db: Database) -> None:
    assert db.cursor("p") is None
    db.begin_copy("p", 40, "e1")
    assert db.cursor("p") == Cursor(seq=None, epoch="e1", copy_snapshot=40, copies=1)
    assert db.apply_copy_batch("p", [rec("a1", 10, "b"), rec("a2", 11, "b")], "t", "a2") == 2
    assert db.cursor("p") == Cursor(seq=None, epoch="e1", copy_snapshot=40, copy_table="t", copy_after="a2", copies=1)
    db.finish_copy("p", 40, "e1")
    assert db.cursor("p") == Cursor(seq=40, epoch="e1", copies=1)

    db.apply_batch("p", [], 45, 99, "e1")
    db.begin_copy("p", 60, "e2")  # a second copy drops the live position
    assert db.cursor("p") == Cursor(seq=None, epoch="e2", copy_snapshot=60, copies=2)
    db.finish_copy("p", 60, "e2", version=77)
    db.reset_cursor("p")
    assert db.cursor("p") == Cursor(seq=None, copies=2)
    assert db.cursor("q") is None


def test_copy_batch_and_position_are_one_transaction(db: Database) -> None:
    db.begin_copy("p", 40, "e1")
    with pytest.raises(sqlite3.IntegrityError):
        db.apply_copy_batch("p", [rec("a1", 10, "b"), Entry("t", "a2", None, 11, "b")], "t", "a2")  # type: ignore[arg-type]
    assert db.get("t", "a1") is None
    assert db.cursor("p") == Cursor(seq=None, epoch="e1", copy_snapshot=40, copies=1)


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
        first.apply_batch("p", entries, None)
        shuffled = entries[:]
        random.Random(11).shuffle(shuffled)
        for start in range(0, len(shuffled), 17):
            second.apply_batch("q", shuffled[start : start + 17], None)
        assert first.digest() == second.digest()
        assert set(first.digest()) == {"t", "u"}
        assert first.digest()["t"]["count"] == len(first.scan("t", None, 1000))

        live = first.scan("t", None, 1)[0]
        second.apply_batch("q", [Entry("t", live.id, b"", live.version + 1, "z", True)], None)
        assert first.digest()["t"] != second.digest()["t"]
        assert first.digest()["u"] == second.digest()["u"]
        first.apply_batch("q", [Entry("t", live.id, b"", live.version + 1, "z", True)], None)
        assert first.digest() == second.digest()


def test_digest_tells_a_tombstone_from_a_record(tmp_path: Path) -> None:
    with Store(tmp_path / "one", "one") as one, Store(tmp_path / "two", "two") as two:
        first, second = one.database("d", create=True), two.database("d", create=True)
        first.apply_batch("p", [rec("x", 5, "b", b""), rec("y", 5, "b", tomb=True)], None)
        second.apply_batch("p", [rec("x", 5, "b", tomb=True), rec("y", 5, "b", tomb=True)], None)
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
    with pytest.raises(BadName):
        write_node(db, NodeRow(name=name, url="wss://x:1"))
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


# -- retention -----------------------------------------------------------------------------------------------


def test_prune_by_acks_and_retention(db: Database, clock: FakeClock) -> None:
    db.put_many("t", [(f"old{i}", b"") for i in range(10)])  # seqs 1-10
    clock.advance(1000)
    db.put_many("t", [(f"new{i}", b"") for i in range(10)])  # seqs 11-20
    now = clock() / 1e9
    head = db.last_seq()

    assert db.prune_audit([], retention_seconds=5000, now=now) == 0  # no peers: nothing counts as acked
    db.record_ack("p", 15)
    assert db.prune_audit(["p", "q"], retention_seconds=5000, now=now) == 0  # q has not confirmed anything
    db.record_ack("q", 4)
    assert db.acks() == {"p": 15, "q": 4}
    assert db.prune_audit(["p", "q"], retention_seconds=5000, now=now) == 4
    assert db.first_seq() == 5
    # The window drops the old entries whoever still needs them.
    assert db.prune_audit(["p", "q"], retention_seconds=500, now=now) == 6
    assert db.first_seq() == 11
    assert db.prune_audit(["p"], retention_seconds=5000, now=now) == 5
    assert [seq for seq, _ in whole_log(db)] == list(range(16, 21))
    assert db.prune_audit([], retention_seconds=0.0, now=now + 1) == 5
    assert whole_log(db) == []
    assert db.last_seq() == head and db.first_seq() == head + 1  # sequences are never reused
    db.put("t", "after", b"")
    assert whole_log(db)[0][0] == head + 1


# -- the node registry ---------------------------------------------------------------------------------------


def test_registry_rows(db: Database) -> None:
    write_node(db, NodeRow(name="n1", url="wss://n1:1", replicates=True, holds=["main"]))
    write_node(db, NodeRow(name="n2", url="wss://n2:1", databases=["main"], revoked=["0a"]))
    db.put("nodes", "broken", b"\xc1")  # not msgpack
    db.put("nodes", "wrong", msgspec.msgpack.encode({"name": "wrong", "url": 5}))
    db.put("nodes", "renamed", msgspec.msgpack.encode({"name": "other", "url": "wss://r:1", "extra": 1}))
    nodes = read_nodes(db)
    assert set(nodes) == {"n1", "n2", "renamed"}
    assert nodes["n1"] == NodeRow(name="n1", url="wss://n1:1", replicates=True, holds=["main"])
    assert nodes["n1"].databases == ["*"]
    assert nodes["n2"].revoked == ["0a"] and not nodes["n2"].leader
    assert nodes["renamed"].name == "renamed"
    assert delete_node(db, "n1") is not None
    assert delete_node(db, "n1") is None
    assert set(read_nodes(db)) == {"n2", "renamed"}


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
