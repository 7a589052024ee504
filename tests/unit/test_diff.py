"""`replicator diff`'s descent (`coordinator.diff.Descent`) against two real store files, answered as the admin port
answers (`coordinator.digest_tree`): it finds exactly the records that differ, reads only where the trees differ, stops
at its limit, and every request it makes is one the node's caps let through."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import pytest

from replicator.coordinator.diff import Descent, Difference, DiffError, LocalSide, document, newer
from replicator.coordinator.digest_tree import ROWS, TREE, encoded, tree_query
from replicator.shared import digests
from replicator.shared.antientropy_queries import LEAF_ROWS, MAX_NODES, MAX_ROWS, BadQuery
from replicator.shared.store import DamagedRecord, Database, Store
from tests.unit.test_store import FakeClock


class Counting(LocalSide):
    """A side that counts the rows it answered: what the descent read of the node."""

    def __init__(self, db: Database | None, label: str) -> None:
        super().__init__(db, label)
        self.rows_read = 0
        self.nodes_asked: list[int] = []

    async def children(self, table: str, level: int, nodes: list[int]) -> list[list[tuple[int, int]]]:
        self.nodes_asked.append(len(nodes))
        return await super().children(table, level, nodes)

    async def rows(self, table: str, level: int, nodes: list[int]) -> list[tuple[str, int, str, bool, int | None]]:
        self.nodes_asked.append(len(nodes))
        found = await super().rows(table, level, nodes)
        self.rows_read += len(found)
        return found


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Database, Database]]:
    clock = FakeClock()
    with Store(tmp_path / "a", "a", clock=clock) as a, Store(tmp_path / "b", "b", clock=clock) as b:
        yield a.database("main", create=True), b.database("main", create=True)


def _replicate(source: Database, target: Database) -> None:
    target.apply_batch(source.origin_entries(source.node, 0, 1_000_000))


async def _diff(a: Database | None, b: Database | None, limit: int = 100) -> tuple[Descent, Counting, Counting]:
    first, second = Counting(a, "a"), Counting(b, "b")
    descent = Descent(first, second, limit=limit)
    await descent.run()
    return descent, first, second


def _row(db: Database, record_id: str, table: str = "t") -> tuple[int, str, bool, int | None]:
    with closing(sqlite3.connect(db.path)) as conn:
        version, origin, tombstone, checksum = conn.execute(
            "SELECT version, origin, tombstone, checksum FROM records WHERE tbl = ? AND id = ?", (table, record_id)
        ).fetchone()
    return version, origin, bool(tombstone), checksum


async def test_identical_nodes_cost_one_question_each(pair: tuple[Database, Database]) -> None:
    a, b = pair
    a.put_many("t", [(f"r{i:05d}", b"v") for i in range(2000)])
    _replicate(a, b)
    descent, first, second = await _diff(a, b)
    assert descent.outcome.differences == [] and descent.outcome.tables == []
    assert descent.outcome.queries == 2 and first.nodes_asked == [] and second.nodes_asked == []


async def test_every_kind_of_difference_is_found_exactly_and_only_where_the_trees_differ(
    pair: tuple[Database, Database],
) -> None:
    a, b = pair
    # Sequential ids: a hundred share a bucket (`digests.bucket_of`), so the descent goes below the stored level.
    a.put_many("t", [(f"r{i:05d}", b"v") for i in range(3000)])
    _replicate(a, b)
    a.put("t", "only-on-a", b"new")  # not replicated
    updated = b.put("t", "r00100", b"b wrote it")  # b's newer version, not replicated
    deleted = a.delete("t", "r02000")  # a deleted it, b still holds it
    b.put("u", "in-a-table-only-b-has", b"x")
    with closing(sqlite3.connect(b.path)) as conn:  # damaged on b: bytes changed behind the store's back
        conn.execute("UPDATE records SET value = X'00' WHERE tbl = 't' AND id = 'r00007'")
        conn.commit()
    with pytest.raises(DamagedRecord):
        b.get("t", "r00007")  # a read finds it and marks it, which moves its bucket's digest

    descent, first, second = await _diff(a, b)
    outcome = descent.outcome
    assert [table for table, _, _ in outcome.tables] == ["t", "u"]
    found = {(d.table, d.id): d for d in outcome.differences}
    assert sorted(found) == [
        ("t", "only-on-a"),
        ("t", "r00007"),
        ("t", "r00100"),
        ("t", "r02000"),
        ("u", "in-a-table-only-b-has"),
    ]
    assert found[("t", "only-on-a")].second is None and found[("t", "only-on-a")].first == _row(a, "only-on-a")
    assert found[("t", "r00100")].second == (updated, "b", False, _row(b, "r00100")[3])
    assert found[("t", "r00100")].first == _row(a, "r00100")
    assert found[("t", "r02000")].first == (deleted, "a", True, _row(a, "r02000")[3])
    assert found[("t", "r00007")].second is not None and found[("t", "r00007")].second[3] is None  # damaged
    assert found[("u", "in-a-table-only-b-has")].first is None
    assert newer(found[("t", "r00100")]) == 1 and newer(found[("t", "r02000")]) == 0
    assert newer(found[("t", "only-on-a")]) is None and newer(found[("t", "r00007")]) is None
    assert not outcome.truncated
    # Not a scan: the rows read are those of the few small nodes that differ, out of 3,000 on each side.
    for side in (first, second):
        assert side.rows_read <= 4 * LEAF_ROWS
        assert max(side.nodes_asked) <= MAX_NODES

    answer = document("main", outcome, ("http://a", "http://b"), 100)
    assert answer["identical"] is False and answer["count"] == 5
    entry = next(d for d in answer["differences"] if d["id"] == "r00100")
    assert entry["sides"]["b"] == {
        "version": updated,
        "origin": "b",
        "tombstone": False,
        "damaged": False,
        "checksum": _row(b, "r00100")[3],
    }
    assert entry["newer"] == "b"


async def test_the_listing_stops_at_its_limit_and_says_so(pair: tuple[Database, Database]) -> None:
    a, b = pair
    a.put_many("t", [(f"spread-{i}-x", b"v") for i in range(50)])  # not replicated: 50 records only on a
    descent, _, _ = await _diff(a, b, limit=10)
    assert len(descent.outcome.differences) == 10 and descent.outcome.truncated
    exact, _, _ = await _diff(a, b, limit=50)
    assert len(exact.outcome.differences) == 50 and not exact.outcome.truncated


async def test_a_node_without_the_database_lacks_every_record(pair: tuple[Database, Database]) -> None:
    a, _ = pair
    a.put_many("t", [("x", b"1"), ("y", b"2")])
    descent, _, _ = await _diff(a, None)
    assert descent.outcome.missing == ["b"]
    assert [(d.id, d.second) for d in descent.outcome.differences] == [("x", None), ("y", None)]
    with pytest.raises(DiffError, match="neither node holds"):
        await _diff(None, None)


def test_the_tree_requests_are_held_to_the_anti_entropy_caps(pair: tuple[Database, Database]) -> None:
    a, _ = pair
    for query, message in [
        ({"nodes": "0"}, "level is required"),
        ({"level": "x", "nodes": "0"}, "level must be a whole number"),
        ({"level": "1"}, "nodes is required"),
        ({"level": "1", "nodes": "1,a"}, "nodes must be whole numbers"),
        ({"level": "1", "nodes": "16"}, "a node outside level 1"),
        ({"level": "2", "nodes": "3,3"}, "asked for twice"),
        ({"level": "3", "nodes": ",".join(map(str, range(MAX_NODES + 1)))}, f"at most {MAX_NODES}"),
        ({"level": str(digests.MAX_LEVEL + 1), "nodes": "0"}, "outside"),
    ]:
        with pytest.raises(BadQuery, match=message):
            tree_query(ROWS, "main", "t", query)
    with pytest.raises(BadQuery, match="bad table name"):
        tree_query(TREE, "main", "no/slash", {"level": "0", "nodes": "0"})
    # A rows answer past MAX_ROWS is refused before a row is read, naming the cap.
    a.put_many("t", [(f"k{i}", b"v") for i in range(MAX_ROWS + 1)])
    with pytest.raises(BadQuery, match=f"at most {MAX_ROWS}"):
        encoded(a, tree_query(ROWS, "main", "t", {"level": "0", "nodes": "0"}))
    assert b'"children"' in encoded(a, tree_query(TREE, "main", "t", {"level": "0", "nodes": "0"}))


def test_which_side_is_newer_follows_last_writer_wins() -> None:
    assert newer(Difference("t", "x", (5, "a", False, 1), (5, "b", False, 2))) == 1
    assert newer(Difference("t", "x", (6, "a", True, 1), (5, "b", False, 2))) == 0
    assert newer(Difference("t", "x", (5, "a", False, 1), (5, "a", False, 2))) is None


class Refusing(LocalSide):
    """A side whose node refuses every tree request, as one past a cap or gone would."""

    async def children(self, table: str, level: int, nodes: list[int]) -> list[list[tuple[int, int]]]:
        raise DiffError(f"{self.label} answered 503")


async def test_a_side_that_fails_mid_descent_ends_it_with_its_reason(pair: tuple[Database, Database]) -> None:
    a, b = pair
    a.put("t", "x", b"1")
    with pytest.raises(DiffError, match="b answered 503"):
        await Descent(LocalSide(a, "a"), Refusing(b, "b"), limit=10).run()
