"""Damaged database files at boot: exit 3 naming the file and what is wrong, or, with
`replication.recover_damaged`, the file moved aside and the database recovered from a peer.

Each kind of damage a tester met: a truncated file, a header that is not SQLite's, a directory where a
`<name>.sqlite` should be. Every test ends with the node serving and every line of its log a JSON object (a
traceback is not).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from replicator.coordinator.local_cluster import LocalCluster, LocalNode
from tests.integration.conftest import FAST, assert_identical, assert_log_is_json, wait_for, write_many

DATABASE = "precious"
RECORDS = 200
DAMAGES = {
    "truncated": "truncated: ",
    "garbage-header": "not a SQLite database: bad header",
    "directory": "a directory, not a database file",
}


def damage(path: Path, kind: str) -> None:
    for suffix in ("-wal", "-shm"):
        assert not Path(f"{path}{suffix}").exists(), "a cleanly stopped node leaves no -wal or -shm"
    if kind == "truncated":
        size = path.stat().st_size
        assert size > 8192, size
        os.truncate(path, size // 2)
    elif kind == "garbage-header":
        with path.open("r+b") as file:
            file.write(b"this is not a database header, whatever it was" * 2)
    else:
        path.unlink()
        path.mkdir()
        (path / "stray").write_text("a file in a directory named like a database")


def entry_kind(path: Path) -> str:
    return "directory" if path.is_dir() else "file" if path.is_file() else "nothing"


async def assert_serving(cluster: LocalCluster, name: str) -> None:
    status, body = await cluster.data(name, "PUT", f"/data/{DATABASE}/t/after-boot", {"ok": True})
    assert status == 200, body
    status, body = await cluster.data(name, "GET", f"/data/{DATABASE}/t/after-boot")
    assert status == 200 and body["value"] == {"ok": True}, body
    assert_log_is_json(cluster[name])


async def wait_exit(node: LocalNode, timeout: float = 60.0) -> int | None:
    process = node.process
    assert process is not None
    await wait_for(lambda: process.poll() is not None, timeout, f"{node.name} exits")
    return process.returncode


@pytest.mark.parametrize("kind", list(DAMAGES))
async def test_a_damaged_file_is_exit_3_naming_the_file(make_cluster, kind: str) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(["a"], workers=1)
    node = cluster["a"]
    path = node.dir / "data" / f"{DATABASE}.sqlite"
    try:
        cluster.start()
        await cluster.wait_ready()
        await write_many(cluster, "a", DATABASE, "t", [f"r-{i:04d}" for i in range(RECORDS)], "x" * 200)
        assert node.stop() == 0
        damage(path, kind)

        node.start()
        assert await wait_exit(node) == 3
        failures = node.events("boot_failed")
        assert len(failures) == 1, failures
        reason = failures[0]["reason"]
        assert str(path) in reason and DAMAGES[kind] in reason, reason
        assert "recover_damaged" in reason  # the way out is named
        assert len(node.events("worker_started")) == 1  # the first boot's: no worker was started
        assert_log_is_json(node)

        # The operator moves the file away: the node boots and serves.
        shutil.move(path, node.dir / f"{kind}.evidence")
        node.start()
        await cluster.wait_ready()
        await assert_serving(cluster, "a")
    finally:
        await cluster.close()


async def test_integrity_check_at_boot_on_request(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(["a"], workers=1)
    node = cluster["a"]
    try:
        node.start(args=["--check-integrity"])
        await cluster.wait_ready()
        await write_many(cluster, "a", DATABASE, "t", [f"r-{i:04d}" for i in range(RECORDS)], "x" * 200)
        assert node.stop() == 0
        node.start(args=["--check-integrity"])
        await cluster.wait_ready()
        checks = node.events("database_files_checked")
        assert [event["check"] for event in checks] == ["integrity", "integrity"]
        assert checks[-1]["files"] == 2  # the system database and this one
        await assert_serving(cluster, "a")
    finally:
        await cluster.close()


@pytest.mark.parametrize(("database", "kind"), [(DATABASE, kind) for kind in DAMAGES] + [("system", "truncated")])
async def test_recover_damaged_moves_the_file_aside_and_peers_serve_it_back(  # type: ignore[no-untyped-def]
    make_cluster, database: str, kind: str
) -> None:
    cluster = make_cluster(["a", "b"], workers=1, replication={**FAST, "failover_after": 2.0})
    a = cluster["a"]
    path = a.dir / "data" / f"{database}.sqlite"
    try:
        cluster.start()
        await cluster.wait_ready()
        for name in cluster.nodes:
            ids = [f"{name}-{i:04d}" for i in range(RECORDS)]
            await write_many(cluster, name, DATABASE, "t", ids, {"by": name, "pad": "x" * 200})
        await cluster.wait_converged(DATABASE, timeout=60, expect_count=2 * RECORDS)
        await cluster.wait_converged("system", timeout=30)
        assert a.stop() == 0
        damage(path, kind)

        a.extra["replication"] = {"recover_damaged": True}
        a.start()
        await cluster.wait_ready()
        moved = a.events("database_moved_aside")
        assert len(moved) == 1, moved
        assert moved[0]["database"] == database and DAMAGES[kind] in moved[0]["reason"]
        aside = Path(moved[0]["path"])
        assert aside.parent == a.dir / "data" / "damaged" and aside.name.startswith(f"{database}.sqlite.")
        assert entry_kind(aside) == ("directory" if kind == "directory" else "file")

        await cluster.wait_converged(DATABASE, timeout=60, expect_count=2 * RECORDS)

        async def recovered() -> bool:
            _, body = await cluster.admin("a", "/status")
            return body["recovery"].get(database, {}).get("state") == "recovered"

        await wait_for(recovered, 60, f"a's recovery of {database} finished")
        assert any(event["database"] == database for event in a.events("database_recovered"))
        status, own = await cluster.data("a", "GET", f"/data/{DATABASE}/t/a-0007")
        assert status == 200 and own["origin"] == "a"  # its own writes came back from the peer
        await assert_serving(cluster, "a")
        await cluster.wait_converged(DATABASE, timeout=30, expect_count=2 * RECORDS + 1)
        await cluster.wait_converged("system", timeout=30)
        await assert_identical(cluster, [DATABASE, "system"])
        assert_log_is_json(cluster["b"])
    finally:
        await cluster.close()
