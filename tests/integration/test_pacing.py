"""Pacing with real processes: a setup storm stays bounded, a dead worker's pairs move on the stagger ladder, a dead
peer is redialled within the backoff's bounds."""

from __future__ import annotations

import asyncio
import itertools
import signal
import time

import psutil
import pytest

from replicator.coordinator.local_cluster import LocalCluster, free_ports
from tests.integration.conftest import connected_pairs, wait_for, write_each

GHOST = "wss://ghost.invalid:9"


def _rss(cluster: LocalCluster, name: str) -> int:
    process = psutil.Process(cluster[name].process.pid)  # type: ignore[union-attr]
    return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)])


@pytest.mark.timeout(180)
async def test_unresolvable_peer_and_a_node_update_storm_stay_bounded(make_cluster) -> None:  # type: ignore[no-untyped-def]
    # resolve = "hosts": the name fails to resolve at once and no DNS query leaves the machine.
    cluster = make_cluster(["a"], workers=1, replication={"shutdown_timeout": 8.0, "resolve": "hosts"})
    cluster["a"].outside_peers = {"ghost": GHOST}
    cluster.start()
    try:
        await cluster.wait_ready()
        # A few failed dials first, so the baseline includes what the failure path allocates once.
        await wait_for(lambda: len(cluster["a"].events("reconnect_scheduled")) >= 3, 30, "three failed dials")
        baseline = _rss(cluster, "a")
        started = time.time()
        # 1,000 node-update events for the peer, spread over a minute.
        for i in range(1000):
            status, _ = await cluster.admin_request("a", "PUT", "/nodes/ghost", {"url": GHOST, "replicates": False})
            assert status == 200
            delay = started + (i + 1) * 0.06 - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
        ended = time.time()
        grown = _rss(cluster, "a") - baseline
        armed = [
            e
            for e in cluster["a"].events("subscription_setup_armed")
            if e["peer"] == "ghost" and started <= e["ts"] <= ended
        ]
        # About 9 on average with random draws; the behaviour before the paced scheduler logged one per event.
        assert 1 <= len(armed) <= 20, len(armed)
        assert grown < 16 * 2**20, f"memory grew by {grown / 2**20:.1f} MiB"
        status, body = await cluster.admin("a", "/status")
        ghost = next(c for c in body["connections"] if c["peer"] == "ghost")
        assert not ghost["databases"][0]["connected"]
        assert "ghost.invalid" in (ghost["databases"][0]["last_error"] or "")
    finally:
        await cluster.close()


