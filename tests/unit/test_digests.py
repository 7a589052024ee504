"""The bucket digests and record checksums of the store.

The property test drives a database through any sequence of local writes, deletes, applied batches, repairs,
damage made behind the store's back and the scrub that finds it, and checks after every step that the digests
the triggers keep equal the digests recomputed from the rows, and that the tree built on them agrees with a
tree built from scratch.
"""

from __future__ import annotations

import asyncio
import sqlite3
import tempfile
from contextlib import closing
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replicator.shared import digests, hlc
from replicator.shared.store import DamagedRecord, Database, Store
from replicator.shared.wire import Entry
from replicator.workers.antientropy import Round, local_transport
from tests.unit.test_store import FakeClock

IDS = [f"k{i}" for i in range(12)]


def _open(root: Path, node: str = "a", clock: FakeClock | None = None) -> Database:
    store = Store(root / node, node, clock=clock or FakeClock(), synchronous="OFF")
    return store.database("d", create=True)


def _sql(db: Database, statement: str, *args: object) -> None:
    """Change the file behind the store's back, as the sqlite3 shell would."""
    with closing(sqlite3.connect(db.path)) as conn:
        conn.execute(statement, args)
        conn.commit()


def _tree_from_rows(db: Database, table: str) -> dict[int, list[digests.Digest]]:
    """Level-1 children of the root, computed from the rows alone (no stored digests)."""
    buckets = db.recount_digests(table)
    return {0: digests.children_from_buckets({b: d for b, d in buckets.items() if b >= 0}, 0, 0)}


def _assert_consistent(db: Database) -> None:
    for table in db.tables():
        assert db.bucket_digests(table) == db.recount_digests(table), table
        assert db.children(table, 0, [0]) == [_tree_from_rows(db, table)[0]]
    assert db.check_digests() == 0


steps = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.sampled_from(IDS), st.binary(max_size=8)),
        st.tuples(st.just("delete"), st.sampled_from(IDS)),
        st.tuples(
            st.just("apply"),
            st.sampled_from(IDS),
            st.integers(1, 5_000_000_000_000_000),
            st.sampled_from(["b", "c"]),
            st.booleans(),
            st.binary(max_size=8),
        ),
        st.tuples(st.just("damage"), st.sampled_from(IDS)),
        st.tuples(st.just("foreign"), st.sampled_from(IDS)),
        st.tuples(st.just("shell_delete"), st.sampled_from(IDS)),
        st.tuples(st.just("scrub")),
        st.tuples(st.just("drop"), st.sampled_from(IDS)),
        st.tuples(st.just("purge")),
        st.tuples(st.just("repair"), st.sampled_from(IDS), st.binary(max_size=8)),
    ),
    max_size=30,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps)
def test_incremental_digests_equal_digests_recomputed_from_scratch(script: list[tuple]) -> None:
    with tempfile.TemporaryDirectory() as root:
        clock = FakeClock()
        db = _open(Path(root), clock=clock)
        peer = _open(Path(root), "p", clock=clock)
        # Rows added or rewritten behind the store's back are counted when the scrub recounts the digests.
        behind = False
        for step in script:
            clock.advance(0.001)
            match step:
                case ("put", record_id, value):
                    db.put("t", record_id, value)
                case ("delete", record_id):
                    db.delete("t", record_id)
                case ("apply", record_id, version, origin, tombstone, value):
                    db.apply_batch([Entry("t", record_id, b"" if tombstone else value, version, origin, tombstone)])
                case ("damage", record_id):
                    _sql(db, "UPDATE records SET value = value || X'ff' WHERE tbl = 't' AND id = ?", record_id)
                case ("foreign", record_id):
                    behind = True
                    # A row written by another tool (no bucket, no checksum). Not INSERT OR REPLACE: SQLite
                    # fires no delete trigger for the row REPLACE removes (see the test below).
                    _sql(db, "DELETE FROM records WHERE tbl = 't' AND id = ?", record_id)
                    _sql(
                        db,
                        "INSERT INTO records (tbl, id, value, version, origin, tombstone)"
                        " VALUES ('t', ?, X'01', 7, 'z', 0)",
                        record_id,
                    )
                case ("shell_delete", record_id):
                    _sql(db, "DELETE FROM records WHERE tbl = 't' AND id = ?", record_id)
                case ("scrub",):
                    after: int | None = 0
                    while after is not None:
                        after, _ = db.scrub(after, 5)
                    db.check_digests()
                    behind = False
                case ("drop", record_id):
                    with closing(sqlite3.connect(db.path)) as conn:
                        held = conn.execute(
                            "SELECT version, origin FROM records WHERE tbl = 't' AND id = ?", (record_id,)
                        ).fetchone()
                    if held is not None:
                        db.drop_superseded("t", [(record_id, held[0], held[1])])
                case ("purge",):
                    db.purge_tombstones({"a": hlc.MAX_VERSION, "b": hlc.MAX_VERSION}, clock.us + 10**6)
                case ("repair", record_id, value):
                    peer.put("t", record_id, msgspec.msgpack.encode(value))
                    asyncio.run(Round(db, local_transport(peer), rate=0).run())
            if not behind:
                _assert_consistent(db)
        db.check_digests()
        _assert_consistent(db)


