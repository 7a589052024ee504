"""Write confirmations and session tokens on real processes (issue 22).

A write with `?confirm=N` is answered once N other nodes hold it durably, so it is readable there the moment its
answer arrives and survives the loss of the node that took it; a peer down makes `confirm=all` a 504 that says what
is committed. A read with `X-Replicator-After` on any node never sees a state older than the token's writes. Both
hold through a cut link, on the relayed copy. Every test ends with the acknowledged-write check and equal digests.
"""

from __future__ import annotations

import asyncio
import shutil
from typing import Any

from replicator.coordinator.local_cluster import LocalCluster
from tests.integration.conftest import FAST, assert_identical, wait_for
from tests.integration.ledger import Ledger

DATABASE = "confirmed"
PATIENT = "timeout=90"  # a confirmation a busy machine may take long to gather: the tests assert counts, not times


async def _put(
    cluster: LocalCluster, ledger: Ledger, name: str, record_id: str, value: Any, query: str
) -> tuple[int, dict[str, Any], dict[str, str]]:
    """A write with a query; whatever is committed (200, or a 504 that says so) is an acknowledged write."""
    status, body, headers = await cluster.data_request(name, "PUT", f"/data/{DATABASE}/t/{record_id}?{query}", value)
    if status in (200, 504) and body.get("version"):
        ledger.note(record_id, body["version"], value)
    return status, body, headers


async def _read(cluster: LocalCluster, name: str, record_id: str, token: str) -> tuple[int, dict[str, Any]]:
    status, body, _ = await cluster.data_request(
        name, "GET", f"/data/{DATABASE}/t/{record_id}?{PATIENT}", headers={"X-Replicator-After": token}
    )
    return status, body


async def test_a_write_confirmed_by_two_is_on_both_others_at_its_answer_and_survives_the_writers_loss(
    make_cluster,  # type: ignore[no-untyped-def]
) -> None:
    cluster = make_cluster(["a", "b", "c"], workers=2, replication=FAST)
    ledger = Ledger(cluster, DATABASE)
    cluster.start()
    try:
        await cluster.wait_ready()
        # The first write creates the database: b and c count as its holders-to-be, and it waits for them.
        for i in range(20):
            status, body, headers = await _put(cluster, ledger, "a", f"r{i}", {"i": i}, f"confirm=2&{PATIENT}")
            assert status == 200, body
            assert body["confirmed"] == 2 and sorted(body["nodes"]) == ["b", "c"], body
            assert headers["X-Replicator-Token"] == f"a={body['version']}"
            for other in ("b", "c"):
                found, held = await cluster.data(other, "GET", f"/data/{DATABASE}/t/r{i}")
                assert found == 200 and held["version"] == body["version"], (other, found, held)
        # The header says the same; `majority` of three holders is one other node.
        status, body, _ = await cluster.data_request(
            "a", "PUT", f"/data/{DATABASE}/t/h?{PATIENT}", {"h": 1}, headers={"X-Replicator-Confirm": "majority"}
        )
        assert status == 200 and body["confirmed"] >= 1, body
        ledger.note("h", body["version"], {"h": 1})

        # Right after the last answer, the writer is killed and its data directory lost: nothing confirmed is gone.
        cluster["a"].kill()
        cluster["a"].stop()
        shutil.rmtree(cluster["a"].dir / "data")
        cluster["a"].start()
        await cluster.wait_ready(["a"])
        await cluster.wait_converged(DATABASE, timeout=120, expect_count=21)
        await ledger.check()
        await assert_identical(cluster, [DATABASE])
    finally:
        await cluster.close()


