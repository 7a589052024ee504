"""`replicator backup` of a node under writes and `replicator restore` onto its wiped data directory, on real
processes: the restored node converges with its peers, every acknowledged write is there (those made after the backup
come back from the peers, its own included), no deleted record comes back, and a database made after the backup is
taken back too. A node restored while its peers are down, which takes writes before they return, gets its newer own
writes back and reasserts none of the backup's older values over them: what the restore's marking is for. A backup
too old for `tombstone_retention`, or a node still running, is refused with the reason."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

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
    ledger = Ledger(cluster, DATABASE, every_write=True)
    other = Ledger(cluster, OTHER, every_write=True)
    later = Ledger(cluster, LATER, every_write=True)
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


@pytest.mark.timeout(300)
async def test_a_node_restored_while_its_peers_are_down_takes_its_newer_own_writes_back_and_reasserts_none(  # type: ignore[no-untyped-def]
    make_cluster, tmp_path: Path
) -> None:
    """The marking at work (`store.mark_restored`, `own_writes.restore`): a is restored and starts while b and c,
    which hold its own writes made after the backup, are down, and takes writes, so its newest own version is past
    every claim of theirs before any peer could show its file gone back in time. Marked, the files recover: every
    pair must serve a's own writes back, and a round takes a peer's newer own version for one a may have written.
    A file restored without the mark looks intact: its subscriptions ask for none of its own writes, and its rounds
    find the peers' newer versions of its own records below its newest own write with no local write of them in its
    audit log ("never written") and reassert the backup's older values over them, which then spread. With
    `own_writes.mark_restored` a no-op this test fails so, in `ledger.check` (`every_write`): a-0, a-1 and a-2
    "written again as" their backup values and a-3 live again, on every node, the digests equal (a check by
    versions alone takes those for later writes)."""
    cluster = make_cluster(["a", "b", "c"], workers=1, replication={**FAST, "failover_after": 2.0})
    cluster.start()
    ledger = Ledger(cluster, DATABASE, every_write=True)
    a = cluster["a"]
    token = {"REPLICATOR_ADMIN_TOKEN": a.admin_token} if a.admin_token else {}
    try:
        await cluster.wait_ready()
        for name in cluster.nodes:
            for i in range(8):
                await ledger.put(name, f"{name}-{i}", {"by": name, "i": i})
        await cluster.wait_converged(DATABASE, timeout=60, expect_count=24)
        out = tmp_path / "backup"
        code, _, stderr = await _cli("backup", "--admin", a.admin_url, "--out", str(out), env=token)
        assert code == 0, stderr

        # After the backup, on a: updates and a delete of its own records, and new ones; b and c take them.
        for i in (0, 1, 2):
            await ledger.put("a", f"a-{i}", "updated on a after the backup")
        await ledger.delete("a", "a-3")
        for i in range(3):
            await ledger.put("a", f"a-new-{i}", "written on a after the backup")
        await cluster.wait_converged(DATABASE, timeout=90)

        assert a.stop() == 0
        shutil.rmtree(a.dir / "data")
        code, _, stderr = await _cli("restore", "--from", str(out), "--config", str(a.config_path))
        assert code == 0, stderr
        for name in ("b", "c"):
            assert cluster[name].stop() == 0
        recovered_before = len(a.events("database_recovered"))
        a.start()
        await cluster.wait_ready(["a"])
        # Alone, a takes writes: an update of one of its own records the backup holds, and a new record.
        await ledger.put("a", "a-4", "updated on a after the restore")
        await ledger.put("a", "a-after", "written on a after the restore")
        _, body = await cluster.admin("a", "/status")
        alone = body["recovery"].get(DATABASE, {})

        for name in ("b", "c"):
            cluster[name].start()
        await cluster.wait_ready(["b", "c"])

        async def recovered() -> bool:
            _, body = await cluster.admin("a", "/status")
            return all(
                body["recovery"].get(database, {}).get("state", "recovered") == "recovered"
                for database in ("system", DATABASE)
            )

        await wait_for(recovered, 120, "a's recovery once b and c are back")
        await cluster.wait_settled(timeout=120)  # every pair connected: the rounds below run over each of them
        for name in cluster.nodes:
            status, body = await cluster.admin_request(name, "POST", f"/antientropy/{DATABASE}")
            assert status == 200, body
            assert all(result["error"] is None for result in body["rounds"]), body
        await cluster.wait_converged(DATABASE, timeout=120)
        await ledger.check()
        await assert_identical(cluster, [DATABASE])
        for name in cluster.nodes:
            assert cluster[name].events("foreign_origin_refused") == [], name
        # What held it: a's file started recovering, and waited for the peers that were down.
        assert alone.get("state") == "recovering" and set(alone.get("waiting_for", [])) == {"b", "c"}, alone
        again = {event["database"] for event in a.events("database_recovered")[recovered_before:]}
        assert again >= {"system", DATABASE}, again
    finally:
        await cluster.close()
