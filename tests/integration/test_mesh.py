"""Three nodes in full mesh: concurrent and conflicting writes converge; updates and deletes propagate; relay."""

from __future__ import annotations

import asyncio

from replicator.coordinator.local_cluster import LocalCluster

NAMES = ["a", "b", "c"]


async def test_concurrent_conflicting_writes_converge(mesh: LocalCluster) -> None:
    writes = []
    for name in NAMES:
        batch = [{"id": f"{name}-{i:04d}", "value": {"by": name, "i": i}} for i in range(300)]
        writes.append(mesh.data(name, "POST", "/data/orders/items", batch))
    for k in range(50):
        for name in NAMES:
            writes.append(mesh.data(name, "PUT", f"/data/orders/items/shared-{k:02d}", {"by": name, "k": k}))
    results = await asyncio.gather(*writes)
    assert all(status == 200 for status, _ in results), [r for r in results if r[0] != 200][:3]

    await mesh.wait_converged("orders", timeout=60, expect_count=3 * 300 + 50)

    # Last-writer-wins picked the same winner everywhere, and it is the greatest (version, origin) written.
    written: dict[str, list[tuple[int, str]]] = {}
    for (_, body), index in zip(results[3:], range(150), strict=True):
        k, name = divmod(index, 3)
        written.setdefault(f"shared-{k:02d}", []).append((body["version"], NAMES[name]))
    for record_id, candidates in list(written.items())[::7]:
        seen = {name: (await mesh.data(name, "GET", f"/data/orders/items/{record_id}"))[1] for name in NAMES}
        winners = {(body["version"], body["origin"]) for body in seen.values()}
        assert winners == {max(candidates)}, (record_id, seen)


async def test_updates_and_deletes_propagate(mesh: LocalCluster) -> None:
    batch = [{"id": f"r{i}", "value": {"v": 1}} for i in range(20)]
    assert (await mesh.data("a", "POST", "/data/ud/t", batch))[0] == 200
    await mesh.wait_converged("ud", timeout=30, expect_count=20)

    status, updated = await mesh.data("b", "PUT", "/data/ud/t/r3", {"v": 2})
    assert status == 200
    assert (await mesh.data("c", "DELETE", "/data/ud/t/r4"))[0] == 200
    await mesh.wait_converged("ud", timeout=30, expect_count=19)

    for name in NAMES:
        status, body = await mesh.data(name, "GET", "/data/ud/t/r3")
        assert status == 200 and body["value"] == {"v": 2} and body["version"] == updated["version"]
        assert body["origin"] == "b"
        status, _ = await mesh.data(name, "GET", "/data/ud/t/r4")
        assert status == 404
    listing = (await mesh.data("a", "GET", "/data/ud/t?limit=100"))[1]
    assert [r["id"] for r in listing] == sorted(f"r{i}" for i in range(20) if i != 4)


async def test_relay_through_the_middle_node(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(["a", "b", "c"], workers=1, topology="line")
    cluster.start()
    try:
        await cluster.wait_ready()
        assert (await cluster.data("a", "PUT", "/data/relay/t/from-a", {"hop": "a"}))[0] == 200
        assert (await cluster.data("c", "PUT", "/data/relay/t/from-c", {"hop": "c"}))[0] == 200
        await cluster.wait_converged("relay", timeout=30, expect_count=2)
        status, body = await cluster.data("c", "GET", "/data/relay/t/from-a")
        assert status == 200 and body["origin"] == "a"
        status, body = await cluster.data("a", "GET", "/data/relay/t/from-c")
        assert status == 200 and body["origin"] == "c"
        # a and c are not peered: neither holds a connection to the other.
        for name, other in (("a", "c"), ("c", "a")):
            _, status_doc = await cluster.admin(name, "/status")
            assert other not in {connection["peer"] for connection in status_doc["connections"]}
    finally:
        await cluster.close()
