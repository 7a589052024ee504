"""A node whose wall clock runs 400 days ahead (libfaketime): TLS still holds, its clock does not spread.

When it dials, it checks the other node's certificate with its own clock, and the other checks its certificate
with the true one: both hold only if the certificates outlast the skew. The node on true time refuses the peer
ahead by more than max_clock_skew (`clock_skew_refused`, the refusal counter, the offset gauge), redials it on the
pair's growing schedule, and keeps writing with versions near real time; the skewed node still receives what the
others write.
"""

from __future__ import annotations

import re
import time

import aiohttp
import pytest

from replicator.coordinator.local_cluster import faketime_env
from tests.integration.conftest import FAST, assert_identical, equal_jitter_floor, wait_for

DAY_S = 86_400


async def test_node_400_days_ahead_completes_tls_with_its_peer(make_cluster) -> None:  # type: ignore[no-untyped-def]
    env = faketime_env("+400d")
    if env is None:
        pytest.skip("libfaketime is not installed (Debian package faketime; .ci/run installs it)")
    # Equal jitter: every reconnect delay is at least half its attempt's ceiling, so each one shows the growth.
    cluster = make_cluster(["a", "b"], workers=1, env={"b": env}, replication={**FAST, "reconnect_jitter": "equal"})
    cluster.start()
    try:
        await cluster.wait_ready()
        status, ahead = await cluster.data("b", "PUT", "/data/ahead/t/r", {"by": "b"})
        assert status == 200
        assert ahead["version"] / 1e6 - time.time() > 399 * DAY_S  # b's clock really runs ahead

        # A record from the node on true time reaches b: b dialled a, each end verified the other's certificate.
        status, written = await cluster.data("a", "PUT", "/data/true_time/t/r", {"by": "a"})
        assert status == 200

        async def arrived() -> bool:
            status, body = await cluster.data("b", "GET", "/data/true_time/t/r")
            return status == 200 and body["version"] == written["version"]

        await wait_for(arrived, 30, "a's record on b")
        _, status_doc = await cluster.admin("b", "/status")
        pairs = [pair for c in status_doc["connections"] if c["peer"] == "a" for pair in c["databases"]]
        assert any(pair["database"] == "true_time" and pair["connected"] for pair in pairs), pairs

        # a refuses b: b's clock, and so every version b makes, is far past a's max_clock_skew.
        refused = await wait_for(lambda: cluster["a"].events("clock_skew_refused"), 30, "a refusing b's clock")
        assert refused[0]["peer"] == "b" and refused[0]["skew_s"] > 399 * DAY_S

        def redials() -> list[float]:
            """a's reconnect delays for its pair with b for system, from the first refusal of b's clock on."""
            scheduled = [
                e for e in cluster["a"].events("reconnect_scheduled") if (e["peer"], e["database"]) == ("b", "system")
            ]
            first = next((n for n, e in enumerate(scheduled) if "ahead of ours" in e["error"]), len(scheduled))
            return [e["delay_s"] for e in scheduled[first:]]

        # A refused peer is redialled on the pair's schedule, which only grows (earlier failed dials, before b was
        # listening, may have advanced it already: never below the floor of each attempt since the first refusal).
        delays = await wait_for(lambda: (d := redials())[4:] and d, 60, "five redials of b refused for its clock")
        assert all(delay >= equal_jitter_floor(n) for n, delay in enumerate(delays)), delays

        async def scraped() -> tuple[float, float] | None:
            # Worker counters reach the coordinator with the next heartbeat.
            url, auth = f"{cluster['a'].admin_url}/metrics", cluster.admin_headers
            async with aiohttp.ClientSession() as http, http.get(url, headers=auth) as response:
                metrics = await response.text()
            refusals = re.search(r'^replicator_clock_skew_refusals_total\{peer="b"\} (\S+)$', metrics, re.M)
            offset = re.search(r'^replicator_peer_clock_offset_seconds\{peer="b"\} (\S+)$', metrics, re.M)
            if refusals is None or offset is None:
                return None
            return float(refusals.group(1)), float(offset.group(1))

        refusals, offset = await wait_for(scraped, 60, "the refusal counter and the offset gauge for b on a")
        assert refusals >= 1 and offset > 399 * DAY_S
        # a's clock was not dragged: its writes keep versions near real time.
        status, later = await cluster.data("a", "PUT", "/data/true_time/t/later", {"by": "a"})
        assert status == 200 and abs(later["version"] / 1e6 - time.time()) < 60
        status, _ = await cluster.data("a", "GET", "/data/ahead/t/r")
        assert status == 404  # b's far-future record never landed on a

        async def later_on_b() -> bool:
            status, body = await cluster.data("b", "GET", "/data/true_time/t/later")
            return status == 200 and body["version"] == later["version"]

        await wait_for(later_on_b, 30, "a's later record on b")
        await assert_identical(cluster, ["true_time"])
    finally:
        await cluster.close()
