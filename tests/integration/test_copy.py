"""A new node's copy of a 200,000-record database survives a SIGKILL of the sender and, separately, of the receiving
worker: it resumes where its durable position is and receives again at most one batch it already held (the resumed
session's received minus applied, from `/status`), applies every record exactly once (one audit entry each), shows
its progress in `/status` while it runs, and the digests end equal.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
from collections.abc import Callable
from typing import Any

from replicator.coordinator.local_cluster import LocalCluster
from tests.integration.conftest import FAST, assert_log_is_json, wait_for

DATABASE = "bulk"
RECORDS = 200_000
BATCH = 500  # replication.batch_size (default)
CHUNK = 5_000  # records per data API request (aiohttp warns about bodies past 1 MiB)


async def _source_with_b_down(cluster: LocalCluster) -> None:
    """a holds the database and b, which a has heard from, is down. a never held the database before: its file
    has no earlier history to recover, and counts its own writes complete from the first one (`shared.own_writes`)."""
    cluster.start()
    await cluster.wait_ready()
    await cluster.wait_converged("system", timeout=30)
    assert cluster["b"].stop() == 0
    await _fill(cluster, "a")
    _, status = await cluster.admin("a", "/status")
    assert DATABASE not in status["recovery"], status["recovery"]


async def _fill(cluster: LocalCluster, name: str) -> None:
    for start in range(0, RECORDS, CHUNK):
        records = [{"id": f"r{i:07d}", "value": {"n": i, "pad": "x" * 60}} for i in range(start, start + CHUNK)]
        status, body = await cluster.data(name, "POST", f"/data/{DATABASE}/t", records)
        assert status == 200, body


async def _copy(cluster: LocalCluster, name: str, peer: str) -> dict[str, Any] | None:
    _, status = await cluster.admin(name, "/status")
    for connection in status["connections"]:
        if connection["peer"] == peer:
            for pair in connection["databases"]:
                if pair["database"] == DATABASE:
                    return pair.get("copy")
    return None


async def _midway(cluster: LocalCluster) -> dict[str, Any]:
    async def midway() -> dict[str, Any] | None:
        copy = await _copy(cluster, "b", "a")
        return copy if copy and 20_000 <= copy["records"] < RECORDS - 40_000 else None

    copy = await wait_for(midway, 60, "b's copy of bulk to be under way", interval=0.02)
    assert copy["total"] == RECORDS and copy["rate"] > 0 and copy["eta_s"] is not None, copy
    return copy


async def _resent(cluster: LocalCluster) -> int:
    """Records b's current session received that it already held, from the session's own figures, which the
    worker reports exactly when the session reaches caught up. Each batch is applied with its position, so only
    a batch that was cut short (split over frames) can come again."""

    async def settled() -> dict[str, int] | None:
        _, status = await cluster.admin("b", "/status")
        for connection in status["connections"]:
            for pair in connection["databases"]:
                if connection["peer"] == "a" and pair["database"] == DATABASE and pair["caught_up"]:
                    return pair["session_records"]
        return None

    figures = await wait_for(settled, 30, "b's session with a to report caught up")
    assert figures["applied"] > 0, figures  # the resumed session did part of the copy
    return figures["received"] - figures["applied"]


def _applied_from_the_audit(cluster: LocalCluster) -> int:
    """How many of a's records b's file took: one audit entry per record applied (a record received again is an
    identity tie, skipped without one), so every record was applied exactly once when this is RECORDS."""
    path = cluster["b"].dir / "data" / f"{DATABASE}.sqlite"
    with contextlib.closing(sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)) as conn:
        return int(conn.execute("SELECT count(*) FROM audit WHERE origin = 'a' AND tbl = 't'").fetchone()[0])


async def test_a_copy_resumes_after_the_sender_is_killed(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(["a", "b"], workers=1, replication=dict(FAST))
    await _source_with_b_down(cluster)
    cluster["b"].start()
    try:
        await cluster.wait_ready(["b"])
        await _midway(cluster)
        cluster["a"].kill()
        cluster["a"].start()
        await cluster.wait_ready(["a"])
        await cluster.wait_converged(DATABASE, timeout=180, expect_count=RECORDS)
        assert await _copy(cluster, "b", "a") is None  # caught up: no copy in progress
        resent = await _resent(cluster)
        assert 0 <= resent <= BATCH, resent
        assert _applied_from_the_audit(cluster) == RECORDS
    finally:
        await cluster.close()
    assert_log_is_json(cluster["b"])


async def test_a_copy_resumes_after_the_receiving_worker_is_killed(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(["a", "b"], workers=1, replication=dict(FAST))
    await _source_with_b_down(cluster)
    cluster["b"].start()
    try:
        await cluster.wait_ready(["b"])
        await _midway(cluster)
        _, status = await cluster.admin("b", "/status")
        (pid,) = [worker["pid"] for worker in status["workers"]]
        os.kill(pid, signal.SIGKILL)
        await wait_for(
            lambda: [e for e in cluster["b"].events("worker_exited") if e["pid"] == pid], 30, "b to see its worker die"
        )
        await cluster.wait_converged(DATABASE, timeout=180, expect_count=RECORDS)
        assert 0 <= await _resent(cluster) <= BATCH
        assert _applied_from_the_audit(cluster) == RECORDS
    finally:
        await cluster.close()
    assert_log_is_json(cluster["b"])
