"""A node keeps its own newest acknowledged writes, whatever it lost, and a new database is not a lost one.

- A node whose data directory is lost while the only peer holding its newest writes is down waits for that peer
  before it counts its own writes complete; when the peer returns, the node takes those writes back (they are its
  own, never judged forged) and nothing older is reasserted over them, deletes included.
- A row damaged on a node is not replaced by a lagging peer's older version of it; it is repaired from a peer
  holding the newer version this node wrote, once the audit log no longer holds that write.
- A database created by a client's first write is not a lost file: its versions follow the wall clock, so a later
  write made elsewhere wins, and a peer whose clock is a little behind takes its records at once.
- On a line a-b-c, when a and b both lose their file and a's write survives on c alone, a does not end its
  recovery on the word of b, which recovers too; b takes a's origin from c while it recovers; the write survives
  on every node, purges and all.

Each test ends with equal digests on every node and every acknowledged write and delete in place.
"""

from __future__ import annotations

import shutil
import sqlite3
import time
from contextlib import closing

import pytest

from replicator.coordinator.local_cluster import faketime_env
from tests.integration.conftest import FAST, assert_identical, wait_for
from tests.integration.ledger import Ledger

DATABASE = "own"
# These tests stop and start nodes several times: more than the default per-test timeout on a busy machine.
pytestmark = pytest.mark.timeout(300)


async def _recovery(cluster, name: str, database: str) -> dict:  # type: ignore[no-untyped-def]
    _, body = await cluster.admin(name, "/status")
    return body["recovery"].get(database, {})


