"""What a certificate holder's registry rows, and a client, can make a node take on (issue 21).

Introductions of nodes that do not exist: past the caps (`membership.MAX_PENDING_PER_INTRODUCER`,
`MAX_PENDING_INTRODUCTIONS`) they are refused, whether a peer's stream or the admin port's `PUT /nodes` brings them;
the coordinator answers throughout, and the log grows with the caps, not with the square of the rows. Databases: a
peer's row naming 1,500 of them makes the node hold no more than `data.max_databases`, and creates racing on two
workers stop exactly at the limit. Every test ends with the node serving, its workers' pids unchanged and its log
JSON lines.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from replicator.coordinator.local_cluster import LocalCluster, free_ports
from replicator.shared import membership, wire
from replicator.shared.logs import LOGGED_NAMES
from replicator.shared.store import NodeRow
from replicator.shared.tls import issue_node_cert
from tests.integration.conftest import FAST, Unharmed, assert_log_is_json, wait_for
from tests.integration.test_hostile_peer import FakePeer

GHOSTS = 3000
# What one pending introduction may cost the log while a test runs: the lines of its pair being set up, dialled
# (a closed port: refused at once) and redialled on the backoff schedule, each a few hundred bytes.
BYTES_PER_GHOST = 16 * 1024
# Everything else in a test's window: the sessions of the real peers, sampled warnings and their suppressed counts.
BASE_BYTES = 512 * 1024


def _ghost_url(index: int, port: int) -> str:
    """A URL of its own for each ghost (a node is one connection per URL), on loopback where nothing listens."""
    return f"wss://127.1.{index // 250}.{index % 250 + 1}:{port}"


async def _worker_pids(cluster: LocalCluster, name: str) -> list[int]:
    _, status = await cluster.admin(name, "/status")
    return [worker["pid"] for worker in status["workers"]]


async def _ends_serving(cluster: LocalCluster, name: str, pids: list[int], database: str = "alive") -> None:
    stamp = time.time()
    status, body = await cluster.data(name, "PUT", f"/data/{database}/t/check", {"at": stamp})
    assert status == 200, (status, body)
    status, body = await cluster.data(name, "GET", f"/data/{database}/t/check")
    assert status == 200 and body["value"] == {"at": stamp}, (status, body)
    assert await _worker_pids(cluster, name) == pids
    assert_log_is_json(cluster[name])


class Poller:
    """Asks a node's /status and /nodes over and over while something else goes on; every answer must come (the
    cluster's HTTP session gives each request 30 s before it counts as not answered)."""

    def __init__(self, cluster: LocalCluster, name: str) -> None:
        self.cluster = cluster
        self.name = name
        self.answers: list[int] = []
        self.failures: list[str] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            for path in ("/status", "/nodes"):
                try:
                    status, _ = await self.cluster.admin(self.name, path)
                    self.answers.append(status)
                except (TimeoutError, OSError, ValueError) as exc:
                    self.failures.append(f"{path}: {exc!r}")
            await asyncio.sleep(0.2)


def _route_lines_are_capped(cluster: LocalCluster, name: str) -> None:
    for line in cluster[name].events("route_changed"):
        assert "exclude" not in line, line
        assert max(len(line["added"]), len(line["removed"]), len(line["peers"])) <= LOGGED_NAMES, line
    for line in cluster[name].events("session_connected"):
        assert len(line["exclude"]) <= LOGGED_NAMES and line["excluded"] >= len(line["exclude"]), line


@pytest.fixture
async def pair(make_cluster: Callable[..., LocalCluster], tmp_path: Path) -> AsyncIterator[tuple[LocalCluster, Path]]:
    cluster = make_cluster(["a", "b"], workers=2, replication=dict(FAST))
    cluster.start()
    await cluster.wait_ready()
    issue_node_cert(cluster.dir / "ca", "mallet", ["127.0.0.1"], tmp_path / "mallet")
    try:
        yield cluster, tmp_path / "mallet"
    finally:
        await cluster.close()


