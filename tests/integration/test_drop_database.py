"""Deleting a database cluster-wide (`DELETE /databases/{name}`, `replicator delete-database`) on real processes.

The file goes from every node, with its sessions, pairs and status; the other databases are untouched. A node that
was down during the deletion removes the database when it comes back, and its peers' subscriptions to it create
nothing meanwhile. Writing to the database again after the deletion makes it exist again, everywhere, holding only
what was written after it.
"""

from __future__ import annotations

import asyncio
import subprocess
from typing import Any

import pytest

from replicator.coordinator.local_cluster import LocalCluster
from tests.integration.conftest import FAST, assert_identical, assert_log_is_json, cli, wait_for, write_many


async def _removed(cluster: LocalCluster, name: str, database: str, *, pairs: bool = True) -> bool:
    """Is `database` gone from node `name`: no file, not held, no digest, and (with `pairs`) no pair for it?"""
    data = cluster[name].dir / "data"
    if any(path.name.startswith(f"{database}.sqlite") for path in data.iterdir()):
        return False
    status, body = await cluster.admin(name, "/status")
    if status != 200 or database in body["holds"]:
        return False
    if pairs and any(d["database"] == database for c in body["connections"] for d in c["databases"]):
        return False
    return (await cluster.admin(name, f"/digest/{database}"))[0] == 404


async def _all_removed(cluster: LocalCluster, database: str, names: list[str], *, pairs: bool = True) -> bool:
    for name in names:
        if not await _removed(cluster, name, database, pairs=pairs):
            return False
    return True


def _removals(cluster: LocalCluster, name: str, database: str) -> list[dict[str, Any]]:
    return [e for e in cluster[name].events("database_dropped") if e["database"] == database and e["removed"]]


async def _write_everywhere(cluster: LocalCluster, database: str, count: int) -> None:
    for name in cluster.nodes:
        await write_many(cluster, name, database, "t", [f"{name}{i}" for i in range(count)], {"from": name})
    await cluster.wait_converged(database, expect_count=count * len(cluster.nodes))


@pytest.mark.timeout(240)
async def test_a_deleted_database_leaves_every_node_and_can_be_written_again(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(["a", "b", "c"], workers=2, replication=dict(FAST))
    names = ["a", "b", "c"]
    cluster.start()
    try:
        await cluster.wait_ready()
        await _write_everywhere(cluster, "keep", 40)
        await _write_everywhere(cluster, "mistake", 30)
        keep_before = await cluster.digests("keep")

        status, body = await cluster.admin_request("b", "DELETE", "/databases/mistake")
        assert status == 200 and body["name"] == "mistake" and body["version"] > 0, body
        await wait_for(lambda: _all_removed(cluster, "mistake", names), 60, "mistake removed from every node")
        for name in names:
            (event,) = _removals(cluster, name, "mistake")
            assert event["floors"] == body["floors"] and sorted(body["floors"]) == names
        # Only the deleted database went: the other is what it was, and the same everywhere.
        assert await cluster.digests("keep") == keep_before
        await assert_identical(cluster, ["keep"])
        # Deleting what is gone everywhere is not found.
        assert (await cluster.admin_request("a", "DELETE", "/databases/mistake"))[0] == 404

        # A node that is down while a database is deleted removes it when it comes back.
        await _write_everywhere(cluster, "typo", 20)
        cluster["c"].stop()
        status, body = await cluster.admin_request("a", "DELETE", "/databases/typo")
        assert status == 200, body
        floors = body["floors"]
        # a and b keep a pair with c while c's row still says it holds typo: the subscription creates no file.
        await wait_for(lambda: _all_removed(cluster, "typo", ["a", "b"], pairs=False), 60, "typo gone from a and b")
        cluster["c"].start()
        await cluster.wait_ready(["c"])
        await wait_for(lambda: _all_removed(cluster, "typo", names), 60, "typo removed from c, and no pair left")
        (event,) = _removals(cluster, "c", "typo")
        assert event["floors"] == floors and event["records_removed"] == 60
        for name in ("a", "b"):
            assert len(_removals(cluster, name, "typo")) == 1  # removed once: nothing made the file come back

        # Written to again after the deletion, the database exists again on every node, with only the new write.
        status, written = await cluster.data("c", "PUT", "/data/typo/t/again", {"v": 2})
        assert status == 200 and written["version"] > floors["c"]
        await cluster.wait_converged("typo", expect_count=1)
        await assert_identical(cluster, ["typo", "keep"])
        for name in names:
            assert (await cluster.data(name, "GET", "/data/typo/t/a0"))[0] == 404
            status, record = await cluster.data(name, "GET", "/data/typo/t/again")
            assert status == 200 and record["version"] == written["version"]
            assert len(_removals(cluster, name, "typo")) == 1
        for name in names:
            assert_log_is_json(cluster[name])
    finally:
        await cluster.close()


def _delete_database(*args: str) -> subprocess.CompletedProcess[str]:
    return cli("delete-database", *args)


@pytest.mark.timeout(180)
async def test_delete_database_command_and_refusals(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(["a", "b"], workers=1, replication=dict(FAST))
    cluster.start()
    admin, config = cluster["a"].admin_url, str(cluster["a"].config_path)
    try:
        await cluster.wait_ready()
        cases = [
            ("system", 400, "cannot be deleted"),
            ("bad.name", 400, "bad database name"),
            ("x" * 65, 400, "bad database name"),
            ("never_made", 404, "no database 'never_made'"),
        ]
        for name, code, reason in cases:
            status, body = await cluster.admin_request("a", "DELETE", f"/databases/{name}")
            assert (status, reason in body.get("error", "")) == (code, True), (name, status, body)

        await write_many(cluster, "b", "oops", "t", ["x", "y"], 1)
        await cluster.wait_converged("oops", expect_count=2)
        done = await asyncio.to_thread(_delete_database, "--admin", admin, "oops", "--config", config)
        assert done.returncode == 0, done.stderr
        assert "deleted database oops" in done.stdout
        await wait_for(lambda: _all_removed(cluster, "oops", ["a", "b"]), 60, "oops removed from a and b")

        # Deleting it again, once written to again, writes a marker whose floors cover the new write.
        first = _removals(cluster, "a", "oops")[0]["floors"]
        await write_many(cluster, "a", "oops", "t", ["z"], 2)
        await cluster.wait_converged("oops", expect_count=1)
        status, z = await cluster.data("b", "GET", "/data/oops/t/z")
        assert status == 200, z
        status, body = await cluster.admin_request("b", "DELETE", "/databases/oops")
        assert status == 200 and body["floors"]["a"] == z["version"] > first.get("a", 0), (body, first)
        await wait_for(lambda: _all_removed(cluster, "oops", ["a", "b"]), 60, "oops removed again")

        # The admin token, given on the command line this time; as one argument, since a random token may start
        # with "-", which argparse would take for an option.
        token = (f"--token={cluster.admin_token}",)
        refused = await asyncio.to_thread(_delete_database, "--admin", admin, "never_made", *token)
        assert refused.returncode == 1 and "404" in refused.stderr and "no database 'never_made'" in refused.stderr
        for usage in (["--admin", admin, "system"], ["--admin", admin, "bad.name"], ["oops"]):
            result = await asyncio.to_thread(_delete_database, *usage)
            assert result.returncode == 2, (usage, result.stderr)
        unreachable = await asyncio.to_thread(_delete_database, "--admin", "http://127.0.0.1:9", "oops")
        assert unreachable.returncode == 1 and "cannot reach" in unreachable.stderr
        for name in ("a", "b"):
            assert_log_is_json(cluster[name])
    finally:
        await cluster.close()
