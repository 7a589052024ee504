"""A node whose wall clock runs 400 days ahead (libfaketime) still completes mutual TLS with the others.

When it dials, it checks the other node's certificate with its own clock, and the other checks its certificate
with the true one: both hold only if the certificates outlast the skew.
"""

from __future__ import annotations

import time

import pytest

from coordinator.local_cluster import faketime_env
from tests.integration.conftest import wait_for

DAY_S = 86_400


async def test_node_400_days_ahead_completes_tls_with_its_peer(make_cluster) -> None:  # type: ignore[no-untyped-def]
    env = faketime_env("+400d")
    if env is None:
        pytest.skip("libfaketime is not installed (Debian package faketime; .ci/run installs it)")
    cluster = make_cluster(["a", "b"], workers=1, env={"b": env})
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
    finally:
        await cluster.close()
