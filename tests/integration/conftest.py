"""Fixtures for integration tests: real node processes on 127.0.0.1 with certificates made here.

Every cluster started through these fixtures is stopped at teardown, whatever the test did; a node that is still
running after SIGTERM is killed with its whole process group.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.local_cluster import LocalCluster, poll_until
from tests.integration.proxy import LinkProxy

# Short thresholds so that recovery paths run within a test's time; the defaults are the seed's values.
FAST = {"reconcile_interval": 1.0, "shutdown_timeout": 8.0}


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
    replication = {**FAST, "max_frame_bytes": 1024 * 1024}
    cluster = LocalCluster(tmp_path_factory.mktemp("mesh"), ["a", "b", "c"], workers=2, replication=replication)
    cluster.prepare()
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
async def mesh(mesh_cluster: LocalCluster) -> AsyncIterator[LocalCluster]:
    await mesh_cluster.wait_ready(timeout=60)
    await mesh_cluster.wait_connected(timeout=60)
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
