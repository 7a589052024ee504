"""A pair that is connected while its peer is ahead and its position does not move is stalled (invariant 21).

A peer (a fake one, holding a cluster certificate) accepts the subscription, says it is caught up, then tells the
node it holds more than the node has (`Heads`) and sends nothing: every signal of the session says fine. The node
sees the stall itself: `/status` shows what the peer is ahead on, and after stall_threshold the pair is renewed on
the stall schedule, counted (`replicator_pair_stalls_total`) and logged (`pair_stalled`). An operator can renew one
pair without a restart (`POST /pairs/{peer}/{database}/reset`). `/status` also shows the sending end of each pair.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from replicator.coordinator.local_cluster import LocalCluster
from replicator.shared import wire
from replicator.shared.tls import issue_node_cert
from tests.integration.conftest import FAST, assert_log_is_json, wait_for
from tests.integration.test_hostile_peer import FakePeer, _register

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
async def pair(make_cluster: Callable[..., LocalCluster], tmp_path: Path) -> AsyncIterator[tuple[LocalCluster, Path]]:
    cluster = make_cluster(["a", "b"], workers=1, replication={**FAST, "stall_threshold": 3.0})
    cluster.start()
    await cluster.wait_ready()
    issue_node_cert(cluster.dir / "ca", "mallet", ["127.0.0.1"], tmp_path / "mallet")
    try:
        yield cluster, tmp_path / "mallet"
    finally:
        await cluster.close()


async def _pair(cluster: LocalCluster, node: str, peer: str, database: str) -> dict[str, Any] | None:
    _, body = await cluster.admin(node, "/status")
    for connection in body["connections"]:
        if connection["peer"] == peer:
            for state in connection["databases"]:
                if state["database"] == database:
                    return state
    return None


async def test_a_peer_ahead_that_sends_nothing_is_found_stalled_and_renewed(pair: tuple[LocalCluster, Path]) -> None:
    cluster, folder = pair
    head = int(time.time() * 1_000_000)

    async def ahead_and_silent(ws: Any, subscribe: wire.Subscribe) -> None:
        await ws.send_bytes(wire.encode(wire.Schema(database=subscribe.database, epoch="x", head_seq=0)))
        await ws.send_bytes(wire.encode(wire.Batch(entries=[], caught_up=True)))
        await ws.send_bytes(wire.encode(wire.Heads(complete={"mallet": head})))
        while True:  # answers nothing more: acks and holds are read and dropped
            message = await ws.receive(timeout=60)
            if message.type != aiohttp.WSMsgType.BINARY:
                return

    peer = FakePeer(cluster, folder, ahead_and_silent)
    await peer.start()
    try:
        await _register(cluster, "mallet", peer.url, replicates=True)

        async def shown_ahead() -> dict[str, Any] | None:
            state = await _pair(cluster, "a", "mallet", "system")
            return state if state and state["connected"] and state["ahead"].get("mallet") is not None else None

        state = await wait_for(shown_ahead, 60, "a's pair with mallet shown ahead")
        assert state["caught_up"] is True  # what the session says, and what used to be all there was

        stalled = await wait_for(
            lambda: [e for e in cluster["a"].events("pair_stalled") if e["peer"] == "mallet"], 60, "pair_stalled"
        )
        assert stalled[0]["database"] == "system" and stalled[0]["origin"] == "mallet", stalled[0]
        # Renewed: mallet is dialled again.
        await wait_for(lambda: sum(1 for node, _ in peer.dials if node == "a") >= 2, 60, "a to dial mallet again")

        async def counted() -> float | None:
            url, auth = f"{cluster['a'].admin_url}/metrics", cluster.admin_headers
            async with aiohttp.ClientSession() as http, http.get(url, headers=auth) as response:
                text = await response.text()
            for line in text.splitlines():
                if line.startswith('replicator_pair_stalls_total{peer="mallet"}'):
                    return float(line.split()[-1])
            return None

        assert (await wait_for(counted, 30, "the stall counted")) >= 1

        # An operator's reset renews the pair at once, without a restart.
        before = sum(1 for node, _ in peer.dials if node == "a")
        status, body = await cluster.admin_request("a", "POST", "/pairs/mallet/system/reset")
        assert status == 202 and body == {"peer": "mallet", "database": "system", "reset": True}, body
        await wait_for(lambda: sum(1 for node, _ in peer.dials if node == "a") > before, 30, "the reset's new dial")
        for path, code in [
            ("/pairs/nobody/system/reset", 404),
            ("/pairs/mallet/never_made/reset", 404),
            ("/pairs/bad%20name/system/reset", 400),
        ]:
            status, body = await cluster.admin_request("a", "POST", path)
            assert status == code and "error" in body, (path, status, body)
        assert (await cluster.data("a", "PUT", "/data/after_stall/t/x", {"ok": 1}))[0] == 200
        await cluster.wait_converged("after_stall", ["a", "b"], timeout=60, expect_count=1)
    finally:
        await peer.close()
    assert_log_is_json(cluster["a"])


async def test_status_shows_the_sending_end_of_each_pair(pair: tuple[LocalCluster, Path]) -> None:
    cluster, _ = pair
    assert (await cluster.data("a", "PUT", "/data/shown/t/x", {"v": 1}))[0] == 200
    await cluster.wait_converged("shown", timeout=60, expect_count=1)

    async def sending() -> dict[str, Any] | None:
        _, body = await cluster.admin("a", "/status")
        for state in body["sending"]:
            if state["peer"] == "b" and state["database"] == "shown" and state["connected"] and state["caught_up"]:
                # The figures are reported as acks arrive, at most every few seconds.
                return state if state["batches_acked"] >= 1 else None
        return None

    state = await wait_for(sending, 60, "a's sending end of b's subscription to shown")
    assert state["records_sent"] >= 1 and state["blocked"] == {} and state["error"] is None, state
    # b stops: its subscription's sending end on a ends, and says so.
    assert cluster["b"].stop() == 0

    async def ended() -> bool:
        _, body = await cluster.admin("a", "/status")
        return any(s["peer"] == "b" and s["database"] == "shown" and not s["connected"] for s in body["sending"])

    try:
        await wait_for(ended, 60, "the sending end shown ended")
    except AssertionError:
        print((await cluster.admin("a", "/status"))[1]["sending"])
        raise
    cluster["b"].start()
    await cluster.wait_ready(["b"])
    await asyncio.wait_for(cluster.wait_converged("shown", timeout=60, expect_count=1), 90)


async def test_a_batch_whose_registry_rows_are_refused_does_not_move_the_position_past_them(
    pair: tuple[LocalCluster, Path],
) -> None:
    """A registry row that does not verify here (a CA this node does not trust yet, during a rotation) is not
    stored, so the batch's mark for its origin must stop below it, and so must the marks of every later batch of
    the session (the sender does not know): the next session asks for it again (invariant 13), and once it
    verifies it arrives. Seen from the peer's side, in what the node's next Subscribe says."""
    cluster, folder = pair
    version = int(time.time() * 1_000_000)
    sessions: list[wire.Subscribe] = []

    async def refused_row(ws: Any, subscribe: wire.Subscribe) -> None:
        sessions.append(subscribe)
        await ws.send_bytes(wire.encode(wire.Schema(database=subscribe.database, epoch="x", head_seq=1)))
        if len(sessions) > 1:
            await ws.receive(timeout=60)
            return
        row = wire.Entry("nodes", "ghost", msgspec.msgpack.encode({"not": "a signed row"}), version, "mallet")
        await ws.send_bytes(wire.encode(wire.Batch(entries=[row], marks={"mallet": version + 10})))
        await ws.receive(timeout=10)  # the ack
        # A later batch of the session, whose one entry (a removal needs no signature) is taken: its mark too
        # must stay below the row refused before it.
        removal = wire.Entry("nodes", "ghost-2", b"", version + 20, "mallet", tombstone=True)
        await ws.send_bytes(wire.encode(wire.Batch(entries=[removal], marks={"mallet": version + 30}, caught_up=True)))
        await ws.receive(timeout=10)
        await ws.close(code=wire.CLOSE_GOING_AWAY, message=b"again")

    peer = FakePeer(cluster, folder, refused_row)
    await peer.start()
    try:
        await _register(cluster, "mallet", peer.url, replicates=True)
        await wait_for(lambda: len(sessions) >= 2, 60, "a to subscribe to mallet again")
        # The worker's log line reaches the node's log through its own stream: it may land after the next Subscribe.
        refused = await wait_for(
            lambda: [e for e in cluster["a"].events("registry_row_refused") if e["name"] == "ghost"],
            30,
            "a to log the refused row",
        )
        assert refused[0]["peer"] == "mallet", refused
        # The position stops below the row a did not store (the mark said version + 10).
        assert sessions[1].progress.get("mallet", 0) < version, sessions[1].progress
    finally:
        await peer.close()
    assert_log_is_json(cluster["a"])
