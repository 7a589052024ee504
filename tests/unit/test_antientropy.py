"""Anti-entropy rounds between two real databases in one process, through the encoded query protocol."""

from __future__ import annotations

import asyncio
import sqlite3
from contextlib import closing
from pathlib import Path

import msgspec
import pytest

from replicator.shared import digests
from replicator.shared.antientropy_queries import (
    BadQuery,
    Children,
    Fetch,
    Roots,
    Rows,
    decode_query,
    encode,
)
from replicator.shared.store import DamagedRecord, Database, Store
from replicator.shared.wire import Entry
from replicator.workers.antientropy import (
    Round,
    RoundResult,
    Transport,
    local_transport,
)
from tests.unit.test_store import FakeClock


class Nodes:
    """Two intact nodes (neither file recovering) holding database d."""

    def __init__(self, root: Path) -> None:
        self.clock = FakeClock()
        self.a = Store(root / "a", "a", clock=self.clock, synchronous="OFF").database("d", create=True)
        self.b = Store(root / "b", "b", clock=self.clock, synchronous="OFF").database("d", create=True)
        self.a.finish_recovery()
        self.b.finish_recovery()

    def write(self, count: int, table: str = "t") -> None:
        """`count` records on a, copied to b as replication would (with the mark they earn)."""
        self.a.put_many(table, [(f"k{i}", _v(f"value {i}")) for i in range(count)])
        self.replicate()

    def replicate(self) -> None:
        """Everything a holds of its own origin, to b, with its mark."""
        self.b.apply_batch(self.a.origin_entries("a", 0, 10**9), {"a": self.a.progress()["a"]})


def _sql(db: Database, statement: str, *args: object) -> None:
    with closing(sqlite3.connect(db.path)) as conn:
        conn.execute(statement, args)
        conn.commit()


def _round(puller: Database, source: Database | Transport, rate: float = 0.0, **kwargs: object) -> RoundResult:
    transport = local_transport(source) if isinstance(source, Database) else source
    return asyncio.run(Round(puller, transport, rate=rate, **kwargs).run())  # type: ignore[arg-type]


def _scrub(db: Database) -> int:
    after: int | None = 0
    found = 0
    while after is not None:
        after, damaged = db.scrub(after, 100)
        found += len(damaged)
    db.check_digests()
    return found


def _v(value: object) -> bytes:
    """A record's value as the data API stores it (anti-entropy refuses a value that is not msgpack)."""
    return msgspec.msgpack.encode(value)


@pytest.fixture
def nodes(tmp_path: Path) -> Nodes:
    return Nodes(tmp_path)


def test_identical_databases_exchange_only_their_roots(nodes: Nodes) -> None:
    nodes.write(3000)
    result = _round(nodes.b, nodes.a)
    assert (result.repaired, result.divergent_buckets, result.error) == (0, 0, "")
    assert result.buckets_compared == 1
    assert result.bytes_exchanged < 100


def test_edits_behind_the_back_are_repaired_and_counted_exactly(nodes: Nodes) -> None:
    nodes.write(3000)
    _sql(nodes.b, "DELETE FROM records WHERE id IN ('k1', 'k2')")  # lost
    _sql(nodes.b, "UPDATE records SET value = X'00' WHERE id = 'k3'")  # changed in place
    _sql(nodes.b, "UPDATE records SET version = version + 1 WHERE id = 'k4'")  # changed, version too
    _sql(
        nodes.b,
        "INSERT INTO records (tbl, id, value, version, origin, tombstone) VALUES ('t', 'extra', X'01', 5, 'a', 0)",
    )
    assert _scrub(nodes.b) == 3  # k3, k4 and the row nobody wrote
    result = _round(nodes.b, nodes.a)
    assert result.repaired == 5 and result.error == ""
    assert result.divergent_buckets == len({digests.bucket_of(i) for i in ("k1", "k2", "k3", "k4", "extra")})
    assert nodes.b.digest() == nodes.a.digest()
    assert nodes.b.get("t", "k3").value == _v("value 3")
    assert nodes.b.get("t", "extra") is None
    again = _round(nodes.b, nodes.a)
    assert (again.repaired, again.divergent_buckets) == (0, 0)