async def test_a_killed_workers_pairs_reconnect_as_streams_and_tls_setups_keep_the_stagger(make_cluster) -> None:  # type: ignore[no-untyped-def]
    stagger = 0.2
    cluster = make_cluster(["a", "b"], workers=2, replication={"reconcile_interval": 1.0, "stagger": stagger})
    cluster["b"].extra = {"node": {"workers": 1}}
    cluster.start()
    try:
        await cluster.wait_ready()
        # Twelve pairs with b (system and eleven databases), placed six on each of a's two workers.
        databases = [f"db{i}" for i in range(1, 12)]
        await write_each(cluster, ["b"], databases, "before")
        pairs = await wait_for(lambda: connected_pairs(cluster, "a", "b", 12), 60, "a's twelve pairs with b")
        victim = pairs[0]["worker"]
        on_victim = sorted(p["database"] for p in pairs if p["worker"] == victim)
        assert len(on_victim) == 6, pairs
        _, body = await cluster.admin("a", "/status")
        pid = next(w["pid"] for w in body["workers"] if w["id"] == victim)
        killed_at = time.time()
        psutil.Process(pid).send_signal(signal.SIGKILL)

        async def all_back() -> bool:
            found = await connected_pairs(cluster, "a", "b", 12)
            return found is not None and all(p["worker"] != victim for p in found)

        await wait_for(all_back, 60, "the victim's six pairs connected on the live worker")
        # The live worker's link to b is up: the six pairs are streams on it, dispatched without a ladder slot.
        dispatched = [
            e for e in cluster["a"].events("subscription_setup_dispatched") if e["peer"] == "b" and e["ts"] > killed_at
        ]
        assert {e["database"] for e in dispatched} >= set(on_victim), dispatched
        # TLS setups, on every path since the boot, kept the stagger between them. Timers never fire early; a
        # loop busy for a moment can fire one late, hence the margin below the stagger.
        dials = sorted(e["dial_started"] for e in cluster["a"].events("connection_opened") if e["peer"] == "b")
        assert 2 <= len(dials) < 12, dials
        gaps = [b - a for a, b in itertools.pairwise(dials)]
        assert min(gaps) >= 0.75 * stagger, gaps
        reassigned = [e for e in cluster["a"].events("stale_reassigned") if e["ts"] > killed_at]
        assert len(reassigned) == 6 and all(e["worker"] != victim for e in reassigned)
        assert sorted(e["database"] for e in reassigned) == on_victim  # only the dead worker's pairs moved

        await write_each(cluster, ["b"], databases, "after")
        for database in databases:
            await cluster.wait_converged(database, timeout=30, expect_count=2)

        async def replaced_once() -> bool:
            _, body = await cluster.admin("a", "/status")
            worker = next(w for w in body["workers"] if w["id"] == victim)
            return worker["ready"] and worker["restarts"] == 1

        await wait_for(replaced_once, 30, "the killed worker replaced")
        started = [e for e in cluster["a"].events("worker_started") if e["worker"] == victim]
        assert len(started) == 2
        exited = [e for e in cluster["a"].events("worker_exited") if e["worker"] == victim]
        assert [e["code"] for e in exited] == [-signal.SIGKILL]
    finally:
        await cluster.close()


@pytest.mark.parametrize("jitter", ["full", "equal"])
async def test_a_dead_peer_is_redialled_within_the_backoff_bounds(make_cluster, jitter: str) -> None:  # type: ignore[no-untyped-def]
    (port,) = free_ports(1)  # nothing listens there: every dial is refused
    cluster = make_cluster(["a"], workers=1, replication={"shutdown_timeout": 8.0, "reconnect_jitter": jitter})
    cluster["a"].outside_peers = {"dead": f"wss://127.0.0.1:{port}"}
    cluster.start()
    try:
        await cluster.wait_ready()

        def scheduled() -> list[dict]:
            return [e for e in cluster["a"].events("reconnect_scheduled") if e["peer"] == "dead"]

        await wait_for(lambda: len(scheduled()) >= 5, 40, "five redials of the dead peer", interval=0.2)
        for event in scheduled():
            ceiling = min(0.5 * 2 ** (event["attempt"] - 1), 30.0)
            low = 0.5 if jitter == "full" else max(0.5, ceiling / 2)
            assert low <= event["delay_s"] <= ceiling, event
        assert [e["attempt"] for e in scheduled()][:5] == [1, 2, 3, 4, 5]
    finally:
        await cluster.close()


async def test_a_lone_workers_pairs_come_back_with_its_respawn(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(["a", "b"], workers=1)
    cluster.start()
    try:
        await cluster.wait_ready()
        assert (await cluster.data("b", "PUT", "/data/solo/t/one", {"n": 1}))[0] == 200
        await cluster.wait_connected(databases=["solo"])
        _, body = await cluster.admin("a", "/status")
        psutil.Process(body["workers"][0]["pid"]).send_signal(signal.SIGKILL)
        # No other worker can take the pairs: they wait for the respawn, then set up on it.
        await wait_for(lambda: len([e for e in cluster["a"].events("worker_started")]) == 2, 30, "the respawn")
        await cluster.wait_connected(["a"], databases=["solo"], timeout=30)
        assert (await cluster.data("b", "PUT", "/data/solo/t/two", {"n": 2}))[0] == 200
        await cluster.wait_converged("solo", timeout=30, expect_count=2)
    finally:
        await cluster.close()