def test_checksum_covers_every_field() -> None:
    base = ("t", "id", 5, "a", False, b"v")
    variants = [
        ("u", "id", 5, "a", False, b"v"),
        ("t", "ie", 5, "a", False, b"v"),
        ("t", "id", 6, "a", False, b"v"),
        ("t", "id", 5, "b", False, b"v"),
        ("t", "id", 5, "a", True, b"v"),
        ("t", "id", 5, "a", False, b"w"),
    ]
    seen = {digests.checksum(*base)}
    for variant in variants:
        value = digests.checksum(*variant)
        assert 0 <= value < 2**digests.CHECKSUM_BITS
        seen.add(value)
    assert len(seen) == len(variants) + 1


def test_tree_levels_nest() -> None:
    bucket = digests.bucket_of("some id")
    assert digests.path(bucket, "some id", digests.STORED_LEVEL) == bucket
    deep = digests.path(bucket, "some id", 5)
    assert digests.bucket_above(5, deep) == bucket
    assert digests.path(bucket, "some id", 6) >> digests.FANOUT_BITS == deep
    low, high = digests.bucket_range(1, digests.path(bucket, "some id", 1))
    assert low <= bucket < high and high - low == 256


def test_ids_written_in_sequence_share_buckets() -> None:
    """What keeps digest upkeep cheap on the write path: a batch of sequential ids touches few buckets."""
    batch = [f"order-{i:06d}" for i in range(1000, 1500)]
    assert len({digests.bucket_of(record_id) for record_id in batch}) == 5
    spread = {digests.bucket_of(f"user-{i}") for i in range(10_000)}
    assert len(spread) > 90  # and many ids still spread over many buckets


def test_damage_in_place_is_never_served_and_moves_the_digest(tmp_path: Path) -> None:
    db = _open(tmp_path)
    db.put("t", "x", b"precious")
    db.put("t", "y", b"fine")
    before = db.digest()
    _sql(db, "UPDATE records SET value = X'00' WHERE id = 'x'")
    assert db.digest() == before  # the bytes changed, the stored checksum did not: only reading finds it
    with pytest.raises(DamagedRecord) as caught:
        db.get("t", "x")
    assert caught.value.newly and "t/x" in str(caught.value) and "precious" not in str(caught.value)
    assert db.checksum_failures == 1
    assert db.digest() != before  # marked: the next anti-entropy round sees the bucket differ
    with pytest.raises(DamagedRecord) as again:
        db.get("t", "x")
    assert not again.value.newly and db.checksum_failures == 1  # counted once
    with pytest.raises(DamagedRecord):
        db.scan("t", None, 10)
    assert [e.id for e in db.scan("t", None, 10, skip_damaged=True)] == ["y"]
    assert db.get("t", "y") is not None


def test_a_damaged_row_gives_way_to_any_healthy_version(tmp_path: Path) -> None:
    db = _open(tmp_path)
    version = db.put("t", "x", b"good")
    _sql(db, "UPDATE records SET value = X'00' WHERE id = 'x'")
    assert db.fetch("t", ["x"]) == ([], ["x"])
    # The very version held (an identity tie) replaces the damaged row; so would an older one.
    assert db.apply_batch([Entry("t", "x", b"good", version, "a", False)]) == 1
    assert db.get("t", "x").value == b"good"


