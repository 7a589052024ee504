"""Links with real processes (issue 23): the databases of two nodes travel over one TLS connection per (peer,
worker) and direction, not one per database; a restart opens the links again and every database comes back; the
data converges on every node with every acknowledged write."""

from __future__ import annotations

import time
from typing import Any

import psutil
import pytest

from tests.integration.conftest import assert_identical, connected_pairs, wait_for, write_each

DATABASES = [f"db{i:02d}" for i in range(20)]
PAIRS = len(DATABASES) + 1  # and the system database


async def _dialled(cluster: Any, name: str, other: str) -> dict[int, int]:
    """Established TCP connections from each of `name`'s workers to `other`'s node port."""
    _, body = await cluster.admin(name, "/status")
    port = cluster[other].port
    counts = {}
    for worker in body["workers"]:
        connections = psutil.Process(worker["pid"]).net_connections(kind="tcp")
        counts[worker["id"]] = sum(
            1 for c in connections if c.status == psutil.CONN_ESTABLISHED and c.raddr and c.raddr.port == port
        )
    return counts


@pytest.mark.timeout(300)
async def test_twenty_databases_travel_over_one_connection_per_worker_and_direction(
    make_cluster,  # type: ignore[no-untyped-def]
) -> None:
    cluster = make_cluster(["a", "b"], workers=2)
    cluster.start()
    try:
        await cluster.wait_ready()
        await write_each(cluster, ["a", "b"], DATABASES, "before")
        for name, other in (("a", "b"), ("b", "a")):
            pairs = await wait_for(
                lambda n=name, o=other: connected_pairs(cluster, n, o, PAIRS), 90, f"{name}'s pairs up"
            )
            assert sorted({p["worker"] for p in pairs}) == [0, 1], pairs  # placed over both workers
            # One link per worker that holds pairs with the peer (a per-pair socket each would be 21 in all), and
            # at most one more connection per worker for the anti-entropy and blob requests over HTTPS.
            dialled = await _dialled(cluster, name, other)
            assert all(1 <= count <= 2 for count in dialled.values()), dialled
            opened = [e for e in cluster[name].events("connection_opened") if e["peer"] == other]
            assert 2 <= len(opened) < PAIRS, opened

        restarted_at = time.time()
        cluster["b"].stop()
        cluster["b"].start()
        await cluster.wait_ready(["b"])
        for name, other in (("a", "b"), ("b", "a")):
            await wait_for(lambda n=name, o=other: connected_pairs(cluster, n, o, PAIRS), 90, f"{name}'s pairs back")
        reopened = [e for e in cluster["b"].events("connection_opened") if e["ts"] > restarted_at]
        assert {e["worker"] for e in reopened} == {0, 1} and len(reopened) < PAIRS, reopened

        await write_each(cluster, ["a", "b"], DATABASES, "after")
        for database in DATABASES:
            await cluster.wait_converged(database, timeout=90, expect_count=4)
        await assert_identical(cluster, DATABASES)
    finally:
        await cluster.close()