def test_a_million_to_ten_exchange_is_small_in_bytes(nodes: Nodes) -> None:
    """Not a million, but the same shape: the bytes grow with the differences, not with the table."""
    nodes.write(20_000)
    for i in range(0, 10_000, 1000):
        nodes.a.put("t", f"k{i}", _v("newer"))
    result = _round(nodes.b, nodes.a)
    assert result.repaired == 10
    assert result.bytes_exchanged < 40_000
    assert nodes.b.digest() == nodes.a.digest()


def test_a_delete_is_not_resurrected_in_either_direction(nodes: Nodes) -> None:
    nodes.write(10)
    nodes.clock.advance(1)
    nodes.a.delete("t", "k5")
    assert _round(nodes.a, nodes.b).repaired == 0  # b's live, older k5 loses to a's tombstone
    assert _round(nodes.b, nodes.a).repaired == 1  # b takes the tombstone
    assert nodes.b.get("t", "k5") is None
    assert nodes.b.digest() == nodes.a.digest()


def test_two_nodes_missing_different_writes_repair_each_other(nodes: Nodes) -> None:
    nodes.write(500)
    nodes.a.put("t", "only-a", _v("1"))
    nodes.b.put("t", "only-b", _v("2"))
    nodes.b.put("u", "other-table", _v("3"))
    assert _round(nodes.a, nodes.b).repaired == 2
    assert _round(nodes.b, nodes.a).repaired == 1
    assert nodes.a.digest() == nodes.b.digest()


def test_a_damaged_row_no_peer_holds_waits_unserved_until_it_is_written_again(nodes: Nodes) -> None:
    nodes.write(10)
    nodes.b.put("t", "mine", _v("only here"))
    _sql(nodes.b, "UPDATE records SET value = X'00' WHERE id = 'mine'")
    _scrub(nodes.b)
    # a never held it: its absence there says nothing, and b's copy may be the only one there is. It stays damaged
    # (never served), and a stays without it.
    assert _round(nodes.b, nodes.a).repaired == 0
    assert _round(nodes.a, nodes.b).repaired == 0
    with pytest.raises(DamagedRecord):
        nodes.b.get("t", "mine")
    # A write of the record replaces it, and then it replicates like any other.
    nodes.b.put("t", "mine", _v("written again"))
    assert _round(nodes.a, nodes.b).repaired == 1
    assert nodes.a.get("t", "mine").value == _v("written again")
    assert nodes.b.digest() == nodes.a.digest()


def test_a_damaged_row_a_peer_held_and_holds_nothing_of_now_is_removed(nodes: Nodes) -> None:
    nodes.write(10)
    # On b, a row under a's origin at a version a holds complete, and a holds nothing of the record: garbage.
    _sql(
        nodes.b, "INSERT INTO records (tbl, id, value, version, origin, tombstone) VALUES ('t', 'x', X'01', 5, 'a', 0)"
    )
    _scrub(nodes.b)
    assert _round(nodes.b, nodes.a).repaired == 1
    assert nodes.b.fetch("t", ["x"]) == ([], [])
    assert nodes.b.digest() == nodes.a.digest()


def test_damage_on_the_serving_side_is_not_served(nodes: Nodes) -> None:
    nodes.write(10)
    nodes.clock.advance(1)
    nodes.a.put("t", "k1", _v("newer on a"))
    _sql(nodes.a, "UPDATE records SET value = X'00' WHERE id = 'k1'")  # not scrubbed yet: found when served
    result = _round(nodes.b, nodes.a)
    assert result.repaired == 0
    assert nodes.b.get("t", "k1").value == _v("value 1")
    assert nodes.a.checksum_failures == 1
    # b's older copy does not replace a's damaged newer one: b never held the newer write, and putting the older
    # one back would undo it. Once b holds a's origin past it (it has a's newer writes, or something newer of k1),
    # b's copy is what there is, and it does.
    assert _round(nodes.a, nodes.b).repaired == 0
    nodes.b.apply_batch([], {"a": nodes.a.progress()["a"]})
    assert _round(nodes.a, nodes.b).repaired == 1
    assert nodes.a.get("t", "k1").value == _v("value 1")


