"""A deletion removes what the deleting node had seen, and nothing else (invariant 20), on real processes.

- A node cut off from the others while a database is deleted keeps taking writes to it; once the link heals, the
  deletion reaches it: the records from before the deletion go, its writes acknowledged after the deletion returned
  stay, and they replicate back to the nodes that had removed the database.
- Clocks apart by less than max_clock_skew change nothing: the records written before the deletion on a node whose
  clock runs 30 s ahead are removed on every node too.

Each test ends with equal digests on every node and every acknowledged write made after the deletion in place.
"""

from __future__ import annotations

import pytest

from replicator.coordinator.local_cluster import faketime_env
from tests.integration.conftest import FAST, assert_identical, wait_for, write_many
from tests.integration.ledger import Ledger

pytestmark = pytest.mark.timeout(300)


async def _gone(cluster, database: str, ids: list[str]) -> list[str]:  # type: ignore[no-untyped-def]
    """The (node, id) of the records among `ids` some node still serves."""
    left = []
    for name in cluster.nodes:
        for record_id in ids:
            status, _ = await cluster.data(name, "GET", f"/data/{database}/t/{record_id}")
            if status != 404:
                left.append(f"{name}/{record_id}")
    return left


async def test_writes_on_a_node_cut_off_during_the_deletion_survive_it(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(
        ["a", "b", "c"], workers=1, replication={**FAST, "failover_after": 2.0}, proxied=[("a", "c"), ("b", "c")]
    )
    cluster.start()
    after = Ledger(cluster, "doomed")
    try:
        await cluster.wait_ready()
        before = []
        for name in cluster.nodes:
            ids = [f"{name}-{i}" for i in range(20)]
            await write_many(cluster, name, "doomed", "t", ids, {"by": name})
            before += ids
        await cluster.wait_converged("doomed", timeout=60, expect_count=60)
        await write_many(cluster, "a", "kept", "t", ["k"], 1)
        await cluster.wait_converged("kept", timeout=60, expect_count=1)

        for link in (("a", "c"), ("b", "c")):
            cluster.proxy(*link).cut()
        status, body = await cluster.admin_request("a", "DELETE", "/databases/doomed")
        assert status == 200, body
        # c, cut off, goes on taking writes to the database: acknowledged after the deletion returned.
        for i in range(10):
            await after.put("c", f"c-after-{i}", {"n": i})
        await after.put("c", "a-3", "rewritten on c after the deletion")

        async def removed_on_a_and_b() -> bool:
            for name in ("a", "b"):
                _, state = await cluster.admin(name, "/status")
                if "doomed" in state["holds"]:
                    return False
            return True

        await wait_for(removed_on_a_and_b, 60, "doomed removed from a and b")
        for link in (("a", "c"), ("b", "c")):
            cluster.proxy(*link).heal()

        # The deletion reaches c: what a had seen goes; c's writes since stay, and come back to a and b.
        survivors = len(after.acked)
        await cluster.wait_converged("doomed", timeout=90, expect_count=survivors)
        gone = [record_id for record_id in before if record_id != "a-3"]
        assert await _gone(cluster, "doomed", gone) == []
        await after.check()
        await cluster.wait_converged("system", timeout=30)
        await assert_identical(cluster, ["doomed", "kept"])
    finally:
        await cluster.close()


async def test_records_written_before_the_deletion_go_whatever_the_clocks(make_cluster) -> None:  # type: ignore[no-untyped-def]
    ahead = faketime_env("+30s")
    if ahead is None:
        pytest.skip("libfaketime is not installed (Debian package faketime; .ci/run installs it)")
    cluster = make_cluster(["a", "b", "c"], workers=1, replication=dict(FAST), env={"b": ahead})
    cluster.start()
    try:
        await cluster.wait_ready()
        before = []
        for name in cluster.nodes:
            ids = [f"{name}-{i}" for i in range(20)]
            await write_many(cluster, name, "skewed", "t", ids, {"by": name})
            before += ids
        await cluster.wait_converged("skewed", timeout=60, expect_count=60)
        status, body = await cluster.admin_request("c", "DELETE", "/databases/skewed")
        assert status == 200, body

        async def removed_everywhere() -> bool:
            for name in cluster.nodes:
                _, state = await cluster.admin(name, "/status")
                if "skewed" in state["holds"]:
                    return False
            return True

        await wait_for(removed_everywhere, 60, "skewed removed from every node")
        assert await _gone(cluster, "skewed", before) == []
        # Written again afterwards, on the node ahead and on another, it is there again, everywhere.
        again = Ledger(cluster, "skewed")
        await again.put("b", "new-b", 1)
        await again.put("a", "new-a", 2)
        await cluster.wait_converged("skewed", timeout=60, expect_count=2)
        await again.check()
        await assert_identical(cluster, ["skewed"])
    finally:
        await cluster.close()
