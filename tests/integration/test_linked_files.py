"""A database file that is a symbolic link is refused, never followed: the node boots and serves every other database,
answers a JSON 503 naming the file for that one, logs the refusal once per process (not once per request), and leaves
the link and the file it points at exactly as they were."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from replicator.coordinator.local_cluster import LocalCluster
from tests.integration.conftest import assert_identical, assert_log_is_json, wait_for, write_many

KEPT = "kept"
LINKED = "linked"
RECORDS = 100
WORKERS = 1


def snapshot(directory: Path) -> dict[str, str]:
    """Every entry of `directory` with what it is: a link's target, a file's sha256."""
    return {
        path.name: f"-> {os.readlink(path)}" if path.is_symlink() else hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.iterdir())
    }


async def worker_pids(cluster: LocalCluster, name: str) -> list[int]:
    status, body = await cluster.admin(name, "/status")
    assert status == 200, body
    return sorted(worker["pid"] for worker in body["workers"])


async def test_a_database_file_linked_outside_is_refused_and_the_rest_keeps_serving(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = make_cluster(["a", "b"], workers=WORKERS)
    node = cluster["a"]
    data = node.dir / "data"
    outside = cluster.dir / "outside"
    link = data / f"{LINKED}.sqlite"
    try:
        cluster.start()
        await cluster.wait_ready()
        for database in (KEPT, LINKED):
            await write_many(cluster, "a", database, "t", [f"r-{i:04d}" for i in range(RECORDS)], "x" * 100)
            await cluster.wait_converged(database, expect_count=RECORDS)
        kept_before = (await cluster.digests(KEPT, ["a"]))["a"]
        assert node.stop() == 0

        # The attack: the database's file moved out of the data directory, a link left in its place.
        outside.mkdir()
        shutil.move(link, outside / link.name)
        link.symlink_to(outside / link.name)
        before_outside, before_link = snapshot(outside), os.readlink(link)
        # Even where damaged files are moved aside, a refused one is not damaged: it stays where it is.
        node.extra["replication"] = {"recover_damaged": True}

        node.start()
        await cluster.wait_ready(["a"])
        pids = await worker_pids(cluster, "a")

        for _ in range(10):
            for method, path, body in (
                ("GET", f"/data/{LINKED}/t/r-0001", None),
                ("GET", f"/data/{LINKED}/t", None),
                ("PUT", f"/data/{LINKED}/t/new", {"v": 1}),
            ):
                status, answer = await cluster.data("a", method, path, body)
                assert status == 503, (method, path, status, answer)
                assert str(link) in answer["error"] and "symbolic link" in answer["error"], answer
        status, answer = await cluster.admin("a", f"/digest/{LINKED}")
        assert status == 503 and str(link) in answer["error"], answer

        # Everything else is served: the other database reads, takes writes and converges, its digest intact.
        assert (await cluster.digests(KEPT, ["a"]))["a"] == kept_before
        status, answer = await cluster.data("a", "GET", f"/data/{KEPT}/t/r-0042")
        assert status == 200 and answer["value"] == "x" * 100, answer
        status, answer = await cluster.data("a", "PUT", f"/data/{KEPT}/t/after", {"ok": True})
        assert status == 200, answer
        await cluster.wait_converged(KEPT, expect_count=RECORDS + 1)
        await assert_identical(cluster, [KEPT])
        assert await worker_pids(cluster, "a") == pids

        # One warning per process that met the file (the coordinator, each worker), however many requests.
        refusals = node.events("database_file_refused")
        assert 1 <= len(refusals) <= 1 + WORKERS, refusals
        assert {(r["level"], r["database"], r["path"]) for r in refusals} == {("warning", LINKED, str(link))}
        assert not node.events("database_moved_aside")

        # Nothing changed: the link, its target (no -wal or -shm beside it either), the data directory.
        assert link.is_symlink() and os.readlink(link) == before_link
        assert snapshot(outside) == before_outside
        assert not (data / "damaged").exists()
        assert_log_is_json(node)
    finally:
        await cluster.close()


async def test_a_system_database_that_is_a_link_is_a_boot_error_naming_it(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = make_cluster(["a"], workers=WORKERS)
    node = cluster["a"]
    link = node.dir / "data" / "system.sqlite"
    outside = cluster.dir / "outside"
    try:
        cluster.start()
        await cluster.wait_ready()
        assert node.stop() == 0
        outside.mkdir()
        shutil.move(link, outside / link.name)
        link.symlink_to(outside / link.name)
        before = snapshot(outside)

        node.start()
        process = node.process
        assert process is not None
        await wait_for(lambda: process.poll() is not None, 60, "a exits")
        assert process.returncode == 3  # the node cannot run without its system database
        failures = node.events("boot_failed")
        assert len(failures) == 1, failures
        assert f"database file {link} is a symbolic link" in failures[0]["reason"], failures
        assert link.is_symlink() and snapshot(outside) == before
        assert_log_is_json(node)
    finally:
        await cluster.close()