def test_one_version_with_two_contents_settles_on_the_higher_checksum(tmp_path: Path) -> None:
    one, two = _open(tmp_path, "b"), _open(tmp_path, "c")
    first, second = Entry("t", "x", b"one", 9, "a", False), Entry("t", "x", b"two", 9, "a", False)
    one.apply_batch([first])
    two.apply_batch([second])
    one.apply_batch([second])
    two.apply_batch([first])
    assert one.get("t", "x") == two.get("t", "x")


def test_the_sender_stops_an_origin_at_a_damaged_record(tmp_path: Path) -> None:
    db = _open(tmp_path)
    versions = db.put_many("t", [("a", b"1"), ("b", b"2"), ("c", b"3")])
    _sql(db, "UPDATE records SET value = X'00' WHERE id = 'b'")
    entries, damaged = db.serve_origin("a", 0, 10)
    assert [e.id for e in entries] == ["a"] and damaged is not None and damaged.id == "b"
    assert db.origin_entries("a", versions[1], 10)[0].id == "c"


def test_an_earlier_schema_is_checksummed_from_what_it_holds(tmp_path: Path) -> None:
    db = _open(tmp_path)
    db.put_many("t", [("a", b"1"), ("b", b"2")])
    expected = db.digest()
    path = db.path
    db.close()
    with closing(sqlite3.connect(path)) as conn:
        for trigger in ("records_digest_delete", "records_digest_update"):
            conn.execute(f"DROP TRIGGER {trigger}")
        conn.execute("DROP TABLE digests")
        conn.execute("ALTER TABLE records DROP COLUMN checksum")
        conn.execute("DROP INDEX records_by_bucket")
        conn.execute("ALTER TABLE records DROP COLUMN bucket")
        conn.execute("PRAGMA user_version = 0")
        conn.commit()
    again = _open(tmp_path)
    assert again.digest() == expected
    assert again.get("t", "a").value == b"1"
    _assert_consistent(again)


def test_a_dropped_trigger_is_restored_and_the_digests_recounted(tmp_path: Path) -> None:
    db = _open(tmp_path)
    db.put_many("t", [("a", b"1"), ("b", b"2")])
    path = db.path
    db.close()
    with closing(sqlite3.connect(path)) as conn:
        conn.execute("DROP TRIGGER records_digest_delete")
        conn.execute("DELETE FROM records WHERE id = 'a'")
        conn.commit()
    again = _open(tmp_path)
    _assert_consistent(again)
    assert again.digest()["t"]["count"] == 1


def test_edited_digests_are_found_and_fixed(tmp_path: Path) -> None:
    db = _open(tmp_path)
    db.put_many("t", [(f"k{i}", b"v") for i in range(50)])
    _sql(db, "UPDATE digests SET xor = xor + 1 WHERE bucket IN (SELECT bucket FROM digests LIMIT 3)")
    _sql(db, "UPDATE digests SET count = count + 1")
    assert db.check_digests() > 0
    _assert_consistent(db)


def test_insert_or_replace_behind_the_back_is_caught_by_the_digest_check(tmp_path: Path) -> None:
    """REPLACE deletes the old row without firing delete triggers (unless recursive_triggers is on, which the
    shell does not set), so the stored digest keeps the old row: the scrub's digest check recounts it."""
    db = _open(tmp_path)
    db.put_many("t", [("a", b"1"), ("b", b"2")])
    _sql(
        db,
        "INSERT OR REPLACE INTO records (tbl, id, value, version, origin, tombstone)"
        " VALUES ('t', 'a', X'01', 7, 'z', 0)",
    )
    assert db.bucket_digests("t") != db.recount_digests("t")
    after: int | None = 0
    found = []
    while after is not None:
        after, damaged = db.scrub(after, 10)
        found.extend(damaged)
    assert [d.id for d in found] == ["a"]
    assert db.check_digests() > 0
    _assert_consistent(db)


def test_the_write_paths_shortcut_agrees_with_the_definitions() -> None:
    for row in [("t", "order-000117", 5, "a", 0, b"v"), ("u", "é", 2**62, "node-b", 1, b""), ("t", "", 1, "a", 0, b"")]:
        table, record_id, version, origin, tombstone, value = row
        assert digests.place(*row) == (
            digests.bucket_of(record_id),
            digests.checksum(table, record_id, version, origin, tombstone, value),
        )