@pytest.mark.timeout(300)
async def test_thousands_of_introductions_are_capped_and_the_coordinator_answers_throughout(
    pair: tuple[LocalCluster, Path],
) -> None:
    cluster, folder = pair
    mallet = membership.Signer.load("mallet", folder / "mallet.pem", folder / "mallet.key")
    unharmed = await Unharmed.of(cluster, "a")
    closed = free_ports(1)[0]  # nothing listens there: every ghost's dial is refused
    now = int(time.time() * 1_000_000)
    ghosts = [
        membership.signed_entry(
            mallet,
            membership.INTRODUCTIONS,
            NodeRow(name=f"ghost{i:04d}", url=_ghost_url(i, closed), replicates=True),
            now + i,
        )
        for i in range(GHOSTS)
    ]

    async def flood(ws: Any, subscribe: wire.Subscribe) -> None:
        await ws.send_bytes(wire.encode(wire.Schema(database=subscribe.database, epoch="x", head_seq=1)))
        if subscribe.database == "system":
            own = NodeRow(name="mallet", url=peer.url, replicates=True)
            entries = [*ghosts, membership.signed_entry(mallet, membership.NODES, own, now + GHOSTS)]
            for start in range(0, len(entries), 500):
                chunk = entries[start : start + 500]
                last = start + 500 >= len(entries)
                batch = wire.Batch(entries=chunk, marks={"mallet": chunk[-1].version}, head_seq=1, caught_up=last)
                await ws.send_bytes(wire.encode(batch))
        else:
            await ws.send_bytes(wire.encode(wire.Batch(entries=[], head_seq=1, caught_up=True)))
        while not ws.closed:
            await ws.receive(timeout=60)

    peer = FakePeer(cluster, folder, flood)
    await peer.start()
    poller = Poller(cluster, "a")
    log_before = cluster["a"].log_path.stat().st_size
    try:
        poller.start()
        status, body = await cluster.admin_request("a", "PUT", "/nodes/mallet", {"url": peer.url, "replicates": True})
        assert status == 200, body

        async def capped() -> list[str] | None:
            _, nodes = await cluster.admin("a", "/nodes")
            found = [item["name"] for item in nodes if item.get("source") == "introduced by mallet"]
            own = any(item["name"] == "mallet" and item.get("source") == "own" for item in nodes)
            refused = cluster["a"].events("registry_row_refused")
            return found if own and len(found) >= membership.MAX_PENDING_PER_INTRODUCER and refused else None

        found = await wait_for(capped, 120, "a to take mallet's own row and refuse its introductions past the cap")
        assert sorted(found) == [f"ghost{i:04d}" for i in range(membership.MAX_PENDING_PER_INTRODUCER)]

        async def refused_counted() -> bool:
            counted = _sample(await _metrics(cluster, "a"), 'replicator_registry_rows_refused_total{peer="mallet"}')
            return counted >= GHOSTS - membership.MAX_PENDING_PER_INTRODUCER

        await wait_for(refused_counted, 60, "a to count every introduction it refused")
        # The ghosts a took are dialled, routed and failed over like any link that never comes up.
        await wait_for(lambda: _failed_over(cluster, "a", found), 60, "the ghosts' links to fail over")
    finally:
        await poller.stop()
    assert poller.failures == [] and len(poller.answers) >= 20, (poller.failures, len(poller.answers))
    assert set(poller.answers) == {200}
    grown = cluster["a"].log_path.stat().st_size - log_before
    bound = membership.MAX_PENDING_PER_INTRODUCER * BYTES_PER_GHOST + BASE_BYTES
    assert grown <= bound, (grown, bound)
    refusals = [e for e in cluster["a"].events("registry_row_refused") if e["peer"] == "mallet"]
    # Sampled per peer and cap: a few lines for thousands of rows, the rest counted.
    assert 0 < len(refusals) <= 40 and {e.get("limit") for e in refusals} == {membership.PER_INTRODUCER}

    def suppressed() -> list[dict[str, Any]]:
        return [e for e in cluster["a"].events("log_events_suppressed") if e["of"] == "registry_row_refused"]

    await wait_for(suppressed, 60, "a to report how many refusals it did not write")
    _route_lines_are_capped(cluster, "a")
    try:
        await _ends_serving(cluster, "a", list(unharmed.rss))
        await unharmed.check()
        await cluster.wait_converged("alive", ["a", "b"], timeout=60, expect_count=2)
    finally:
        await peer.close()
    assert_log_is_json(cluster["b"])


