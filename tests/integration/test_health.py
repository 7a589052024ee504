"""Health that tells the truth: a node stopped and continued keeps its workers, a frozen peer shows as disconnected,
and a store that cannot write makes the node not ready, with the reason.

A whole node is stopped with SIGSTOP to its process group (the coordinator and its workers, as a frozen container or
a suspended host would be), and continued with SIGCONT. Every test ends with the nodes serving and every line of
their logs a JSON object.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from replicator.coordinator.local_cluster import LocalCluster, LocalNode
from tests.integration.conftest import FAST, assert_identical, assert_log_is_json, wait_for

DATABASE = "health"
HEARTBEAT_TIMEOUT = 3.0
FROZEN_PEER_DEADLINE = 15.0


@contextmanager
def stopped(node: LocalNode) -> Iterator[None]:
    """The node's whole process group is stopped inside the block and continued after it, whatever happens."""
    assert node.process is not None and node.running
    group = node.process.pid  # started with start_new_session: the coordinator leads its group
    os.killpg(group, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(group, signal.SIGCONT)


async def worker_pids(cluster: LocalCluster, name: str) -> dict[int, int]:
    status, body = await cluster.admin(name, "/status")
    assert status == 200, body
    return {worker["id"]: worker["pid"] for worker in body["workers"]}


async def metric(cluster: LocalCluster, name: str, series: str) -> float:
    async with cluster.http.get(cluster[name].admin_url + "/metrics", headers=cluster[name].admin_headers) as response:
        text = await response.text()
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(series + " ")]
    assert len(values) == 1, (series, values)
    return values[0]


async def assert_serving(cluster: LocalCluster, name: str, record: str) -> None:
    status, body = await cluster.data(name, "PUT", f"/data/{DATABASE}/t/{record}", {"by": name})
    assert status == 200, body
    status, body = await cluster.data(name, "GET", f"/data/{DATABASE}/t/{record}")
    assert status == 200 and body["value"] == {"by": name}, body
    status, body = await cluster.admin(name, "/readyz")
    assert status == 200 and body["ready"] is True, body
    assert_log_is_json(cluster[name])


# -- a whole node stopped --------------------------------------------------------------------------------------------


