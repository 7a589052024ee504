"""A record's history as the store reads it from the audit log (`Database.history`) and the data API shapes it
(`workers.record_history`): newest first, bounded by a limit and a scan, saying where it stopped and what was pruned."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import pytest

from replicator.shared.store import Applied, Current, Database, Store
from replicator.workers import record_history
from replicator.workers.record_history import BadHistoryQuery
from tests.unit.test_store import T0, FakeClock, rec


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def db(tmp_path: Path, clock: FakeClock) -> Iterator[Database]:
    with Store(tmp_path / "a", "a", clock=clock) as store:
        yield store.database("main", create=True)


def test_a_record_written_updated_replaced_by_a_peer_and_deleted_lists_every_version_newest_first(
    db: Database, clock: FakeClock
) -> None:
    first = db.put("t", "x", b"\x01")
    clock.advance(1)
    second = db.put("t", "x", b"\x02")
    db.put("t", "other", b"\x03")
    clock.advance(1)
    peer_version = second + 5
    assert db.apply_batch([rec("x", peer_version, "b", b"\x04")]) == 1
    clock.advance(1)
    deleted = db.delete("t", "x")
    assert deleted is not None

    history = db.history("t", "x", 10)
    assert history.current == Current(deleted, "a", True, False)
    assert [(e.version, e.origin, e.tombstone, e.local, e.committed_at) for e in history.entries] == [
        (deleted, "a", True, True, T0 + 3),
        (peer_version, "b", False, False, T0 + 2),
        (second, "a", False, True, T0 + 1),
        (first, "a", False, True, T0),
    ]
    assert [e.seq for e in history.entries] == sorted((e.seq for e in history.entries), reverse=True)
    assert (history.before, history.reason, history.pruned, history.oldest) == (None, "", False, T0)
    assert db.history("t", "never", 10).current is None and db.history("t", "never", 10).entries == []


def test_past_the_limit_the_answer_names_where_to_go_on_and_the_pages_cover_the_history_once(db: Database) -> None:
    versions = [db.put("t", "x", bytes([n])) for n in range(10)]
    pages: list[list[Applied]] = []
    before = None
    while True:
        history = db.history("t", "x", 3, before=before)
        pages.append(history.entries)
        if history.before is None:
            break
        assert history.reason == "limit" and history.before == history.entries[-1].seq
        before = history.before
    assert [len(page) for page in pages] == [3, 3, 3, 1]
    assert [e.version for page in pages for e in page] == versions[::-1]
    # Exactly as many entries as the limit: nothing was left out, so nothing says so.
    assert db.history("t", "x", 10).before is None


def test_a_scan_stops_at_its_cap_and_says_where_it_stopped(db: Database) -> None:
    db.put("t", "x", b"old")
    for n in range(100):
        db.put("t", f"noise{n}", b"n")
    newest = db.put("t", "x", b"new")

    history = db.history("t", "x", 10, scan=40, chunk=16)
    assert [e.version for e in history.entries] == [newest]
    assert history.reason == "scan" and history.before is not None
    head = history.entries[0].seq
    assert history.before == head + 1 - 40  # 40 entries of the log read, no more
    rest = db.history("t", "x", 10, before=history.before)
    assert len(rest.entries) == 1 and rest.before is None and rest.entries[0].seq < history.before


def test_pruned_history_is_reported_with_the_oldest_commit_time_left(db: Database, clock: FakeClock) -> None:
    db.put("t", "x", b"1")
    clock.advance(100)
    db.put("t", "y", b"1")
    clock.advance(100)
    latest = db.put("t", "x", b"2")
    assert db.prune_audit(retention_seconds=150, now=T0 + 200) == 1
    history = db.history("t", "x", 10)
    assert [e.version for e in history.entries] == [latest]
    assert history.pruned and history.oldest == T0 + 100
    answer = record_history.document("main", "t", "x", history, 10)
    assert answer["pruned_before"] == T0 + 100 and answer["truncated"] is False
    # Every entry pruned: the record is still there, its history is gone.
    assert db.prune_audit(retention_seconds=0, now=T0 + 300) == 2
    gone = db.history("t", "x", 10)
    assert gone.entries == [] and gone.pruned and gone.oldest is None and gone.current is not None
    assert not record_history.absent(gone)


def test_a_damaged_row_is_shown_as_damaged(db: Database) -> None:
    version = db.put("t", "x", b"good")
    with closing(sqlite3.connect(db.path)) as conn:
        conn.execute("UPDATE records SET value = X'00' WHERE id = 'x'")
        conn.commit()
    assert db.history("t", "x", 10).current == Current(version, "a", False, True)


def test_the_query_string_is_checked() -> None:
    assert record_history.wanted({"history": "true"}) and not record_history.wanted({})
    assert not record_history.wanted({"history": "false"})
    assert record_history.options({}) == (record_history.DEFAULT_LIMIT, None)
    assert record_history.options({"limit": "1000", "before": "7"}) == (1000, 7)
    for query, message in [
        ({"history": "maybe"}, "history must be true or false"),
        ({"limit": "0"}, "limit must be 1 to 1000"),
        ({"limit": "1001"}, "limit must be 1 to 1000"),
        ({"limit": "ten"}, "limit must be a whole number"),
        ({"before": "0"}, "before must be an audit sequence"),
    ]:
        with pytest.raises(BadHistoryQuery, match=message):
            record_history.wanted(query)
            record_history.options(query)