async def _metrics(cluster: LocalCluster, name: str) -> str:
    async with cluster.http.get(cluster[name].admin_url + "/metrics", headers=cluster[name].admin_headers) as response:
        return await response.text()


def _sample(metrics: str, series: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


async def _failed_over(cluster: LocalCluster, name: str, origins: list[str]) -> bool:
    _, status = await cluster.admin(name, "/status")
    return set(origins) <= set(status["failed_over"].get("system", []))


async def test_put_nodes_past_the_caps_is_refused_and_the_log_stays_small(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = make_cluster(["a"], workers=2)
    cluster.start()
    await cluster.wait_ready()
    try:
        unharmed = await Unharmed.of(cluster, "a")
        closed = free_ports(1)[0]
        log_before = cluster["a"].log_path.stat().st_size
        answers: list[int] = []
        for i in range(400):
            status, body = await cluster.admin_request(
                "a", "PUT", f"/nodes/ghost{i:03d}", {"url": _ghost_url(i, closed), "replicates": True}
            )
            answers.append(status)
            if status != 200:
                assert status == 409 and body["limit"] == membership.PER_INTRODUCER, (status, body)
                assert f"the most one node may ({membership.MAX_PENDING_PER_INTRODUCER})" in body["error"], body
            if i % 20 == 0:
                assert (await cluster.admin("a", "/status"))[0] == 200
        per = membership.MAX_PENDING_PER_INTRODUCER
        assert answers == [200] * per + [409] * (400 - per)
        # Rewriting an introduction it holds, and removing one to make room, still work.
        status, _ = await cluster.admin_request("a", "PUT", "/nodes/ghost000", {"url": _ghost_url(0, closed)})
        assert status == 200
        assert (await cluster.admin_request("a", "DELETE", "/nodes/ghost001"))[0] == 200
        status, _ = await cluster.admin_request("a", "PUT", "/nodes/late", {"url": _ghost_url(999, closed)})
        assert status == 200
        _, nodes = await cluster.admin("a", "/nodes")
        introduced = [item["name"] for item in nodes if item.get("source") == "introduced by a"]
        assert len(introduced) == per
        await wait_for(lambda: _failed_over(cluster, "a", introduced), 60, "the ghosts' links to fail over")
        grown = cluster["a"].log_path.stat().st_size - log_before
        bound = per * BYTES_PER_GHOST + BASE_BYTES
        assert grown <= bound, (grown, bound)
        _route_lines_are_capped(cluster, "a")
        await _ends_serving(cluster, "a", list(unharmed.rss))
        await unharmed.check()
    finally:
        await cluster.close()


@pytest.mark.timeout(240)
async def test_a_peer_row_naming_1500_databases_gets_at_most_the_limit(
    make_cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    cluster = make_cluster(["a"], workers=2)
    cluster["a"].extra["data"] = {"max_databases": 50}
    cluster.start()
    await cluster.wait_ready()
    issue_node_cert(cluster.dir / "ca", "mallet", ["127.0.0.1"], tmp_path / "mallet")
    folder = tmp_path / "mallet"
    mallet = membership.Signer.load("mallet", folder / "mallet.pem", folder / "mallet.key")
    names = [f"claimed{i:04d}" for i in range(1500)]
    now = int(time.time() * 1_000_000)

    async def claim(ws: Any, subscribe: wire.Subscribe) -> None:
        await ws.send_bytes(wire.encode(wire.Schema(database=subscribe.database, epoch="x", head_seq=1)))
        if subscribe.database == "system":
            own = NodeRow(name="mallet", url=peer.url, replicates=True, holds=names)
            entry = membership.signed_entry(mallet, membership.NODES, own, now)
            batch = wire.Batch(entries=[entry], marks={"mallet": now}, head_seq=1, caught_up=True)
        else:
            batch = wire.Batch(entries=[], head_seq=1, caught_up=True)
        await ws.send_bytes(wire.encode(batch))
        while not ws.closed:
            await ws.receive(timeout=60)

    peer = FakePeer(cluster, folder, claim)
    await peer.start()
    data = cluster["a"].dir / "data"

    def held() -> list[str]:
        return sorted(path.stem for path in data.glob("*.sqlite") if path.stem != "system")

    try:
        pids = await _worker_pids(cluster, "a")
        status, body = await cluster.admin_request("a", "PUT", "/nodes/mallet", {"url": peer.url, "replicates": True})
        assert status == 200, body

        async def full() -> bool:
            return len(held()) >= 50

        await wait_for(full, 120, "a to create the databases it has room for")
        _, status = await cluster.admin("a", "/status")
        (connection,) = [c for c in status["connections"] if c["peer"] == "mallet"]
        assert len(connection["databases"]) == 51  # system and 50 of mallet's
        over = status["databases_over_limit"]
        assert (over["limit"], over["taken"], over["count"]) == (50, 50, 1450), over
        (warned,) = {e["left_out"] for e in cluster["a"].events("database_limit_reached")}
        assert warned == 1450
        assert "replicator_databases_over_limit 1450.0" in await _metrics(cluster, "a")
        # A client gets the clear error, and a is still serving what it holds.
        status, body = await cluster.data("a", "PUT", "/data/one_more/t/x", 1)
        assert status == 409 and "data.max_databases = 50" in body["error"], (status, body)
        assert held() == sorted(names[:50])
        status, body = await cluster.data("a", "PUT", f"/data/{names[0]}/t/check", {"ok": 1})
        assert status == 200, body
        assert len(held()) == 50
        assert await _worker_pids(cluster, "a") == pids
        assert_log_is_json(cluster["a"])
    finally:
        await peer.close()
        await cluster.close()


async def test_concurrent_creates_over_two_workers_stop_exactly_at_the_limit(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = make_cluster(["a"], workers=2)
    cluster["a"].extra["data"] = {"max_databases": 20}
    cluster.start()
    await cluster.wait_ready()
    try:
        pids = await _worker_pids(cluster, "a")
        results = await asyncio.gather(*(cluster.data("a", "PUT", f"/data/racing{i:02d}/t/x", i) for i in range(60)))
        statuses = sorted(status for status, _ in results)
        assert statuses == [200] * 20 + [409] * 40, statuses
        for status, body in results:
            if status == 409:
                assert "data.max_databases = 20" in body["error"], body
        data = cluster["a"].dir / "data"
        assert len([path for path in data.glob("racing*.sqlite")]) == 20
        # Every worker answers the same from now on, and the databases held still take writes.
        for _ in range(4):
            status, body = await cluster.data("a", "PUT", "/data/racing_late/t/x", 1)
            assert status == 409 and "data.max_databases = 20" in body["error"], (status, body)
        created = [i for i, (status, _) in enumerate(results) if status == 200]
        status, body = await cluster.data("a", "PUT", f"/data/racing{created[0]:02d}/t/y", "more")
        assert status == 200, body
        assert await _worker_pids(cluster, "a") == pids
        assert_log_is_json(cluster["a"])
    finally:
        await cluster.close()