async def test_a_node_stopped_longer_than_the_heartbeat_timeout_keeps_its_workers(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(["a"], workers=2, replication={**FAST, "heartbeat_timeout": HEARTBEAT_TIMEOUT})
    a = cluster["a"]
    try:
        cluster.start()
        await cluster.wait_ready()
        await assert_serving(cluster, "a", "before")
        before = await worker_pids(cluster, "a")
        with stopped(a):
            # The stop is what is tested: it lasts three heartbeat timeouts (the reconcile pass runs every second).
            await asyncio.sleep(3 * HEARTBEAT_TIMEOUT)
        await wait_for(
            lambda: a.events("coordinator_paused") or a.events("worker_hung"),
            30,
            "the first reconcile pass after the stop",
        )
        assert a.events("worker_hung") == []
        paused = a.events("coordinator_paused")[0]["paused_s"]
        assert paused >= 2 * HEARTBEAT_TIMEOUT, paused
        # A kill would come from the pass that noticed the stop, or a heartbeat timeout after it if the workers did
        # not come back: watch that long.
        await asyncio.sleep(HEARTBEAT_TIMEOUT + 2 * FAST["reconcile_interval"])
        assert a.events("worker_hung") == []
        assert a.events("worker_exited") == []
        assert await worker_pids(cluster, "a") == before
        assert await metric(cluster, "a", "replicator_worker_restarts_total") == 0
        await assert_serving(cluster, "a", "after")
    finally:
        await cluster.close()


async def test_a_frozen_peer_is_disconnected_within_15_s_and_reconnects(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(["a", "b"], workers=2)
    b = cluster["b"]
    try:
        cluster.start()
        await cluster.wait_ready()
        await assert_serving(cluster, "a", "a-before")
        await assert_serving(cluster, "b", "b-before")
        await cluster.wait_connected(databases=[DATABASE])
        b_workers = await worker_pids(cluster, "b")

        async def pairs_to_b() -> list[dict]:
            _, body = await cluster.admin("a", "/status")
            return [d for c in body["connections"] if c["peer"] == "b" for d in c["databases"]]

        assert len(await pairs_to_b()) >= 2 and all(pair["connected"] for pair in await pairs_to_b())
        with stopped(b):
            frozen_at = time.monotonic()

            async def all_down() -> bool:
                return not any(pair["connected"] for pair in await pairs_to_b())

            await wait_for(all_down, FROZEN_PEER_DEADLINE, "a seeing every pair to the frozen b disconnected")
            took = time.monotonic() - frozen_at
            assert took < FROZEN_PEER_DEADLINE, took
            # a serves on while its peer is frozen.
            await assert_serving(cluster, "a", "a-during")
        await cluster.wait_connected(timeout=60, databases=[DATABASE])
        await cluster.wait_converged(DATABASE, timeout=60)
        assert await worker_pids(cluster, "b") == b_workers  # b's coordinator did not kill its own workers
        await assert_serving(cluster, "a", "a-after")
        await assert_serving(cluster, "b", "b-after")
        await cluster.wait_converged(DATABASE, timeout=60, expect_count=5)
        await assert_identical(cluster, [DATABASE])
    finally:
        await cluster.close()


# -- a store that cannot write ---------------------------------------------------------------------------------------


@contextmanager
def small_disk(directory: Path, size: str) -> Iterator[None]:
    """`directory` on a tmpfs of `size`; unmounted after the block (whose nodes must be stopped by then)."""
    directory.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        yield
    finally:
        # Workers leave just after their coordinator (parent-death signal): detach now, free when they are gone.
        subprocess.run(["umount", "-l", str(directory)], capture_output=True, check=False)


def fill(directory: Path) -> Path:
    """Write a file in `directory` until the disk is full; returns it."""
    filler = directory / "filler"
    chunk = bytes(1 << 20)
    with filler.open("wb", buffering=0) as file:
        try:
            while True:
                file.write(chunk)
        except OSError:
            pass
        try:
            while True:
                file.write(chunk[:4096])
        except OSError:
            pass
    return filler


async def readyz(cluster: LocalCluster, name: str) -> tuple[int, dict]:
    return await cluster.admin(name, "/readyz")


async def test_readyz_is_503_with_the_reason_while_the_disk_is_full(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(["a"], workers=1)
    a = cluster["a"]
    data = a.dir / "data"
    with small_disk(data, "24m"):
        try:
            cluster.start()
            await cluster.wait_ready()
            await assert_serving(cluster, "a", "before")
            filler = fill(data)

            async def not_ready() -> dict | None:
                status, body = await readyz(cluster, "a")
                return body if status == 503 else None

            body = await wait_for(not_ready, 30, "/readyz answering 503 on a full disk")
            assert body["ready"] is False
            assert any(
                reason.startswith("store cannot write: ") and "No space left on device" in reason
                for reason in body["reasons"]
            ), body
            assert a.events("store_cannot_write")
            assert (await cluster.admin("a", "/healthz"))[0] == 200  # alive, only not ready

            filler.unlink()

            async def ready() -> bool:
                return (await readyz(cluster, "a"))[0] == 200

            await wait_for(ready, 30, "/readyz answering 200 once the disk has room again")
            assert a.events("store_writable")
            await assert_serving(cluster, "a", "after")
        finally:
            await cluster.close()
            cluster.stop()


async def _session_of(cluster: LocalCluster, name: str, peer: str, database: str) -> dict | None:
    _, status = await cluster.admin(name, "/status")
    for connection in status["connections"]:
        for pair in connection["databases"]:
            if connection["peer"] == peer and pair["database"] == database:
                return pair
    return None


async def test_a_subscriber_on_a_full_disk_commits_again_in_the_same_session(make_cluster) -> None:  # type: ignore[no-untyped-def]
    """b's disk fills while a's records stream to it: each batch's commit (records and position together) fails,
    and is tried again on the flush schedule (0.25 s doubling to 30 s) in the same session; once there is room the
    batch commits, nothing was skipped, and the digests are equal."""
    cluster = make_cluster(["a", "b"], workers=1, replication=dict(FAST))
    data = cluster["b"].dir / "data"
    with small_disk(data, "24m"):
        try:
            cluster.start()
            await cluster.wait_ready()
            await assert_serving(cluster, "a", "before")
            await cluster.wait_converged(DATABASE, timeout=30, expect_count=1)
            before = await _session_of(cluster, "b", "a", DATABASE)
            assert before is not None and before["connected"]
            filler = fill(data)
            for start in range(0, 2000, 250):
                records = [{"id": f"r{i:04d}", "value": {"pad": "x" * 2000}} for i in range(start, start + 250)]
                status, body = await cluster.data("a", "POST", f"/data/{DATABASE}/t", records)
                assert status == 200, body
            await wait_for(
                lambda: [e for e in cluster["b"].events("commit_retry") if e["database"] == DATABASE],
                30,
                "b to retry a commit on its full disk",
            )
            filler.unlink()
            await cluster.wait_converged(DATABASE, timeout=60, expect_count=2001)
            after = await _session_of(cluster, "b", "a", DATABASE)
            assert after is not None and after["session"] == before["session"], (before, after)
            retries = [e for e in cluster["b"].events("commit_retry") if e["database"] == DATABASE]
            assert retries[0]["delay_s"] == pytest.approx(0.25, abs=0.25)
            assert all(e["delay_s"] <= 30.0 for e in retries)
            assert not [e for e in cluster["b"].events("session_disconnected") if e["database"] == DATABASE]
            await assert_identical(cluster, [DATABASE])
        finally:
            await cluster.close()
            cluster.stop()
    assert_log_is_json(cluster["b"])
