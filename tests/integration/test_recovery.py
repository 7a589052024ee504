"""What a node holds comes back whole: a wiped data directory, and a first sync under writes and pruning.

A node whose data directory is deleted while it is stopped gets every record back from its peers, its own
included, and says so (`database_recovered`, `/status` recovery). A first sync of 100,000 records resumes by
origin from the records table, so a sender that keeps writing and prunes its audit log every fraction of a second
cannot make the new node skip anything.
"""

from __future__ import annotations

import asyncio
import shutil

from tests.integration.conftest import FAST, assert_identical, wait_for, write_many

DATABASE = "precious"


async def test_a_wiped_data_directory_is_recovered_own_records_included(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(["a", "b", "c"], workers=2, replication={**FAST, "failover_after": 2.0})
    cluster.start()
    try:
        await cluster.wait_ready()
        for name in cluster.nodes:
            await write_many(cluster, name, DATABASE, "t", [f"{name}-{i:04d}" for i in range(300)], {"by": name})
            await write_many(cluster, name, "other", "t", [f"{name}-x"], {"by": name})
        await cluster.wait_converged(DATABASE, timeout=60, expect_count=900)
        status, _ = await cluster.data("c", "DELETE", f"/data/{DATABASE}/t/a-0000")  # c's own tombstone
        assert status == 200
        await cluster.wait_converged(DATABASE, timeout=60, expect_count=899)
        await cluster.wait_converged("other", timeout=60, expect_count=3)

        assert cluster["c"].stop() == 0
        shutil.rmtree(cluster["c"].dir / "data")
        cluster["c"].start()
        await cluster.wait_ready(["c"])
        # A write on the recovering node goes out at once, and is not lost in the recovery.
        await write_many(cluster, "c", DATABASE, "t", ["c-after"], {"by": "c"})
        await cluster.wait_converged(DATABASE, timeout=60, expect_count=900)
        await cluster.wait_converged("other", timeout=60, expect_count=3)
        status, own = await cluster.data("c", "GET", f"/data/{DATABASE}/t/c-0007")
        assert status == 200 and own["origin"] == "c"

        async def recovered() -> dict | None:
            _, body = await cluster.admin("c", "/status")
            states = [body["recovery"].get(name, {}).get("state") for name in (DATABASE, "other")]
            return body if states == ["recovered", "recovered"] else None

        body = await wait_for(recovered, 60, "c's recovery of both databases finished")
        assert body["recovery"][DATABASE]["records"] >= 900
        events = {e["database"]: e for e in cluster["c"].events("database_recovered")}
        assert events[DATABASE]["records"] >= 900 and "other" in events
        # Writes after the recovery carry on as usual.
        await write_many(cluster, "c", DATABASE, "t", ["c-later"], {"by": "c"})
        await cluster.wait_converged(DATABASE, timeout=30, expect_count=901)
        # Each node rewrites its own registry row as it opens databases: wait for the last rewrite to arrive.
        await cluster.wait_converged("system", timeout=30)
        await assert_identical(cluster, [DATABASE, "other", "system"])
    finally:
        await cluster.close()


async def test_a_first_sync_under_writes_and_aggressive_pruning_skips_nothing(make_cluster) -> None:  # type: ignore[no-untyped-def]
    replication = {**FAST, "audit_retention": 0.2, "prune_interval": 0.1, "batch_size": 500}
    cluster = make_cluster(["a", "b"], workers=1, replication=replication)
    cluster["a"].start()
    try:
        await cluster.wait_ready(["a"])
        for start in range(0, 100_000, 5_000):
            ids = [f"r{i:06d}" for i in range(start, start + 5_000)]
            await write_many(cluster, "a", DATABASE, "bulk", ids, {"pad": "x" * 100})
        stop = asyncio.Event()
        written = 0

        async def keep_writing() -> None:
            nonlocal written
            round_no = 0
            while not stop.is_set():
                # New records, rewrites of records the copy may already have passed, and deletes.
                fresh = [f"w{round_no:04d}-{i}" for i in range(20)]
                await write_many(cluster, "a", DATABASE, "live", fresh, {"round": round_no})
                rewrites = [f"r{(round_no * 997 + i * 7919) % 100_000:06d}" for i in range(20)]
                await write_many(cluster, "a", DATABASE, "bulk", rewrites, {"round": round_no})
                await cluster.data("a", "DELETE", f"/data/{DATABASE}/bulk/r{(round_no * 31) % 100_000:06d}")
                written += 1
                round_no += 1
                await asyncio.sleep(0.02)

        writer = asyncio.create_task(keep_writing())
        cluster["b"].start()
        await cluster.wait_ready(["b"])

        async def syncing_for_a_while() -> bool:
            return written >= 100

        await wait_for(syncing_for_a_while, 120, "writes during b's first sync")
        stop.set()
        await writer
        assert any(e.get("entries") for e in cluster["a"].events("audit_pruned")), "a never pruned"
        await cluster.wait_converged(DATABASE, timeout=120)
        await assert_identical(cluster, [DATABASE])
    finally:
        await cluster.close()


async def test_a_data_directory_restored_from_an_old_backup_gets_the_newer_own_writes_back(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(["a", "b"], workers=1, replication={**FAST, "failover_after": 2.0})
    cluster.start()
    try:
        await cluster.wait_ready()
        await write_many(cluster, "b", DATABASE, "t", [f"old-{i}" for i in range(100)], {"by": "b"})
        await cluster.wait_converged(DATABASE, timeout=60, expect_count=100)
        assert cluster["b"].stop() == 0
        backup = cluster["b"].dir / "backup"
        shutil.copytree(cluster["b"].dir / "data", backup)
        cluster["b"].start()
        await cluster.wait_ready(["b"])
        # Written after the backup was taken: only a holds them once b's file goes back in time.
        await write_many(cluster, "b", DATABASE, "t", [f"new-{i}" for i in range(100)], {"by": "b"})
        await cluster.wait_converged(DATABASE, timeout=60, expect_count=200)

        assert cluster["b"].stop() == 0
        shutil.rmtree(cluster["b"].dir / "data")
        shutil.copytree(backup, cluster["b"].dir / "data")
        cluster["b"].start()
        await cluster.wait_ready(["b"])
        await cluster.wait_converged(DATABASE, timeout=60, expect_count=200)
        regressed = [e for e in cluster["b"].events("database_regressed") if e["database"] == DATABASE]
        assert regressed and regressed[0]["peer"] == "a"
        # New writes on b are above everything a already holds of b, so they replicate as usual.
        await write_many(cluster, "b", DATABASE, "t", ["after-restore"], {"by": "b"})
        await cluster.wait_converged(DATABASE, timeout=30, expect_count=201)

        async def recovered() -> bool:
            _, body = await cluster.admin("b", "/status")
            return body["recovery"].get(DATABASE, {}).get("state") == "recovered"

        await wait_for(recovered, 60, "b's recovery after the restore finished")
        await assert_identical(cluster, [DATABASE])
    finally:
        await cluster.close()
