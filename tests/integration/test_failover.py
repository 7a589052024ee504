"""Every write reaches every node across a cut link, a dead origin and a decommissioned node.

Four nodes, links a-b, b-c, c-d and a-c, the a-c link through proxies that cut it (TLS host checks stay on). d's
only link is to c, which is behind the cut from a: a's writes reach c and d only through b, once c's direct link to
a has been down for failover_after. Each test ends with equal digests and no audit entry twice.
"""

from __future__ import annotations

import signal

from replicator.coordinator.local_cluster import LocalCluster
from tests.integration.conftest import FAST, assert_identical, wait_for, write_many

DATABASE = "routed"
FAILOVER_AFTER = 2.0
TOPOLOGY = {"a": ["b", "c"], "b": ["a", "c"], "c": ["b", "d", "a"], "d": ["c"]}


def _four(make_cluster) -> LocalCluster:  # type: ignore[no-untyped-def]
    return make_cluster(
        ["a", "b", "c", "d"],
        workers=1,
        topology=TOPOLOGY,
        proxied=[("a", "c")],
        replication={**FAST, "failover_after": FAILOVER_AFTER},
    )


async def _has(cluster: LocalCluster, name: str, record_id: str, table: str = "t") -> bool:
    status, _ = await cluster.data(name, "GET", f"/data/{DATABASE}/{table}/{record_id}")
    return status == 200


async def _start(cluster: LocalCluster) -> None:
    cluster.start()
    await cluster.wait_ready()
    # The database exists everywhere and every pair of it is up before the cut.
    await write_many(cluster, "d", DATABASE, "t", ["seed"], {"from": "d"})
    await cluster.wait_converged(DATABASE, timeout=60, expect_count=1)
    await cluster.wait_connected(timeout=60, databases=[DATABASE])


async def test_writes_on_both_sides_of_a_cut_reach_every_node_while_it_lasts(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = _four(make_cluster)
    try:
        await _start(cluster)
        cluster.proxy("a", "c").cut()
        ids = {name: [f"{name}-{i}" for i in range(50)] for name in cluster.nodes}
        for name, written in ids.items():
            await write_many(cluster, name, DATABASE, "t", written, {"from": name})
        # While the cut lasts: failover_after, then a route through b, well within 30 s more.
        await cluster.wait_converged(DATABASE, timeout=FAILOVER_AFTER + 30, expect_count=201)
        _, status = await cluster.admin("c", "/status")
        assert "a" in status["failed_over"].get(DATABASE, []), status["failed_over"]
        reroutes = [e for e in cluster["c"].events("route_changed") if e["database"] == DATABASE]
        assert reroutes, "c never re-routed a's origin"
        await assert_identical(cluster, [DATABASE])

        # Healed: a's origin moves back to its own link once it is caught up.
        cluster.proxy("a", "c").heal()

        async def moved_back() -> bool:
            _, body = await cluster.admin("c", "/status")
            return DATABASE not in body["failed_over"]

        await wait_for(moved_back, 60, "a's origin back on the a-c link at c")
        await write_many(cluster, "a", DATABASE, "t", ["after-heal"], {"from": "a"})
        await cluster.wait_converged(DATABASE, timeout=30, expect_count=202)
        await assert_identical(cluster, [DATABASE])
    finally:
        await cluster.close()


async def test_an_origin_that_dies_during_the_cut_still_reaches_every_live_node(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = _four(make_cluster)
    try:
        await _start(cluster)
        cluster.proxy("a", "c").cut()
        await write_many(cluster, "a", DATABASE, "t", ["last-words"], {"from": "a"})
        await wait_for(lambda: _has(cluster, "b", "last-words"), 30, "a's write on b")
        cluster["a"].signal(signal.SIGKILL)
        cluster["a"].process.wait(10)  # type: ignore[union-attr]
        live = ["b", "c", "d"]
        for name in live:
            await wait_for(lambda name=name: _has(cluster, name, "last-words"), FAILOVER_AFTER + 30, f"it on {name}")
        await cluster.wait_converged(DATABASE, names=live, timeout=30, expect_count=2)
        await assert_identical(cluster, [DATABASE], live)
    finally:
        await cluster.close()


async def test_a_decommissioned_nodes_writes_reach_the_nodes_that_missed_them(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = _four(make_cluster)
    try:
        await _start(cluster)
        cluster.proxy("a", "c").cut()
        await write_many(cluster, "a", DATABASE, "t", [f"a-{i}" for i in range(20)], {"from": "a"})
        await wait_for(lambda: _has(cluster, "b", "a-19"), 30, "a's writes on b")
        # Decommission a: the process goes, its row goes, and its neighbours stop dialling it.
        assert cluster["a"].stop() == 0
        for name in ("b", "c"):
            cluster[name].peers = [peer for peer in cluster[name].peers if peer != "a"]
            cluster[name].write_config()
            cluster[name].signal(signal.SIGHUP)
        status, body = await cluster.admin_request("b", "DELETE", "/nodes/a")
        assert status in (200, 204, 404), body
        live = ["b", "c", "d"]
        await cluster.wait_converged(DATABASE, names=live, timeout=FAILOVER_AFTER + 30, expect_count=21)
        await assert_identical(cluster, [DATABASE], live)
    finally:
        await cluster.close()