async def test_a_lost_node_waits_for_the_peer_holding_its_newest_writes_and_keeps_them(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(["a", "b", "c"], workers=1, replication={**FAST, "failover_after": 2.0})
    ledger = Ledger(cluster, DATABASE)
    cluster.start()
    try:
        await cluster.wait_ready()
        await ledger.put("a", "r", "old")
        await ledger.put("a", "gone", "soon deleted")
        await ledger.put("b", "b-1", "b's")
        await cluster.wait_converged(DATABASE, timeout=60, expect_count=3)
        # Every registry knows who holds it: b's registry is all a has to go by once a's data directory is gone.
        await cluster.wait_registered(DATABASE)

        assert cluster["b"].stop() == 0
        # Only c gets these: a's newest write of r, and a's delete.
        await ledger.put("a", "r", "new")
        await ledger.delete("a", "gone")
        await cluster.wait_converged(DATABASE, ["a", "c"], timeout=60, expect_count=2)

        assert cluster["a"].stop() == 0
        assert cluster["c"].stop() == 0
        shutil.rmtree(cluster["a"].dir / "data")
        cluster["b"].start()
        cluster["a"].start()
        await cluster.wait_ready(["a", "b"])
        await wait_for(lambda: _has(cluster, "a", "b-1"), 60, "a's recovery from b (b's own record back on a)")
        # a takes writes while it recovers; c, which holds a's newest writes, is waited for.
        await ledger.put("a", "during", "the recovery")
        state = await wait_for(lambda: _waiting(cluster, "a", DATABASE, "c", only=True), 60, "a's recovery: c alone")
        assert state["state"] == "recovering" and state["waiting_for"] == ["c"], state

        cluster["c"].start()
        await cluster.wait_ready(["c"])

        async def recovered() -> bool:
            return (await _recovery(cluster, "a", DATABASE)).get("state") == "recovered"

        await wait_for(recovered, 60, "a's recovery finished once c served it")
        await cluster.wait_converged(DATABASE, timeout=60)
        # Rounds with every peer bring back nothing older.
        for name in cluster.nodes:
            status, body = await cluster.admin_request(name, "POST", f"/antientropy/{DATABASE}")
            assert status == 200, body
        await cluster.wait_converged(DATABASE, timeout=60)
        await ledger.check()
        assert not cluster["a"].events("foreign_origin_refused")
        await cluster.wait_converged("system", timeout=30)
        await assert_identical(cluster, [DATABASE, "system"])
    finally:
        await cluster.close()


async def test_on_a_line_two_lost_neighbours_keep_the_write_that_survives_beyond_them(make_cluster) -> None:  # type: ignore[no-untyped-def]
    replication = {
        **FAST,
        "tombstone_retention": 1.0,
        "audit_retention": 1.0,
        "prune_interval": 0.5,
        "failover_after": 2.0,
    }
    cluster = make_cluster(["a", "b", "c"], workers=1, topology="line", replication=replication)
    ledger = Ledger(cluster, DATABASE)
    cluster.start()
    try:
        await cluster.wait_ready()
        await ledger.put("a", "r", "kept by c")
        await ledger.put("c", "c-1", "c's")
        await cluster.wait_converged(DATABASE, timeout=60, expect_count=2)
        await cluster.wait_registered(DATABASE)

        for name in ("c", "a", "b"):
            assert cluster[name].stop() == 0
        for name in ("a", "b"):
            for path in (cluster[name].dir / "data").glob(f"{DATABASE}.sqlite*"):
                path.unlink()
        cluster["b"].start()
        cluster["a"].start()
        await cluster.wait_ready(["a", "b"])
        # a writes again: its file is a lost one, and its only peer lost the database too.
        await ledger.put("a", "after", "the loss")
        state = await wait_for(lambda: _waiting(cluster, "a", DATABASE, "b"), 60, "a's recovery waiting for b")
        assert state["state"] == "recovering", state

        async def b_recovering() -> bool:
            return (await _recovery(cluster, "b", DATABASE)).get("state") == "recovering"

        await wait_for(b_recovering, 60, "b's file of the database, lost too, recovering")
        assert (await _recovery(cluster, "a", DATABASE))["state"] == "recovering"  # b is no witness yet

        cluster["c"].start()
        await cluster.wait_ready(["c"])

        async def recovered(name: str) -> bool:
            return (await _recovery(cluster, name, DATABASE)).get("state") == "recovered"

        await wait_for(lambda: recovered("b"), 90, "b's recovery once c served it")
        await wait_for(lambda: recovered("a"), 90, "a's recovery once b was whole")
        await cluster.wait_converged(DATABASE, timeout=60, expect_count=3)
        # A retention pass on every node past the writes, then every pair's rounds: the write is not taken for
        # deleted. A pass is seen by what it prunes: a record in another database, whose audit entries are a second
        # old when a pass prunes them and then purges with the same second of tombstone_retention.
        pruned = {name: len(cluster[name].events("audit_pruned")) for name in cluster.nodes}
        assert (await cluster.data("c", "PUT", "/data/tick/t/x", {"v": 1}))[0] == 200
        for name in cluster.nodes:
            await wait_for(
                lambda name=name: len(cluster[name].events("audit_pruned")) > pruned[name],
                60,
                f"{name}'s retention pass",
            )
        for name in cluster.nodes:
            status, body = await cluster.admin_request(name, "POST", f"/antientropy/{DATABASE}")
            assert status == 200, body
        await cluster.wait_converged(DATABASE, timeout=60, expect_count=3)
        await ledger.check()
        await assert_identical(cluster, [DATABASE])
    finally:
        await cluster.close()


async def _has(cluster, name: str, record_id: str) -> bool:  # type: ignore[no-untyped-def]
    status, _ = await cluster.data(name, "GET", f"/data/{DATABASE}/t/{record_id}")
    return status == 200


async def _waiting(cluster, name: str, database: str, peer: str, only: bool = False) -> dict | None:  # type: ignore[no-untyped-def]
    """The recovery's state once it waits for `peer` (`only`: for `peer` alone, every other pair having served)."""
    state = await _recovery(cluster, name, database)
    waiting = state.get("waiting_for", [])
    return state if (waiting == [peer] if only else peer in waiting) else None


async def _connected(cluster, name: str, peer: str, database: str) -> bool:  # type: ignore[no-untyped-def]
    _, body = await cluster.admin(name, "/status")
    pairs = [p for c in body["connections"] if c["peer"] == peer for p in c["databases"] if p["database"] == database]
    return bool(pairs) and pairs[0]["connected"]


def _damage(cluster, name: str, record_id: str) -> None:  # type: ignore[no-untyped-def]
    path = cluster[name].dir / "data" / f"{DATABASE}.sqlite"
    with closing(sqlite3.connect(path, timeout=10)) as conn:
        conn.execute("UPDATE records SET value = X'00' WHERE tbl = 't' AND id = ?", (record_id,))
        conn.commit()


async def test_a_damaged_row_waits_for_the_peer_with_the_newer_write_not_the_lagging_one(make_cluster) -> None:  # type: ignore[no-untyped-def]
    # The audit log keeps a second: the newest write of r is gone from it before the repairs.
    replication = {**FAST, "failover_after": 2.0, "audit_retention": 1.0, "prune_interval": 0.5}
    cluster = make_cluster(["a", "b", "c"], workers=1, replication=replication)
    ledger = Ledger(cluster, DATABASE)
    cluster.start()
    try:
        await cluster.wait_ready()
        await ledger.put("a", "r", "old")
        await cluster.wait_converged(DATABASE, timeout=60, expect_count=1)
        await cluster.wait_registered(DATABASE)
        assert cluster["b"].stop() == 0
        await ledger.put("a", "r", "new")  # b misses it
        await cluster.wait_converged(DATABASE, ["a", "c"], timeout=60, expect_count=1)
        assert cluster["c"].stop() == 0
        await wait_for(lambda: any(e.get("entries") for e in cluster["a"].events("audit_pruned")), 30, "a's prune")

        _damage(cluster, "a", "r")
        cluster["b"].start()
        await cluster.wait_ready(["b"])
        await wait_for(lambda: _connected(cluster, "a", "b", DATABASE), 60, "a's pair with b")
        # b lags (it never got a's newest write): its older copy does not replace a's damaged row, which would undo
        # the newer write. The row stays unserved until a peer that has everything a has shows up.
        status, body = await cluster.admin_request("a", "POST", f"/antientropy/{DATABASE}")
        assert status == 200, body
        status, r = await cluster.data("a", "GET", f"/data/{DATABASE}/t/r")
        assert status == 503, r

        cluster["c"].start()
        await cluster.wait_ready(["c"])
        await cluster.wait_connected(timeout=60, databases=[DATABASE])
        # c holds the version a wrote last: a takes it back, and does not reassert the older one above it.
        for name in ("a", "b"):
            status, body = await cluster.admin_request(name, "POST", f"/antientropy/{DATABASE}")
            assert status == 200, body
        await cluster.wait_converged(DATABASE, timeout=60)
        await ledger.check()
        assert not cluster["a"].events("foreign_origin_refused")
        await assert_identical(cluster, [DATABASE])
    finally:
        await cluster.close()


async def test_a_new_database_follows_the_wall_clock(make_cluster) -> None:  # type: ignore[no-untyped-def]
    behind = faketime_env("-10s")
    env = {"c": behind} if behind is not None else None
    cluster = make_cluster(["a", "b", "c"], workers=1, replication=dict(FAST), env=env)
    ledger = Ledger(cluster, "fresh")
    ledger_early = Ledger(cluster, "early")
    cluster.start()
    try:
        await cluster.wait_ready()

        async def registry_whole() -> bool:
            _, state = await cluster.admin("a", "/status")
            return state["recovery"].get("system", {}).get("state") == "recovered"

        # Until its system database has heard from its peers, a node cannot tell a database it never held from one
        # it lost with a wiped data directory: such files recover, but on the wall clock all the same.
        early = await ledger_early.put("a", "early", "before the registry is whole")
        assert early / 1e6 < time.time() + 5, early
        await wait_for(registry_whole, 60, "a's system database to have heard from its peers")
        before = time.time()
        first = await ledger.put("a", "r", "a's, first")
        # Not max_clock_skew (60 s) ahead: a name no node ever held has no earlier history to stay above.
        assert first / 1e6 < time.time() + 5, (first, before)
        status, state = await cluster.admin("a", "/status")
        assert "fresh" not in state["recovery"], state["recovery"]
        await cluster.wait_converged("fresh", timeout=60, expect_count=1)
        # A write made after it, elsewhere, wins everywhere.
        await ledger.put("b", "r", "b's, later")
        await cluster.wait_converged("fresh", timeout=60, expect_count=1)
        for name in cluster.nodes:
            status, body = await cluster.data(name, "GET", "/data/fresh/t/r")
            assert status == 200 and body["value"] == "b's, later", (name, body)
        if behind is not None:
            # c's clock is 10 s behind: well inside max_clock_skew, it refuses nothing.
            assert not cluster["c"].events("clock_skew_refused")
        await ledger.check()
        await cluster.wait_converged("early", timeout=60, expect_count=1)
        await ledger_early.check()
        await assert_identical(cluster, ["fresh", "early"])
    finally:
        await cluster.close()