def test_a_recovering_files_damaged_own_row_is_not_replaced_by_an_older_own_version(tmp_path: Path) -> None:
    """Sim seed 52604 of nemesis 3: a recovering file counts its own origin complete only as far as peers confirmed
    (nothing yet), but it holds every own write it made: a peer short of its newest own write is not one that has
    seen everything it has, and its older copy must not undo the newer write."""
    clock = FakeClock()
    a = Store(tmp_path / "a", "a", clock=clock, synchronous="OFF").database("d", create=True)
    b = Store(tmp_path / "b", "b", clock=clock, synchronous="OFF").database("d", create=True)
    assert a.recovering and "a" not in a.progress()
    a.put("t", "k", _v("older"))
    b.apply_batch(a.origin_entries("a", 0, 10**9), {})
    b.finish_recovery()
    clock.advance(1)
    newer = a.put("t", "k", _v("newer"))
    _sql(a, "UPDATE records SET value = X'00' WHERE id = 'k'")
    _scrub(a)
    assert _round(a, b).repaired == 0
    with pytest.raises(DamagedRecord):
        a.get("t", "k")
    # Once b holds a's origin past a's newest own write (it has a's newer writes, or something newer of k), its copy
    # is what there is.
    b.apply_batch([], {"a": newer})
    assert _round(a, b).repaired == 1
    assert a.get("t", "k").value == _v("older")


def test_repairs_are_paced(nodes: Nodes) -> None:
    nodes.write(400)
    _sql(nodes.b, "DELETE FROM records WHERE id LIKE 'k1%'")  # 111 records
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    result = _round(nodes.b, nodes.a, rate=50.0, sleep=sleep)
    assert result.repaired == 111
    assert sum(slept) == pytest.approx(111 / 50.0)


def test_records_ahead_of_the_clock_ceiling_are_not_pulled(nodes: Nodes) -> None:
    nodes.write(5)
    nodes.clock.advance(3600)
    nodes.a.put("t", "future", _v("x"))
    result = _round(nodes.b, nodes.a, ceiling=lambda: 1)
    assert result.repaired == 0 and nodes.b.get("t", "future") is None


def test_a_peer_that_answers_garbage_ends_the_round_with_an_error(nodes: Nodes) -> None:
    nodes.write(5)

    async def garbage(body: bytes) -> bytes:
        return b"\xc1 not msgpack"

    result = _round(nodes.b, garbage)
    assert "does not decode" in result.error


def test_a_peer_that_serves_what_was_not_asked_is_ignored(nodes: Nodes) -> None:
    nodes.write(5)
    nodes.a.put("t", "new", _v("x"))
    honest = local_transport(nodes.a)

    async def sly(body: bytes) -> bytes:
        query = decode_query(body)
        if isinstance(query, Fetch):
            forged = Entry("t", "k0", _v("forged"), 2**62, "a", False)
            other_table = Entry("other", "new", _v("x"), 2**62, "a", False)
            real = msgspec.msgpack.decode(await honest(body)).get("entries", [])
            return msgspec.msgpack.encode({"entries": [*real, forged, other_table], "damaged": []})
        return await honest(body)

    result = _round(nodes.b, sly)
    assert result.repaired == 1
    assert nodes.b.get("t", "k0").value == _v("value 0")
    assert nodes.b.tables() == ["t"]


@pytest.mark.parametrize(
    ("query", "message"),
    [
        (Roots(database="bad name"), "bad database name"),
        (Children(database="d", table="t", level=11, nodes=[0]), "level 11"),
        (Rows(database="d", table="t", level=1, nodes=[16]), "outside level 1"),
        (Rows(database="d", table="t", level=2, nodes=list(range(300))), "at most"),
        (Fetch(database="d", table="bad/table", ids=["x"]), "bad table name"),
        (Fetch(database="d", table="t", ids=["x"] * 2000), "at most"),
    ],
)
def test_bad_queries_are_refused_with_a_reason(query: msgspec.Struct, message: str) -> None:
    with pytest.raises(BadQuery, match=message):
        decode_query(encode(query))
    with pytest.raises(BadQuery, match="not an anti-entropy query"):
        decode_query(b"\x93\x01\x02\x03")