async def test_with_a_peer_down_all_times_out_with_the_count_and_bad_specs_write_nothing(
    make_cluster,  # type: ignore[no-untyped-def]
) -> None:
    cluster = make_cluster(["a", "b", "c"], workers=1, replication=FAST)
    ledger = Ledger(cluster, DATABASE)
    cluster.start()
    try:
        await cluster.wait_ready()
        status, body, _ = await _put(cluster, ledger, "a", "first", 1, f"confirm=all&{PATIENT}")
        assert status == 200 and body["confirmed"] == 2, body
        assert cluster["c"].stop() == 0

        status, body, headers = await _put(cluster, ledger, "a", "late", 2, "confirm=all&timeout=2")
        assert status == 504, body
        assert body["committed"] is True and body["confirmed"] == 1 and body["needed"] == 2, body
        assert body["nodes"] == ["b"] and body["token"] == headers["X-Replicator-Token"] == f"a={body['version']}"
        # The same write again, idempotently, by whoever decides to retry: one other node is a majority.
        status, body, _ = await _put(cluster, ledger, "a", "late", 2, f"confirm=majority&{PATIENT}")
        assert status == 200 and body["confirmed"] == 1, body

        for query, reason in (
            ("confirm=3", "asks more nodes than hold database"),
            ("confirm=most", "must be a whole number"),
            ("confirm=2&timeout=forever", "timeout must be a number"),
            ("confirm=2&timeout=-1", "timeout must be 0 to"),
        ):
            status, body, _ = await _put(cluster, ledger, "a", "refused", 3, query)
            assert status == 400 and reason in body["error"], (query, status, body)
        status, _ = await cluster.data("a", "GET", f"/data/{DATABASE}/t/refused")
        assert status == 404  # nothing was written by a refused request

        async def counted() -> bool:
            url = cluster["a"].admin_url + "/metrics"
            async with cluster.http.get(url, headers=cluster["a"].admin_headers) as response:
                text = await response.text()
            # Workers report their counts with their heartbeats.
            return (
                f'replicator_write_confirm_timeouts_total{{database="{DATABASE}"}} 1.0' in text
                and "replicator_write_confirm_seconds_count 2.0" in text  # the node's, every database's
            )

        await wait_for(counted, 60, "the timeout and the two confirmed writes in a's metrics")

        cluster["c"].start()
        await cluster.wait_ready(["c"])
        # A batch and a delete wait too: the batch's token is its highest version.
        items = [{"id": f"batch-{i}", "value": i} for i in range(3)]
        status, body, headers = await cluster.data_request(
            "a", "POST", f"/data/{DATABASE}/t?confirm=all&{PATIENT}", items
        )
        assert status == 200 and body["count"] == 3 and body["confirmed"] == 2, body
        batch_version = int(headers["X-Replicator-Token"].split("=")[1])
        for item in items:
            found, held = await cluster.data("c", "GET", f"/data/{DATABASE}/t/{item['id']}")
            assert found == 200 and held["version"] <= batch_version, held
            ledger.note(item["id"], held["version"], item["value"])
        status, body, _ = await cluster.data_request("a", "DELETE", f"/data/{DATABASE}/t/first?confirm=all&{PATIENT}")
        assert status == 200 and body["confirmed"] == 2, body
        ledger.note("first", body["version"], None)
        for name in ("b", "c"):
            assert (await cluster.data(name, "GET", f"/data/{DATABASE}/t/first"))[0] == 404
        await cluster.wait_converged(DATABASE, timeout=90, expect_count=4)
        await ledger.check()
        await assert_identical(cluster, [DATABASE])
    finally:
        await cluster.close()


