"""Restarts: a node resumes from its durable per-origin progress; a SIGKILL loses or duplicates nothing acknowledged."""

from __future__ import annotations

import asyncio
import signal
import sqlite3

import psutil

from replicator.coordinator.local_cluster import LocalCluster
from tests.integration.conftest import wait_for


async def _pair(cluster: LocalCluster, name: str, peer: str, database: str) -> dict | None:
    status, body = await cluster.admin(name, "/status")
    if status != 200:
        return None
    for connection in body["connections"]:
        if connection["peer"] == peer:
            for pair in connection["databases"]:
                if pair["database"] == database:
                    return pair
    return None


async def test_restarted_node_resumes_from_its_progress(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(["a", "b"], workers=2)
    cluster.start()
    try:
        await cluster.wait_ready()
        first = [{"id": f"k{i:04d}", "value": i} for i in range(200)]
        assert (await cluster.data("a", "POST", "/data/inv/t", first))[0] == 200
        await cluster.wait_converged("inv", timeout=30, expect_count=200)

        assert cluster["b"].stop() == 0
        while_down = [{"id": f"k{i:04d}", "value": i} for i in range(200, 300)]
        assert (await cluster.data("a", "POST", "/data/inv/t", while_down))[0] == 200
        assert (await cluster.data("a", "DELETE", "/data/inv/t/k0000"))[0] == 200

        cluster["b"].start()
        await cluster.wait_ready(["b"])
        await cluster.wait_converged("inv", timeout=30, expect_count=299)

        async def resumed() -> bool:
            pair = await _pair(cluster, "b", "a", "inv")
            return pair is not None and pair["connected"] and pair["caught_up"] and pair["applied"] >= 101

        await wait_for(resumed, 60, "b resumed from a")
        pair = await _pair(cluster, "b", "a", "inv")
        # The resumed session brought exactly what was written while b was down: nothing was served twice.
        assert pair is not None and pair["applied"] == 101
        connects = [e for e in cluster["b"].events("session_connected") if e["peer"] == "a" and e["database"] == "inv"]
        assert connects[-1]["origins"] >= 1  # it resumed from its per-origin progress, not from scratch
    finally:
        await cluster.close()


def _audit_duplicates(path: str) -> list[tuple]:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        return conn.execute(
            "SELECT tbl, id, version, origin, count(*) FROM audit GROUP BY tbl, id, version, origin HAVING count(*) > 1"
        ).fetchall()


async def test_sigkill_loses_and_duplicates_nothing(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(["a", "b", "c"], workers=2)
    cluster.start()
    acked: dict[str, int] = {}
    stop_writing = asyncio.Event()

    async def writer(name: str) -> None:
        batch_no = 0
        while not stop_writing.is_set():
            batch = [{"id": f"{name}-{batch_no:04d}-{i:03d}", "value": {"pad": "x" * 200}} for i in range(100)]
            status, _ = await cluster.data(name, "POST", "/data/kill/t", batch)
            if status == 200:
                acked.update((item["id"], 1) for item in batch)
            batch_no += 1
            await asyncio.sleep(0.01)

    try:
        await cluster.wait_ready()
        await cluster.wait_connected()
        victim = psutil.Process(cluster["c"].process.pid)
        children = victim.children()  # the two workers, and the worker template that forked them
        assert sorted(child.name() == "replicator-tmpl" for child in children) == [False, False, True]
        writers = [asyncio.create_task(writer(name)) for name in ("a", "b")]
        await wait_for(lambda: len(acked) >= 2000, 30, "2000 acknowledged writes")
        cluster["c"].signal(signal.SIGKILL)
        cluster["c"].process.wait(10)
        # Its workers die with it (parent-death signal): nothing of the old node keeps the port or the files.
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive
        await wait_for(lambda: len(acked) >= 4000, 30, "writes while c is down")
        cluster["c"].start()
        await cluster.wait_ready(["c"])
        await wait_for(lambda: len(acked) >= 6000, 30, "writes after c is back")
        stop_writing.set()
        await asyncio.gather(*writers)

        await cluster.wait_converged("kill", timeout=60, expect_count=len(acked))
        for name in ("a", "b", "c"):
            listing: list[str] = []
            after = ""
            while True:
                _, page = await cluster.data(name, "GET", f"/data/kill/t?limit=10000&after={after}")
                if not page:
                    break
                listing += [record["id"] for record in page]
                after = page[-1]["id"]
            assert sorted(listing) == sorted(acked), f"{name} differs"
            assert _audit_duplicates(str(cluster[name].dir / "data" / "kill.sqlite")) == []
    finally:
        stop_writing.set()
        await cluster.close()
