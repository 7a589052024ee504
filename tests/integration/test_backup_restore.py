"""`replicator backup` of a node under writes and `replicator restore` onto its wiped data directory, on real
processes: the restored node converges with its peers, every acknowledged write is there (those made after the backup
come back from the peers, its own included), no deleted record comes back, and a database made after the backup is
taken back too. A backup too old for `tombstone_retention`, or a node still running, is refused with the reason."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
from pathlib import Path

from tests.integration.conftest import FAST, assert_identical, wait_for
from tests.integration.ledger import Ledger

DATABASE = "precious"
OTHER = "other"
LATER = "later"  # made on a after the backup
REPO = Path(__file__).resolve().parents[2]


async def _cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "replicator.coordinator.cli",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )
    stdout, stderr = await process.communicate()
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


async def test_a_backup_under_writes_restored_onto_a_wiped_node_converges_without_undoing_deletes(  # type: ignore[no-untyped-def]
    make_cluster, tmp_path: Path
) -> None:
    cluster = make_cluster(["a", "b", "c"], workers=1, replication={**FAST, "failover_after": 2.0})
    for node in cluster.nodes.values():
        node.extra["data"] = {"blob_threshold": 1024}  # a value of 4 KB is a blob file beside its database
    cluster.start()
    ledger = Ledger(cluster, DATABASE)
    other = Ledger(cluster, OTHER)
    later = Ledger(cluster, LATER)
    a = cluster["a"]
    token = {"REPLICATOR_ADMIN_TOKEN": a.admin_token} if a.admin_token else {}
    try:
        await cluster.wait_ready()
        for name in cluster.nodes:
            for i in range(20):
                await ledger.put(name, f"{name}-{i:02d}", {"by": name, "i": i})
        await other.put("a", "x", "before")
        await ledger.put("a", "big", "b" * 4096)
        await cluster.wait_converged(DATABASE, timeout=60, expect_count=61)
        await cluster.wait_converged(OTHER, timeout=60, expect_count=1)

        # The backup runs while a and b keep writing: what lands after a's snapshot is not in it.
        out = tmp_path / "backup"
        backup = asyncio.ensure_future(_cli("backup", "--admin", a.admin_url, "--out", str(out), "--json", env=token))
        written = 0
        while not backup.done():
            await ledger.put("a", f"during-a-{written}", written)
            await ledger.put("b", f"during-b-{written}", written)
            written += 1
        code, stdout, stderr = await backup
        assert code == 0, stderr
        summary = json.loads(stdout)
        assert summary["node"] == "a" and {d["database"] for d in summary["databases"]} >= {DATABASE, OTHER, "system"}
        assert "database precious:" in stderr  # progress, per database
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["node"] == "a" and {d["database"] for d in manifest["databases"]} == {
            d["database"] for d in summary["databases"]
        }
        precious = next(d for d in manifest["databases"] if d["database"] == DATABASE)
        assert len(precious["blobs"]) == 1 and (out / precious["blobs"][0]["path"]).is_file()
        # A second backup never goes over the first.
        code, _, stderr = await _cli("backup", "--admin", a.admin_url, "--out", str(out), env=token)
        assert code == 2 and "not an empty folder" in stderr

        # After the backup: new records, updates and deletes, of a's own records and of others', and a new database.
        for i in range(10):
            await ledger.put("a", f"after-a-{i}", i)
            await ledger.put("c", f"after-c-{i}", i)
        for i in range(0, 20, 4):
            await ledger.put("a", f"a-{i:02d}", "updated on a")
            await ledger.put("b", f"a-{i + 1:02d}", "updated on b")
            await ledger.delete("a", f"a-{i + 2:02d}")  # a's own record, deleted by a
            await ledger.delete("b", f"b-{i:02d}")
            await ledger.delete("a", f"c-{i:02d}")
        await other.put("a", "x", "after")
        await later.put("a", "l1", "made after the backup")
        await later.put("a", "l2", "deleted again")
        await later.delete("a", "l2")
        for database in (DATABASE, OTHER, LATER):
            await cluster.wait_converged(database, timeout=90)

        # Refused while a runs, and refused as too old under a short tombstone_retention, each with its reason.
        code, _, stderr = await _cli("restore", "--from", str(out), "--config", str(a.config_path))
        assert code == 2 and "a node runs on the data directory" in stderr
        assert a.stop() == 0
        shutil.rmtree(a.dir / "data")
        short = {"REPLICATOR_REPLICATION_TOMBSTONE_RETENTION": "30"}
        code, _, stderr = await _cli("restore", "--from", str(out), "--config", str(a.config_path), env=short)
        assert code == 2 and "tombstone_retention" in stderr and "--force" in stderr
        assert not (a.dir / "data").exists() or not any((a.dir / "data").glob("*.sqlite"))

        recovered_before = len(a.events("database_recovered"))
        code, stdout, stderr = await _cli("restore", "--from", str(out), "--config", str(a.config_path), "--json")
        assert code == 0, stderr
        assert set(json.loads(stdout)["databases"]) == {d["database"] for d in manifest["databases"]}
        a.start()
        await cluster.wait_ready(["a"])
        for database in (DATABASE, OTHER, LATER):
            await cluster.wait_converged(database, timeout=120)

        async def recovered() -> bool:
            _, body = await cluster.admin("a", "/status")
            return all(
                body["recovery"].get(database, {}).get("state", "recovered") == "recovered"
                for database in ("system", DATABASE, OTHER, LATER)
            )

        await wait_for(recovered, 120, "a's recovery after the restore")
        # Every restored file recovered: it was taken for one that may lack own writes, not for an intact one.
        again = {event["database"] for event in a.events("database_recovered")[recovered_before:]}
        assert again >= {"system", DATABASE, OTHER}, again
        # New writes on a replicate as usual, above everything the peers hold of it.
        await ledger.put("a", "after-restore", "new")
        await cluster.wait_converged(DATABASE, timeout=60)
        for database in (DATABASE, OTHER, LATER):
            await cluster.wait_converged(database, timeout=60)
        await assert_identical(cluster, [DATABASE, OTHER, LATER])
        # The blob came back with the backup, not from a peer (the ledger reads it on a below).
        assert (a.dir / "data" / precious["blobs"][0]["path"]).is_file()
        for book in (ledger, other, later):
            await book.check()
        assert a.events("foreign_origin_refused") == []
    finally:
        await cluster.close()
