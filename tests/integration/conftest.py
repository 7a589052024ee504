"""Fixtures for integration tests: real node processes on 127.0.0.1 with certificates made here.

Every cluster started through these fixtures is stopped at teardown, whatever the test did; a node that is still
running after SIGTERM is killed with its whole process group.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from replicator.coordinator.local_cluster import LocalCluster, poll_until
from tests.integration.proxy import LinkProxy

# Short thresholds so that recovery paths run within a test's time; the defaults are the seed's values.
REPO = Path(__file__).resolve().parents[2]
FAST = {"reconcile_interval": 1.0, "shutdown_timeout": 8.0}


@pytest.fixture(autouse=True)
def _collect_garbage() -> Iterator[None]:
    """Collect after every test, so that a socket or transport a test left open is reported against that test
    (as an unraisable ResourceWarning) rather than whichever later test the collector happens to run in."""
    yield
    gc.collect()


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., LocalCluster]]:
    clusters: list[LocalCluster] = []

    def make(names: list[str], **options: Any) -> LocalCluster:
        options.setdefault("replication", dict(FAST))
        options.setdefault("proxy_factory", LinkProxy)
        cluster = LocalCluster(tmp_path / f"cluster{len(clusters)}", names, **options)
        # Registered before prepare() starts any proxy, so teardown closes whatever it started.
        clusters.append(cluster)
        cluster.prepare()
        return cluster

    yield make
    for cluster in clusters:
        cluster.stop()


@pytest.fixture(scope="module")
def mesh_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Three nodes x two workers in full mesh, shared by the tests of a module."""
    # An unknown certificate is refused after 2 s of looking for its registry row, not 30 (test_peer_input).
    replication = {**FAST, "max_frame_bytes": 1024 * 1024, "send_auth_budget": 2.0}
    cluster = LocalCluster(tmp_path_factory.mktemp("mesh"), ["a", "b", "c"], workers=2, replication=replication)
    cluster.prepare()
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
async def mesh(mesh_cluster: LocalCluster) -> AsyncIterator[LocalCluster]:
    await mesh_cluster.wait_ready(timeout=60)
    # Settled, not only connected: a test comparing sessions before and after must not see the renewal that ends
    # a boot's recovery of the system database.
    await mesh_cluster.wait_settled(timeout=60)
    yield mesh_cluster
    await mesh_cluster.close()


