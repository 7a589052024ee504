"""What a node knows of its own writes (`shared.own_writes`), on real files: how a file begins (new, unknown, lost),
the one question "may this node have written this version?", regressions, and writes of a new file's own life
written again above an earlier life's versions."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from replicator.shared import dropped, own_writes
from replicator.shared.deletion import DeletionFloors
from replicator.shared.store import SYSTEM, Database, Store
from tests.unit.test_store import FakeClock, meta, raw, rec


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def node(tmp_path: Path, clock: FakeClock) -> Iterator[Store]:
    """A node's store that remembers what it holds, as the coordinator and the workers open it."""
    with Store(tmp_path / "a", "a", clock=clock, clock_lead=60.0, holdings=True) as store:
        yield store


def _intact_system(store: Store) -> Database:
    system = store.database(SYSTEM, create=True)
    system.finish_recovery()  # its peers have served it: the registry it holds is whole
    return system


def test_a_new_node_takes_its_first_files_as_unknown_not_lost(node: Store, clock: FakeClock) -> None:
    system = node.database(SYSTEM, create=True)
    history = system.own_history()
    assert history.recovering and history.unknown and history.floor == 0
    db = node.database("d", create=True)
    # Unknown: recovering, but on the wall clock (no lead), asking peers for every write of its own they hold.
    assert db.own_history().unknown and db.own_history().asks > 10**18
    assert db.put("t", "k", b"v") == clock.us


def test_a_recovering_file_has_seen_its_own_writes_though_it_counts_them_complete_only_as_peers_confirm(
    node: Store, clock: FakeClock
) -> None:
    db = node.database("d", create=True)
    first = db.put("t", "k", b"v")
    clock.advance(1)
    newest = db.put("t", "k", b"w")
    history = db.own_history()
    # Promised to peers: nothing yet. Held: every own write since its floor (a damaged own row is judged by this).
    assert history.recovering and history.complete == 0 and "a" not in db.progress()
    assert history.held == newest > first
    db.finish_recovery()
    assert db.own_history().held == db.own_history().complete == newest


def test_a_name_never_held_is_new_and_one_held_before_is_lost(node: Store, clock: FakeClock) -> None:
    _intact_system(node)
    fresh = node.database("fresh", create=True)
    history = fresh.own_history()
    assert not history.recovering and history.floor == 0 and history.born == clock.us
    assert fresh.put("t", "k", b"v") == clock.us  # the wall clock, not max_clock_skew ahead
    # The node held "fresh" now: a file of it made later (the first one lost) is a lost file.
    node.forget("fresh")
    for suffix in ("", "-wal", "-shm"):
        Path(f"{fresh.path}{suffix}").unlink(missing_ok=True)
    lost = node.database("fresh", create=True)
    history = lost.own_history()
    assert history.recovering and not history.unknown
    assert history.floor == clock.us + 60_000_000 - 1 and history.asks == history.floor
    assert lost.put("t", "k", b"v") > history.floor


def test_a_deleted_and_removed_database_is_new_again(node: Store) -> None:
    system = _intact_system(node)
    db = node.database("gone", create=True)
    db.put("t", "k", b"v")
    dropped.write(system, "gone", requested_by="a", at=1.0, floors=dropped.seen(db.origins()))
    db.drop_through(node.dropped_floor("gone"))
    node.block("gone")
    assert node.remove("gone")
    node.unblock("gone")
    again = node.database("gone", create=True)
    assert not again.own_history().recovering


def test_may_have_written_judges_from_local_writes_only(node: Store, clock: FakeClock) -> None:
    _intact_system(node)
    db = node.database("d", create=True)
    first = db.put("t", "k1", b"1")
    clock.advance(1)
    second = db.put("t", "k2", b"2")
    clock.advance(1)
    # A version of our own applied from a peer (our own write served back) proves nothing of what we wrote.
    db.apply_batch([rec("k3", second + 5, "a")])
    claims = [("k1", first), ("k2", second), ("k1", second), ("k9", second + 100_000_000)]
    # k1 at `second` is covered by the local writes the log keeps and is not among them; k9 is above everything.
    assert db.may_have_written("t", claims) == [("k1", first), ("k2", second)]
    # Pruned, the log no longer covers them: only the versions above the newest own one are known never written.
    with raw(db.path) as conn:
        conn.execute("DELETE FROM audit")
    assert db.may_have_written("t", claims) == [("k1", first), ("k2", second), ("k1", second)]


