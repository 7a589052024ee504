"""Every database replicates however many there are: 500 databases created on one node all reach its peer.

Every pair to one peer sits on one worker, one WebSocket each, held for as long as the session runs; a pool of
connections capped at aiohttp's default (100) left every database past the 100th waiting forever (issue 7).
"""

from __future__ import annotations

import asyncio
import resource
from collections.abc import Iterator

import pytest

from replicator.coordinator.local_cluster import LocalCluster, poll_until

COUNT = 500
# Each node holds, per database, a SQLite file with its WAL and shared memory, and a session each way.
FDS_NEEDED = 8 * COUNT


@pytest.fixture
def fd_limit() -> Iterator[None]:
    """Raise the soft open-files limit for the nodes this test starts (they inherit it), and restore it after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < FDS_NEEDED:
        pytest.skip(f"the open-files hard limit {hard} is below the {FDS_NEEDED} this test needs")
    if soft != resource.RLIM_INFINITY and soft < FDS_NEEDED:
        resource.setrlimit(resource.RLIMIT_NOFILE, (FDS_NEEDED, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def _converged(cluster: LocalCluster, database: str) -> bool:
    digests = await cluster.digests(database, ["a", "b"])
    first = digests["a"]
    return first is not None and digests["b"] == first and sum(t["count"] for t in first.values()) == 1


@pytest.mark.timeout(180)
@pytest.mark.usefixtures("fd_limit")
async def test_500_databases_all_reach_the_peer(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(["a", "b"], workers=2)
    cluster.start()
    names = [f"db{i:03d}" for i in range(COUNT)]
    try:
        await cluster.wait_ready()
        gate = asyncio.Semaphore(32)

        async def create(name: str) -> int:
            async with gate:
                status, _ = await cluster.data("a", "PUT", f"/data/{name}/t/r", {"database": name})
                return status

        statuses = await asyncio.gather(*(create(name) for name in names))
        assert statuses == [200] * COUNT

        pending = set(names)

        async def check() -> tuple[bool, set[str]]:
            async with asyncio.TaskGroup() as group:
                checks = {name: group.create_task(_converged(cluster, name)) for name in sorted(pending)[:100]}
            pending.difference_update(name for name, task in checks.items() if task.result())
            return not pending, pending

        await poll_until(
            check,
            100,
            lambda left: f"{len(left)} of {COUNT} databases not on b with a's digest, e.g. {sorted(left)[:5]}",
            interval=0.5,
        )

        # b holds a pair to a for every database (and the system database), each on its own connected session.
        await cluster.wait_connected(["b"], timeout=45, databases=names)
        _, status_doc = await cluster.admin("b", "/status")
        pairs = [pair for c in status_doc["connections"] if c["peer"] == "a" for pair in c["databases"]]
        assert len(pairs) == COUNT + 1
    finally:
        await cluster.close()
