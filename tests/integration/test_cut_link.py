"""A link cut by the proxy between two nodes: the sessions show disconnected, and a write made during the cut
arrives after the heal. The link runs through proxies with TLS host verification on."""

from __future__ import annotations

from replicator.coordinator.local_cluster import LocalCluster
from tests.integration.conftest import wait_for

DATABASE = "cut"


async def _pairs(cluster: LocalCluster, name: str, peer: str) -> list[dict]:
    status, body = await cluster.admin(name, "/status")
    assert status == 200, body
    return [pair for c in body["connections"] if c["peer"] == peer for pair in c["databases"]]


async def test_cut_link_disconnects_and_heal_delivers_the_writes_made_during_the_cut(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(["a", "b"], workers=1, proxied=[("a", "b")])
    link = cluster.proxy("a", "b")
    cluster.start()
    try:
        await cluster.wait_ready()
        assert (await cluster.data("a", "PUT", f"/data/{DATABASE}/t/before", {"n": 1}))[0] == 200
        await cluster.wait_converged(DATABASE, timeout=30, expect_count=1)
        await cluster.wait_connected(timeout=30, databases=[DATABASE])
        # Each node really dials the other through its proxy.
        assert link.via("a", "b").accepted > 0 and link.via("b", "a").accepted > 0

        link.cut()

        async def all_disconnected() -> bool:
            pairs = await _pairs(cluster, "a", "b") + await _pairs(cluster, "b", "a")
            return bool(pairs) and not any(pair["connected"] for pair in pairs)

        await wait_for(all_disconnected, 60, "every a-b session reported disconnected")
        status, written = await cluster.data("a", "PUT", f"/data/{DATABASE}/t/during", {"n": 2})
        assert status == 200
        assert (await cluster.data("b", "GET", f"/data/{DATABASE}/t/during"))[0] == 404

        link.heal()

        await cluster.wait_converged(DATABASE, timeout=45, expect_count=2)
        status, body = await cluster.data("b", "GET", f"/data/{DATABASE}/t/during")
        assert status == 200 and body["origin"] == "a" and body["version"] == written["version"]
        await cluster.wait_connected(timeout=30, databases=[DATABASE])
    finally:
        await cluster.close()