def test_an_unknown_file_judges_no_claim_on_its_origin(node: Store) -> None:
    db = node.database("d", create=True)  # the system database is recovering: unknown
    assert db.own_history().unknown
    assert db.may_have_written("t", [("x", 5), ("y", 10**16)]) == [("x", 5), ("y", 10**16)]


def test_a_claim_above_or_below_a_new_files_life_regresses_it(node: Store, clock: FakeClock) -> None:
    _intact_system(node)
    db = node.database("d", create=True)
    mine = db.put("t", "k", b"v")
    assert not db.regress(mine)  # what the file holds
    assert not db.regress(0)
    # Below its birth: the node wrote before this file began.
    assert db.regress(mine - 10_000_000)
    history = db.own_history()
    assert history.recovering and history.floor == mine - 10_000_000
    # While it recovers, any claim above the floor raises it, and the clock follows.
    assert db.regress(mine + 50)
    assert db.own_history().floor == mine + 50 and db.clock_version >= mine + 50
    assert not db.regress(mine)  # below the floor
    assert db.put("t", "later", b"v") > mine + 50


def test_a_peer_holding_its_position_just_below_the_files_first_write_is_no_earlier_life(
    node: Store, clock: FakeClock
) -> None:
    """A peer that refused the node's first write (its registry row, signed under a CA missing from the peer's
    bundle) holds its position just below it (`refuse_registry_rows`). Made at the file's birth, that is born - 1:
    a claim of this life, and the intact file goes on as it is (seed 17030: it went back to recovering, took its own
    history for unknown and wrote its row again above the refusing peer's position)."""
    system = _intact_system(node)
    mine = system.put("nodes", "a", b"row")
    history = system.own_history()
    assert mine == history.born == clock.us and not history.recovering
    assert not system.regress(mine - 1, peer="c")
    assert system.own_history() == history and system.clock_version == mine
    # One below that no write of this life explains: the node wrote before the file began.
    assert system.regress(mine - 2, peer="c")
    assert system.own_history().recovering and system.own_history().floor == mine - 2


def test_a_new_files_writes_below_an_earlier_lifes_version_are_written_again_above_it(
    node: Store, clock: FakeClock
) -> None:
    """A wiped node whose clock went back: its new file's writes lie below versions of its own that peers hold; once
    it sees one (a peer serves it back), they are written again above it when the recovery ends (every peer has
    served), as they were, and deletes are not."""
    db = node.database("d", create=True)  # unknown: the node may have held it
    early = db.put("t", "new-life", b"mine")
    db.put("t", "new-life-deleted", b"x")
    db.delete("t", "new-life-deleted")
    earlier_life = early + 30_000_000  # peers hold this of the node's earlier life, above its new writes
    db.apply_batch([rec("old-life", earlier_life, "a")], peer="b")
    assert db.fetch("t", ["new-life"])[0][0].version == early  # not before every peer has served
    db.finish_recovery()
    moved = db.fetch("t", ["new-life"])[0][0]
    assert moved.value == b"mine" and moved.version > earlier_life and moved.origin == "a"
    gone = db.fetch("t", ["new-life-deleted"])[0][0]
    assert gone.tombstone and gone.version < earlier_life  # a delete stays where it is
    assert meta(db, "born") is not None
    # A version of its own that it wrote itself, served back (a repair), is no earlier life: nothing moves.
    other = node.database("e", create=True)
    mine = other.put("t", "r", b"mine")
    other.apply_batch([rec("r", mine, "a", value=b"mine")])
    other.finish_recovery()
    assert other.fetch("t", ["r"])[0][0].version == mine


def test_a_deletion_that_saw_more_of_this_nodes_writes_than_its_file_holds_is_a_regression(
    node: Store, clock: FakeClock
) -> None:
    _intact_system(node)
    db = node.database("d", create=True)
    mine = db.put("t", "k", b"v")
    assert not db.regress(mine, by_deletion=True)
    assert db.regress(mine + 5_000_000, by_deletion=True)
    # A deletion floor below the file's birth is a deletion from before it: nothing to take back.
    clock.advance(10)
    other = node.database("e", create=True)
    assert not other.regress(mine, by_deletion=True)