async def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll an async or sync predicate until it returns something truthy, or fail naming what was awaited."""

    async def check() -> tuple[bool, Any]:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        return bool(value), value

    try:
        return await poll_until(check, timeout, lambda _: what, interval)
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout} s waiting for {what}") from None


def equal_jitter_floor(attempt: int) -> float:
    """The least delay of a reconnect schedule's `attempt`-th draw (0-based) with `replication.reconnect_jitter =
    "equal"`: half its ceiling, which doubles from 0.5 s to 30 s, and never below the 0.5 s floor. A schedule that
    started over draws 0.5 s again, so each delay shows whether it grew."""
    return max(0.5, min(0.5 * 2**attempt, 30.0) / 2)


def log_records(node: Any) -> list[dict[str, Any]]:
    """Every line of a node's log (`LocalNode`), each of which must be a JSON object with an event: a traceback
    line would not be. A line that is not shows with the 40 lines from it."""
    lines = node.log_path.read_text(errors="replace").splitlines()
    records = []
    for index, line in enumerate(lines):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or "event" not in record:
            context = "\n".join(lines[index : index + 40])
            raise AssertionError(f"{node.log_path}:{index + 1} is not a JSON event:\n{context}")
        records.append(record)
    return records


def assert_log_is_json(node: Any) -> None:
    log_records(node)


# What an attack may leave a worker holding once it is over (allocator slack, SQLite's page cache, the buffers of the
# sessions that went on meanwhile): the issue-21 attacks grew a worker by hundreds of MB.
RSS_SLACK = 48 * 2**20


class Unharmed:
    """A node's workers before an attack, and the check at its end (issue 21): the node takes a write and reads it
    back, its workers are the same processes, each worker's memory comes back near where it started, and its log is
    JSON lines."""

    def __init__(self, cluster: LocalCluster, name: str, rss: dict[int, int]) -> None:
        self.cluster = cluster
        self.name = name
        self.rss = rss  # by worker pid, in bytes

    @classmethod
    async def of(cls, cluster: LocalCluster, name: str = "a") -> Unharmed:
        status, body = await cluster.admin(name, "/status")
        assert status == 200, body
        pids = [int(worker["pid"]) for worker in body["workers"]]
        return cls(cluster, name, {pid: psutil.Process(pid).memory_info().rss for pid in pids})

    async def check(self, database: str = "alive") -> None:
        cluster, name = self.cluster, self.name
        stamp = time.time()
        status, body = await cluster.data(name, "PUT", f"/data/{database}/t/unharmed", {"at": stamp})
        assert status == 200, (status, body)
        status, body = await cluster.data(name, "GET", f"/data/{database}/t/unharmed")
        assert status == 200 and body["value"] == {"at": stamp}, (status, body)
        _, now = await cluster.admin(name, "/status")
        assert sorted(int(worker["pid"]) for worker in now["workers"]) == sorted(self.rss), (now["workers"], self.rss)

        def grown() -> dict[int, int]:
            return {pid: psutil.Process(pid).memory_info().rss - before for pid, before in self.rss.items()}

        # Freed memory goes back to the system a moment after the work that held it (`shared.memory.Trimmer`).
        try:
            await wait_for(lambda: max(grown().values()) <= RSS_SLACK, 60, f"{name}'s workers' memory to come back")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: grown by {grown()} bytes, slack {RSS_SLACK}") from None
        assert_log_is_json(cluster[name])


def audit_duplicates(cluster: LocalCluster, name: str, database: str) -> list[tuple]:
    """Entries of the node's audit log for `database` that appear more than once as (table, id, version, origin)."""
    path = cluster[name].dir / "data" / f"{database}.sqlite"
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        return conn.execute(
            "SELECT tbl, id, version, origin, count(*) FROM audit GROUP BY tbl, id, version, origin HAVING count(*) > 1"
        ).fetchall()


async def assert_identical(cluster: LocalCluster, databases: list[str], names: list[str] | None = None) -> None:
    """The end of every data-plane test: equal digests on every node named, and no entry twice in any audit log."""
    names = names or list(cluster.nodes)
    for database in databases:
        digests = await cluster.digests(database, names)
        first = digests[names[0]]
        assert first is not None and all(digests[name] == first for name in names), (database, digests)
        for name in names:
            assert audit_duplicates(cluster, name, database) == [], (name, database)


async def write_each(cluster: LocalCluster, names: list[str], databases: list[str], tag: str) -> None:
    """On each node named, one record in each database: `t/NAME-TAG` = {"v": TAG}; fails the test on anything but
    200."""
    for name in names:
        for database in databases:
            status, body = await cluster.data(name, "PUT", f"/data/{database}/t/{name}-{tag}", {"v": tag})
            assert status == 200, (name, database, status, body)


async def connected_pairs(
    cluster: LocalCluster, name: str, other: str, count: int, *, with_session: bool = False
) -> list[dict[str, Any]] | None:
    """`name`'s pairs with `other` from /status once all `count` of them are connected (`with_session`: and each
    reports its session), else None: a predicate for `wait_for`."""
    _, body = await cluster.admin(name, "/status")
    for connection in body["connections"]:
        if connection["peer"] == other:
            pairs = connection["databases"]
            up = all(p["connected"] and (not with_session or p["session"] is not None) for p in pairs)
            if len(pairs) == count and up:
                return pairs
    return None


async def write_many(cluster: LocalCluster, name: str, database: str, table: str, ids: list[str], value: Any) -> None:
    """Write the records in one batch request; fails the test on anything but 200."""
    records = [{"id": record_id, "value": value} for record_id in ids]
    status, body = await cluster.data(name, "POST", f"/data/{database}/{table}", records)
    assert status == 200, (name, status, body)


def cli(
    *args: str, token: str | None = None, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """`replicator ARGS` in a process of its own, run from the checkout as an operator runs it. `token`: the admin
    token, given as REPLICATOR_ADMIN_TOKEN; without it, none of this environment's REPLICATOR_ADMIN_* reach it."""
    base = {key: value for key, value in os.environ.items() if not key.startswith("REPLICATOR_ADMIN")}
    if token is not None:
        base["REPLICATOR_ADMIN_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "replicator.coordinator.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**base, **(env or {})},
        check=False,
    )
