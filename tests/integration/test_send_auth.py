"""A new node that dials before its registry row has reached the node it dials: the server asks again on the
send-auth schedule and admits it as soon as the row arrives, without a refusal the dialler would back off from."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from replicator.coordinator.local_cluster import LocalCluster
from tests.integration.conftest import FAST, assert_log_is_json, wait_for


async def test_a_node_whose_row_arrives_late_is_admitted_within_the_budget(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    # c knows a from its config; a knows nothing of c until an operator introduces it.
    cluster = make_cluster(["a", "c"], workers=1, topology={"a": [], "c": ["a"]}, replication=dict(FAST))
    cluster["a"].start()
    await cluster.wait_ready(["a"])
    cluster["c"].start()
    await cluster.wait_ready(["c"])
    try:

        async def waiting() -> list[dict[str, Any]]:
            return [e for e in cluster["c"].events("session_connected") if e["peer"] == "a"]

        # c's first session is held open on a while a looks for c's row: nothing connected, nothing refused.
        await wait_for(
            lambda: [e for e in cluster["a"].events("send_auth_waiting") if e["peer"] == "c"],
            15,
            "a to wait for c's row",
        )
        assert not await waiting()
        assert not [e for e in cluster["a"].events("send_auth_refused") if e["peer"] == "c"]
        status, _ = await cluster.admin_request("a", "PUT", "/nodes/c", {"url": cluster["c"].url, "replicates": True})
        assert status == 200

        connected = await wait_for(waiting, 30, "c's session with a")
        admitted = [e for e in cluster["a"].events("send_auth_admitted") if e["peer"] == "c"]
        assert admitted and admitted[0]["attempts"] > 1, admitted
        assert not [e for e in cluster["a"].events("send_auth_refused") if e["peer"] == "c"]
        # c never had to back off from a refusal of its system session: its first attempt got through.
        first = connected[0]
        before = [
            e
            for e in cluster["c"].events("reconnect_scheduled")
            if e["peer"] == "a" and e["database"] == "system" and e["ts"] < first["ts"]
        ]
        assert not before, before

        assert (await cluster.data("a", "PUT", "/data/late/t/x", {"v": 1}))[0] == 200
        await cluster.wait_converged("late", timeout=30, expect_count=1)
    finally:
        await cluster.close()
    for name in ("a", "c"):
        assert_log_is_json(cluster[name])