def test_writes_again_wait_for_every_peer_to_serve_and_newer_versions_win(node: Store, clock: FakeClock) -> None:
    """A backup of an unknown file, restored after the node deleted one of its writes and updated others: a peer's
    claim on its origin calls the writes again, but only once every peer has served (the recovery ends), so the
    newer versions the peers hold (the node's own delete and updates, another node's delete) come back first and
    replace them; what is still the file's own write of this life is written again above the claim."""
    db = node.database("d", create=True)  # unknown
    x = db.put("t", "x", b"deleted since")
    db.put("t", "y", b"updated since")
    z = db.put("t", "z", b"kept")
    db.put("t", "v", b"deleted elsewhere since")
    w = db.put("t", "w", b"updated elsewhere since")
    claim = w + 10_000_000  # b holds a's own writes complete up to here: the delete and the update below
    assert db.regress(claim, peer="b")
    assert db.fetch("t", ["x"])[0][0].version == x  # nothing written again before b has served
    db.apply_batch([rec("x", w + 1, "a", tomb=True), rec("y", w + 2, "a", value=b"new")], peer="b")
    # b has served; c has not yet: still nothing written again.
    assert db.fetch("t", ["z"])[0][0].version == z
    # c holds a's later update of w, and a delete of v by c, which b never had.
    db.apply_batch([rec("w", w + 5, "a", value=b"newer"), rec("v", w + 6, "c", tomb=True)], peer="c")
    db.finish_recovery()  # every peer has served
    x_now, y_now, z_now, v_now, w_now = (db.fetch("t", [key])[0][0] for key in "xyzvw")
    assert x_now.tombstone and x_now.version == w + 1
    assert y_now.value == b"new" and y_now.version == w + 2
    assert z_now.value == b"kept" and z_now.version > claim
    assert w_now.value == b"newer" and w_now.version == w + 5
    assert v_now.tombstone and (v_now.version, v_now.origin) == (w + 6, "c")
    assert not db.own_history().recovering
    assert [key for key in _meta_keys(db) if key.startswith(("rewrite", "rewritten"))] == []


def test_a_newer_own_version_beats_a_write_again_a_deletions_floor_called(node: Store) -> None:
    """A deletion's floor above an unknown file's writes calls them again at once (its drop would take them at their
    old versions), before every peer has served: a newer own version a peer brings then (the node's own later update
    from a life the file lacks) beats the write again, and is written again itself above it."""
    db = node.database("d", create=True)  # unknown
    w = db.put("t", "w", b"updated elsewhere since")
    floor = w + 10_000_000
    assert db.regress(floor, by_deletion=True)
    again = db.fetch("t", ["w"])[0][0]
    assert again.value == b"updated elsewhere since" and again.version > floor
    db.apply_batch([rec("w", w + 5, "a", value=b"newer")], peer="c")
    w_final = db.fetch("t", ["w"])[0][0]
    assert w_final.value == b"newer" and w_final.version > again.version
    db.finish_recovery()
    assert [key for key in _meta_keys(db) if key.startswith(("rewrite", "rewritten"))] == []


def test_a_deletions_floor_writes_again_at_once_what_a_claim_left_pending_under_it(node: Store) -> None:
    """Sim seed 34927: a wiped node's new (unknown) file wrote r after a deletion, below a version of its earlier
    life that the deletion covers. A peer's claim of that version arrived first: it raised the file's floor to the
    deletion's own and left the write again pending until the recovery ends. The deletion's floor then no longer
    reaches past the file, yet its drop would take r at its old version on every node: r is written again above
    the floor at once, and survives the drop."""
    db = node.database("d", create=True)  # unknown: the node was wiped
    mine = db.put("t", "r", b"after the deletion")
    floor = mine + 2_000_000  # the earlier life's newest version, which the deletion saw
    assert db.regress(floor, peer="b")
    assert db.fetch("t", ["r"])[0][0].version == mine  # pending until every peer has served
    assert not db.regress(floor, by_deletion=True)  # the floor is where the claim put it already
    again = db.fetch("t", ["r"])[0][0]
    assert again.value == b"after the deletion" and again.version > floor and again.origin == "a"
    db.drop_through(DeletionFloors(origins={"a": floor}))
    assert db.fetch("t", ["r"])[0][0] == again
    db.finish_recovery()  # nothing left pending below the claim: r stays where the deletion's floor put it
    assert db.fetch("t", ["r"])[0][0] == again
    assert [key for key in _meta_keys(db) if key.startswith(("rewrite", "rewritten"))] == []