def test_rows_and_children_agree_with_the_stored_buckets(nodes: Nodes) -> None:
    nodes.write(2000)
    for prefix in range(digests.FANOUT):
        (children,) = nodes.a.children("t", 1, [prefix])
        rows = nodes.a.summaries("t", 1, [prefix])
        assert sum(count for count, _ in children) == len(rows)


def test_a_purged_tombstone_is_not_pulled_back_and_its_purge_spreads(nodes: Nodes) -> None:
    nodes.write(10)
    horizon = nodes.a.delete("t", "k3")
    assert horizon is not None
    nodes.replicate()
    everyone = {"a": horizon}
    assert nodes.a.purge_tombstones(everyone, horizon) == 1
    assert nodes.a.purge_tombstones(everyone, horizon) == 0  # walked once
    # b still holds the tombstone, but b could not decide the purge (say b does not hear from every holder): a does
    # not take it back, and b, seeing a purged it, purges its copy. The digests meet.
    assert _round(nodes.a, nodes.b).repaired == 0
    result = _round(nodes.b, nodes.a)
    assert result.repaired == 1 and result.divergent_buckets == 1
    assert nodes.b.fetch("t", ["k3"]) == ([], [])
    assert nodes.a.digest() == nodes.b.digest()
    # A tombstone a has not purged is pulled like any record.
    nodes.a.delete("t", "k4")
    assert _round(nodes.b, nodes.a).repaired == 1


def test_a_record_whose_deletion_was_purged_is_removed_not_spread(nodes: Nodes) -> None:
    """A node restored from a backup older than the purge (or back after tombstone_retention) holds records that
    were deleted since, and whose tombstones are gone: they must not come back."""
    nodes.write(10)
    nodes.clock.advance(1)
    deleted = nodes.a.delete("t", "k3")
    assert deleted is not None
    # b missed the delete (its file is from before it); a purged the tombstone.
    assert nodes.a.purge_tombstones({"a": deleted}, deleted) == 1
    assert nodes.b.get("t", "k3") is not None
    # a's round does not pull k3 back from b, and b's round removes it.
    assert _round(nodes.a, nodes.b).repaired == 0
    assert nodes.a.get("t", "k3") is None
    assert _round(nodes.b, nodes.a).repaired == 1
    assert nodes.b.get("t", "k3") is None
    assert nodes.a.digest() == nodes.b.digest()


def test_a_record_the_peer_never_held_is_left_for_it_to_pull(nodes: Nodes) -> None:
    nodes.write(10)
    nodes.clock.advance(1)
    deleted = nodes.a.delete("t", "k3")
    assert deleted is not None and nodes.a.purge_tombstones({"a": deleted}, deleted) == 1
    nodes.b.put("t", "fresh", _v("b's own"))  # b's origin, which a has not got: not a deletion a purged
    assert _round(nodes.b, nodes.a).repaired == 1  # k3 goes; fresh stays
    assert nodes.b.get("t", "fresh") is not None
    assert _round(nodes.a, nodes.b).repaired == 1 and nodes.a.get("t", "fresh") is not None


def test_tombstones_stay_until_every_holder_has_them_and_the_horizon_passed(nodes: Nodes) -> None:
    nodes.write(10)
    first = nodes.a.delete("t", "k1")
    nodes.clock.advance(10)
    second = nodes.a.delete("t", "k2")
    assert first is not None and second is not None
    assert nodes.a.purge_tombstones({"a": first - 1}, second) == 0  # a holder lacks both
    assert nodes.a.purge_tombstones({"a": second}, first) == 1  # only the first is old enough
    assert nodes.a.fetch("t", ["k1", "k2"])[0][0].id == "k2"
    assert nodes.a.purge_tombstones({"a": second}, second) == 1
    assert nodes.a.get("t", "k5") is not None  # live records are never purged


def test_a_value_that_is_not_msgpack_is_refused_and_the_rest_repaired(nodes: Nodes) -> None:
    nodes.write(5)
    nodes.a.put("t", "poison", b"\xc1")  # written behind the data API's back: not msgpack
    nodes.a.put("t", "fine", _v("fine"))
    result = _round(nodes.b, nodes.a)
    assert result.repaired == 1 and result.error == ""
    assert nodes.b.get("t", "fine") is not None and nodes.b.get("t", "poison") is None