async def test_reads_after_a_token_never_see_an_older_state_under_concurrent_writes(
    make_cluster,  # type: ignore[no-untyped-def]
) -> None:
    cluster = make_cluster(["a", "b", "c"], workers=2, replication=FAST)
    ledger = Ledger(cluster, DATABASE)
    cluster.start()
    try:
        await cluster.wait_ready()
        await _put(cluster, ledger, "a", "counter", {"n": 0}, f"confirm=all&{PATIENT}")
        latest: dict[str, Any] = {"n": 0, "token": ""}
        reading = asyncio.Event()
        first = asyncio.Event()  # the writer holds a token

        async def writer() -> None:
            n = 0
            while not reading.is_set() and n < 20_000:
                n += 1
                status, body, headers = await _put(cluster, ledger, "a", "counter", {"n": n}, "")
                assert status == 200, body
                latest.update(n=n, token=headers["X-Replicator-Token"])
                first.set()

        reads = 0
        writing = asyncio.create_task(writer())
        try:
            await asyncio.wait([writing, asyncio.create_task(first.wait())], return_when=asyncio.FIRST_COMPLETED)
            while reads < 300:  # every read taken while a writes on
                assert not writing.done(), writing
                seen, token = latest["n"], latest["token"]
                status, body = await _read(cluster, ("b", "c")[reads % 2], "counter", token)
                assert status == 200, body
                assert body["value"]["n"] >= seen, (seen, body)
                reads += 1
        finally:
            reading.set()
            await writing
        assert latest["n"] > 1

        # Tokens merge: the highest per origin of two writes on two nodes, read on the third.
        _, _, on_b = await _put(cluster, ledger, "b", "from-b", 1, "")
        _, _, on_a = await _put(cluster, ledger, "a", "from-a", 1, "")
        merged = ",".join(sorted([on_a["X-Replicator-Token"], on_b["X-Replicator-Token"]]))
        for record_id in ("from-a", "from-b"):
            status, body = await _read(cluster, "c", record_id, merged)
            assert status == 200, body
        status, body, _ = await cluster.data_request(
            "c", "GET", f"/data/{DATABASE}/t?{PATIENT}", headers={"X-Replicator-After": merged}
        )
        assert status == 200 and {r["id"] for r in body} >= {"counter", "from-a", "from-b"}, body

        # A token this node cannot cover in time names what it lacks; a bad one is refused; no database, no wait.
        origin, version = on_a["X-Replicator-Token"].split("=")
        ahead = f"{origin}={int(version) + 10**12}"
        status, body, _ = await cluster.data_request(
            "b", "GET", f"/data/{DATABASE}/t/from-a?timeout=0.5", headers={"X-Replicator-After": ahead}
        )
        assert status == 504 and body["missing"]["a"]["wanted"] == int(version) + 10**12, body
        status, body, _ = await cluster.data_request(
            "b", "GET", f"/data/{DATABASE}/t/from-a", headers={"X-Replicator-After": "a=soon"}
        )
        assert status == 400 and "expected origin=version" in body["error"], body
        status, body, _ = await cluster.data_request(
            "b", "GET", "/data/nowhere/t/x", headers={"X-Replicator-After": merged}
        )
        assert status == 404 and "nowhere" in body["error"], body

        await cluster.wait_converged(DATABASE, timeout=60)
        await ledger.check()
        await assert_identical(cluster, [DATABASE])
    finally:
        await cluster.close()


async def test_confirmations_and_tokens_pass_through_a_cut_link_on_the_relayed_copy(
    make_cluster,  # type: ignore[no-untyped-def]
) -> None:
    cluster = make_cluster(
        ["a", "b", "c"], workers=1, proxied=[("a", "b")], replication={**FAST, "failover_after": 2.0}
    )
    ledger = Ledger(cluster, DATABASE)
    cluster.start()
    try:
        await cluster.wait_ready()
        status, body, _ = await _put(cluster, ledger, "a", "before", 0, f"confirm=2&{PATIENT}")
        assert status == 200 and body["confirmed"] == 2, body
        await cluster.wait_connected(timeout=60, databases=[DATABASE])

        cluster.proxy("a", "b").cut()
        # b gets a's writes through c once the link has failed over, and a hears of it through c.
        for i in range(5):
            status, body, headers = await _put(cluster, ledger, "a", f"cut-{i}", i, f"confirm=2&{PATIENT}")
            assert status == 200 and sorted(body["nodes"]) == ["b", "c"], body
            found, held = await cluster.data("b", "GET", f"/data/{DATABASE}/t/cut-{i}")
            assert found == 200 and held["version"] == body["version"], (found, held)
        # The other way round, and a token read across the cut.
        status, body, headers = await _put(cluster, ledger, "b", "from-b", 1, f"confirm=2&{PATIENT}")
        assert status == 200 and sorted(body["nodes"]) == ["a", "c"], body
        status, read = await _read(cluster, "a", "from-b", headers["X-Replicator-Token"])
        assert status == 200 and read["version"] == body["version"], read

        cluster.proxy("a", "b").heal()

        async def direct_again() -> bool:
            _, status_b = await cluster.admin("b", "/status")
            return DATABASE not in status_b["failed_over"]

        await wait_for(direct_again, 90, "a's origin back on the a-b link at b")
        await cluster.wait_converged(DATABASE, timeout=60, expect_count=7)
        await ledger.check()
        await assert_identical(cluster, [DATABASE])
    finally:
        await cluster.close()