def test_a_write_again_does_not_beat_another_nodes_delete_that_the_claiming_peer_lacked(node: Store) -> None:
    """Seed 56804 of nemesis 3: a wiped node's new file wrote r below a version of its earlier life, and c deleted r
    above it. b, cut off from c, served the earlier life's version (a claim) and caught up; written again then, r
    beat c's delete on every node (a delete undone). It waits for every peer: c serves its delete first, and r,
    no longer the file's own write, is not written again."""
    db = node.database("d", create=True)  # unknown: the node was wiped
    mine = db.put("t", "r", b"mine")
    db.apply_batch([rec("s", mine + 5, "a")], {"a": mine + 5}, peer="b")  # the earlier life's s, from b
    assert db.fetch("t", ["r"])[0][0].version == mine  # b has served: not written again yet
    db.apply_batch([rec("r", mine + 9, "c", tomb=True)], peer="c")
    db.finish_recovery()
    row = db.fetch("t", ["r"])[0][0]
    assert row.tombstone and (row.version, row.origin) == (mine + 9, "c")


def test_a_claim_that_this_life_explains_writes_nothing_again(node: Store) -> None:
    """An unknown file (a new cluster's first files are all unknown) whose peer counts it complete up to its own
    newest write got that from this file: nothing is written again, not even once the recovery ends, since the old
    value would beat a newer write of another node that has not reached this one yet (sim seeds 12695, 16894)."""
    db = node.database("d", create=True)  # unknown
    old = db.put("t", "r", b"old")
    newest = db.put("t", "s", b"s")
    assert db.own_history().unknown
    db.regress(newest, peer="b")  # b holds everything this file wrote
    db.finish_recovery()
    assert db.fetch("t", ["r"])[0][0].version == old
    # Above every own version the file holds, a claim shows an earlier life: what lies below it is written again.
    later = node.database("e", create=True)
    mine = later.put("t", "r", b"mine")
    assert later.regress(mine + 1_000, peer="b")
    assert later.fetch("t", ["r"])[0][0].version == mine  # once every peer has served
    later.finish_recovery()
    assert later.fetch("t", ["r"])[0][0].version > mine + 1_000


def _meta_keys(db: Database) -> list[str]:
    with db._lock:
        return [row[0] for row in db._conn.execute("SELECT key FROM meta")]


def test_a_wiped_node_whose_peers_served_its_earlier_life_takes_no_unmarked_name_for_new(
    node: Store, clock: FakeClock
) -> None:
    """Sim seed 88772. The marks of what a node has held live in its system database and are never replicated: a
    wiped node's system database recovers its rows from peers, not the marks. Once a peer served back a row of the
    node's own from before the file began, a name without a mark may be one the node held: its file is unknown
    (it asks peers for its own writes), not new (counting them complete from its first write)."""
    system = node.database(SYSTEM, create=True)  # a wiped node: unknown, born now
    clock.advance(10)
    system.apply_batch([rec("a", clock.us - 9_000_000, "a", table="nodes")], peer="b")  # its earlier life's row
    system.finish_recovery()
    assert not system.own_history().recovering
    clock.advance(10)
    held_before = node.database("d1", create=True)
    history = held_before.own_history()
    assert history.unknown and history.asks > 10**18 and history.floor == 0
    held_before.put("t", "k", b"v")
    assert "a" not in held_before.progress()  # not complete before the peers confirm it
    # Its mark is made with the file: a later file of the name is a lost one, as on any node.
    assert node.held("d1") is True
    # A node whose peers showed no earlier life (a new node joining) still takes a name it never held for new.
    with Store(node.data_dir.parent / "fresh", "f", clock=clock, clock_lead=60.0, holdings=True) as fresh:
        _intact_system(fresh)
        assert not fresh.database("d1", create=True).own_history().recovering


def test_a_restored_system_database_vouches_for_no_unmarked_name(node: Store, clock: FakeClock) -> None:
    """A system database put back from a backup lacks the marks of the databases made after the backup was taken."""
    system = _intact_system(node)
    with raw(system.path) as conn:
        conn.execute("BEGIN")
        own_writes.mark_restored(conn, 0.0)
        conn.execute("COMMIT")
    node.forget(SYSTEM)
    system = node.database(SYSTEM)
    system.finish_recovery()
    assert node.held("later") is None
