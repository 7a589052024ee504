"""Placement by (peer, database) with real processes: the pairs of one peer spread over every worker of a node, and
a killed worker's pairs, only those, move to the other workers, spread over them, and come back to its respawned
worker once it has stayed up, while the data converges."""

from __future__ import annotations

import math
import signal
import time
from collections import Counter
from typing import Any

import psutil
import pytest

from replicator.coordinator.supervisor import RESPAWN_HEALTHY_UPTIME
from tests.integration.conftest import assert_identical, connected_pairs, wait_for, write_each

DATABASES = [f"db{i}" for i in range(1, 7)]
PAIRS = len(DATABASES) + 1  # and the system database


@pytest.mark.timeout(240)
async def test_one_peers_pairs_spread_over_three_workers_and_a_killed_workers_pairs_spread_over_the_rest(
    make_cluster,  # type: ignore[no-untyped-def]
) -> None:
    cluster = make_cluster(["a", "b"], workers=3)
    cluster.start()
    try:
        await cluster.wait_ready()
        await write_each(cluster, ["a", "b"], DATABASES, "before")

        # Each node has one peer, and its seven pairs with it are on all three of its workers: one worker holds
        # sessions with the peer for some databases while the others hold the peer's other databases.
        for name, other in (("a", "b"), ("b", "a")):
            pairs = await wait_for(
                lambda n=name, o=other: connected_pairs(cluster, n, o, PAIRS, with_session=True),
                60,
                f"{name}'s pairs up",
            )
            load = Counter(p["worker"] for p in pairs)
            assert sorted(load) == [0, 1, 2] and sorted(load.values()) == [2, 2, 3], pairs
            assert all(p["worker"] == p["placed"] for p in pairs), pairs

        pairs = await connected_pairs(cluster, "a", "b", PAIRS, with_session=True)
        assert pairs is not None
        before = {p["database"]: p["worker"] for p in pairs}
        victim = Counter(before.values()).most_common(1)[0][0]  # the worker with three pairs
        moved = sorted(database for database, worker in before.items() if worker == victim)
        assert len(moved) == 3
        _, body = await cluster.admin("a", "/status")
        pid = next(w["pid"] for w in body["workers"] if w["id"] == victim)
        killed_at = time.time()
        psutil.Process(pid).send_signal(signal.SIGKILL)

        async def moved_off() -> dict[str, int] | None:
            found = await connected_pairs(cluster, "a", "b", PAIRS, with_session=True)
            if found is None or any(p["worker"] == victim for p in found):
                return None
            return {p["database"]: p["worker"] for p in found}

        after = await wait_for(moved_off, 60, "the killed worker's pairs connected on the other workers")
        others = sorted({0, 1, 2} - {victim})
        # Only the killed worker's pairs moved, and they went to both other workers, not all onto one.
        assert {d: w for d, w in after.items() if d not in moved} == {d: w for d, w in before.items() if d not in moved}
        assert sorted({after[d] for d in moved}) == others, after
        reassigned = [e for e in cluster["a"].events("stale_reassigned") if e["ts"] > killed_at]
        assert sorted(e["database"] for e in reassigned) == moved
        assert all(e["peer"] == "b" and e["worker"] == after[e["database"]] for e in reassigned), reassigned
        dispatched = {
            (e["database"], e["worker"])
            for e in cluster["a"].events("subscription_setup_dispatched")
            if e["ts"] > killed_at and e["peer"] == "b"
        }
        connected = {
            (e["database"], e["worker"])
            for e in cluster["a"].events("session_connected")
            if e["ts"] > killed_at and e["peer"] == "b"
        }
        for database in moved:
            assert (database, after[database]) in dispatched and (database, after[database]) in connected

        # Once the respawned worker has stayed up, pairs come back to it from the workers above an even share.
        async def rebalanced() -> list[dict[str, Any]] | None:
            found = await connected_pairs(cluster, "a", "b", PAIRS, with_session=True)
            if found is None or not any(p["worker"] == victim for p in found):
                return None
            return found

        back = await wait_for(rebalanced, 90, "pairs moved back onto the respawned worker")
        assert max(Counter(p["worker"] for p in back).values()) <= math.ceil(PAIRS / 3), back
        rebalances = [e for e in cluster["a"].events("worker_rebalanced") if e["ts"] > killed_at]
        assert rebalances and rebalances[0]["worker"] == victim and rebalances[0]["moved"] >= 1, rebalances
        assert rebalances[0]["ts"] - killed_at >= RESPAWN_HEALTHY_UPTIME

        await write_each(cluster, ["a", "b"], DATABASES, "after")
        for database in DATABASES:
            await cluster.wait_converged(database, timeout=60, expect_count=4)
        await assert_identical(cluster, DATABASES)
    finally:
        await cluster.close()
