"""Blobs against a hostile peer holding a cluster certificate (issue 21), on real processes.

A reference claiming 2^62 bytes is refused and no `.part` file grows; a blob above the receiver's
`data.max_value_bytes` is not stored while its record is kept (as one whose blob the peer lacks); a peer that
trickles a blob is cut off by `replication.blob_min_rate` and redialled on the growing backoff, and the download
resumes once the peer sends at a fair rate; 200 Range requests for 4 bytes of an 8 MB blob do not hash it again.
Each test ends with the node serving, its worker's pid unchanged and its log JSON lines.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp import web

from replicator.coordinator.local_cluster import LocalCluster
from replicator.shared import blobs, membership, wire
from replicator.shared.store import NodeRow
from replicator.shared.tls import issue_node_cert
from tests.integration.conftest import (
    FAST,
    Unharmed,
    assert_identical,
    assert_log_is_json,
    equal_jitter_floor,
    wait_for,
)
from tests.integration.test_health import worker_pids
from tests.integration.test_hostile_peer import FakePeer, _mallet_client, _register

MIB = 1024 * 1024


def _blob_folder(cluster: LocalCluster, name: str, database: str) -> Path:
    return cluster[name].dir / "data" / f"{database}{blobs.SUFFIX}"


def _largest_file(folder: Path) -> int:
    return max((path.stat().st_size for path in folder.iterdir()), default=0) if folder.exists() else 0


async def _metric(cluster: LocalCluster, name: str, metric: str, **labels: str) -> float:
    """The value of the node's series of `metric` with exactly these labels (in any order), -1 when it has none."""
    async with cluster.http.get(cluster[name].admin_url + "/metrics", headers=cluster[name].admin_headers) as response:
        text = await response.text()
    for found in re.finditer(rf"^{metric}\{{([^}}]*)\}} (\S+)$", text, re.MULTILINE):
        if dict(re.findall(r'(\w+)="([^"]*)"', found.group(1))) == labels:
            return float(found.group(2))
    return -1.0


async def _put(cluster: LocalCluster, name: str, path: str, value: Any) -> None:
    body = io.BytesIO(json.dumps(value).encode())  # aiohttp warns about large raw bodies
    async with cluster.http.put(cluster[name].data_url + path, data=body, ssl=cluster.data_ssl) as response:
        assert response.status == 200, (name, path, response.status, await response.text())


async def _still_serving(cluster: LocalCluster, unharmed: Unharmed, database: str) -> None:
    """The end of every test here: data still flows both ways, a's workers are the ones it started with and their
    memory is back near where it started (`Unharmed`), and every node's log is JSON lines."""
    assert (await cluster.data("a", "PUT", f"/data/{database}/t/a", {"ok": 1}))[0] == 200
    assert (await cluster.data("b", "PUT", f"/data/{database}/t/b", {"ok": 2}))[0] == 200
    await cluster.wait_converged(database, ["a", "b"], timeout=60, expect_count=2)
    await unharmed.check(database)
    for name in cluster.nodes:
        assert_log_is_json(cluster[name])


async def _hold(ws: Any) -> None:
    """Keep a session open, sending nothing more, until the node closes it."""
    while not ws.closed:
        message = await ws.receive(timeout=60)
        if message.type in (web.WSMsgType.CLOSE, web.WSMsgType.CLOSED, web.WSMsgType.CLOSING):
            return


def _batch(entries: list[wire.Entry], head_seq: int, caught_up: bool = False) -> bytes:
    return wire.encode(
        wire.Batch(
            entries=entries,
            marks={"mallet": max(entry.version for entry in entries)},
            head_seq=head_seq,
            caught_up=caught_up,
        )
    )


async def _announce(ws: Any, folder: Path, peer: FakePeer, database: str) -> None:
    """mallet's own registry row, signed with its certificate, saying it holds `database`: the node then subscribes
    to it for that database too."""
    signer = membership.Signer.load("mallet", folder / "mallet.pem", folder / "mallet.key")
    row = NodeRow(name="mallet", url=peer.url, replicates=True, holds=[database])
    now = int(time.time() * 1_000_000)
    await ws.send_bytes(_batch([membership.signed_entry(signer, "nodes", row, now)], head_seq=1, caught_up=True))


async def _acked(ws: Any) -> None:
    """Wait for the node's Ack of the batch sent; ConnectionError (FakePeer ends the session) if it closes first."""
    while True:
        message = await ws.receive(timeout=30)
        if message.type != web.WSMsgType.BINARY:
            raise ConnectionError(f"the node closed the session: {message.type.name}")
        if isinstance(wire.decode(message.data), wire.Ack):
            return


def _cluster(make_cluster: Callable[..., LocalCluster], tmp_path: Path, **replication: Any) -> LocalCluster:
    cluster = make_cluster(["a", "b"], workers=1, replication={**FAST, **replication})
    issue_node_cert(cluster.dir / "ca", "mallet", ["127.0.0.1"], tmp_path / "mallet")
    return cluster


@pytest.mark.timeout(240)
async def test_a_reference_claiming_2_62_bytes_is_refused_and_no_part_file_grows(
    make_cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    cluster = _cluster(make_cluster, tmp_path)
    cluster["a"].extra["data"] = {"max_value_bytes": MIB}
    huge = blobs.Ref(hashlib.sha256(b"the issue's reference").digest(), 2**62)
    asked: list[str] = []  # the blob requests mallet received

    async def endless(request: web.Request) -> web.StreamResponse:
        """What the issue's peer served, bytes without end, 4 MiB of them per request here (each request of a node
        that resumes its partial file grows it by that much)."""
        asked.append(request.match_info["hash"])
        response = web.StreamResponse()
        response.force_close()  # no idle TLS connection left for FakePeer.close to tear down
        await response.prepare(request)
        for _ in range(64):
            await response.write(b"\0" * 65536)
        return response

    async def serve(ws: Any, subscribe: wire.Subscribe) -> None:
        await ws.send_bytes(wire.encode(wire.Schema(database=subscribe.database, epoch="x", head_seq=1)))
        if subscribe.database == "system":
            await _announce(ws, tmp_path / "mallet", peer, "hostile")
        if subscribe.database == "hostile":
            now = int(time.time() * 1_000_000)
            entries = [
                wire.Entry("t", "huge", blobs.reference(huge), now, "mallet"),
                wire.Entry("t", "small", msgspec.msgpack.encode({"v": 1}), now + 1, "mallet"),
            ]
            await ws.send_bytes(_batch(entries, head_seq=1, caught_up=True))
        await _hold(ws)

    peer = FakePeer(cluster, tmp_path / "mallet", serve, lambda app: _blob_route(app, endless))
    cluster.start()
    await cluster.wait_ready()
    await peer.start()
    try:
        assert (await cluster.data("a", "PUT", "/data/hostile/t/first", {"v": 0}))[0] == 200
        await cluster.wait_converged("hostile", ["a", "b"], timeout=60, expect_count=1)
        unharmed = await Unharmed.of(cluster, "a")
        await _register(cluster, "mallet", peer.url, replicates=True)

        def refused() -> list[dict[str, Any]]:
            return [e for e in cluster["a"].events("blob_refused") if e["peer"] == "mallet"]

        (event, *_) = await wait_for(refused, 90, "a to refuse mallet's reference of 2^62 bytes")
        assert (event["level"], event["database"], event["hash"]) == ("warning", "hostile", huge.hex)
        assert (event["size"], event["limit"], event["table"], event["id"]) == (2**62, MIB, "t", "huge")

        # The rest of the batch is applied, and so is the record, without its blob: reading it is a 503 naming it.
        async def applied() -> bool:
            return (await cluster.data("a", "GET", "/data/hostile/t/small"))[0] == 200

        await wait_for(applied, 60, "a to apply the batch past the refused blob")
        status, body = await cluster.data("a", "GET", "/data/hostile/t/huge")
        assert status == 503 and huge.hex in body["error"], (status, body)
        folder = _blob_folder(cluster, "a", "hostile")
        assert not any(path.name.endswith(blobs.PART) for path in folder.glob("*")) if folder.exists() else True
        assert _largest_file(folder) <= MIB

        async def counted() -> bool:
            return await _metric(cluster, "a", "replicator_blobs_refused_total", peer="mallet", database="hostile") >= 1

        await wait_for(counted, 60, "a to count the refused blob")
        # b's limit is the default 64 MiB: it refuses the same reference, from mallet or from a.
        await wait_for(lambda: cluster["b"].events("blob_refused"), 60, "b to refuse it too")
        assert asked == []  # no node asked for a byte of it
        await _still_serving(cluster, unharmed, "after_huge")
    finally:
        await peer.close()
        await cluster.close()


def _damage(path: Path, offset: int) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        file.write(b"rot!")


def _blob_route(app: web.Application, handler: Callable[[web.Request], Any]) -> None:
    app.router.add_get("/replication/blobs/{database}/{hash}", handler)


@pytest.mark.timeout(240)
async def test_a_blob_above_the_receivers_max_value_bytes_is_not_stored_and_its_record_is_kept(
    make_cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    """a takes a 2 MiB value (its limit is 4 MiB); b's limit is 1 MiB: b applies the record without the blob, as one
    whose blob its peer lacks, so the data converges (the digests compare references) and the stream goes on."""
    cluster = _cluster(make_cluster, tmp_path)
    cluster["a"].extra["data"] = {"max_value_bytes": 4 * MIB}
    cluster["b"].extra["data"] = {"max_value_bytes": MIB}
    cluster.start()
    try:
        await cluster.wait_ready()
        assert (await cluster.data("a", "PUT", "/data/big/t/first", {"v": 0}))[0] == 200
        await cluster.wait_converged("big", ["a", "b"], timeout=60, expect_count=1)
        unharmed = await Unharmed.of(cluster, "a")
        b_pids = await worker_pids(cluster, "b")
        value = hashlib.sha256(b"2 MiB").hexdigest() * (2 * MIB // 64)
        data = msgspec.msgpack.encode(value)
        ref = blobs.ref_of(data)
        await _put(cluster, "a", "/data/big/t/large", value)
        await cluster.wait_converged("big", ["a", "b"], timeout=60, expect_count=2)

        def refused() -> list[dict[str, Any]]:
            return [e for e in cluster["b"].events("blob_refused") if e["hash"] == ref.hex]

        (event, *_) = await wait_for(refused, 60, "b to refuse the blob above its limit")
        assert (event["peer"], event["database"], event["size"], event["limit"]) == ("a", "big", len(data), MIB)
        assert (await cluster.data("a", "GET", "/data/big/t/large"))[1]["value"] == value
        assert (await cluster.data("b", "GET", "/data/big/t/large"))[0] == 503
        folder = _blob_folder(cluster, "b", "big")
        assert not (folder / ref.hex).exists() and not (folder / (ref.hex + blobs.PART)).exists()
        assert _largest_file(folder) <= MIB
        assert [e for e in cluster["b"].events("blob_missing") if e["hash"] == ref.hex] == []
        await assert_identical(cluster, ["big"])

        async def counted() -> bool:
            return await _metric(cluster, "b", "replicator_blobs_refused_total", peer="a", database="big") >= 1

        await wait_for(counted, 60, "b to count the refused blob")
        await _still_serving(cluster, unharmed, "after_big")
        assert await worker_pids(cluster, "b") == b_pids
    finally:
        await cluster.close()


@pytest.mark.timeout(300)
async def test_a_trickling_sender_is_cut_off_by_the_minimum_rate_and_redialled_on_the_backoff(
    make_cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    """mallet sends 1 KiB a second of a 512 KiB blob; a's minimum is 64 KiB/s over 2 s windows. Each session applies
    a first batch, then waits for the blob of the second: cut after a window, the session is redialled on the
    pair's growing schedule (equal jitter: every delay at least half its attempt's ceiling), never at its floor.
    Once mallet sends at full speed, the download resumes from what the trickle left and the record is applied."""
    cluster = _cluster(make_cluster, tmp_path, blob_rate_window=2.0, reconnect_jitter="equal")
    value = hashlib.sha256(b"trickled").hexdigest() * (512 * 1024 // 64)
    data = msgspec.msgpack.encode(value)
    ref = blobs.ref_of(data)
    fair = asyncio.Event()  # set: mallet serves at full speed
    served: list[int] = []  # the first byte of each blob request

    async def trickle(request: web.Request) -> web.StreamResponse:
        found = re.match(r"bytes=(\d+)-", request.headers.get("Range", ""))
        start = int(found.group(1)) if found else 0
        served.append(start)
        response = web.StreamResponse(status=206 if start else 200)
        response.content_length = len(data) - start
        response.force_close()  # no idle TLS connection left for FakePeer.close to tear down
        if start:
            response.headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        await response.prepare(request)
        try:
            position = start
            while position < len(data):
                step = len(data) - position if fair.is_set() else 1024
                await response.write(data[position : position + step])
                position += step
                if not fair.is_set():
                    await asyncio.sleep(1.0)
            await response.write_eof()
        except (ConnectionError, RuntimeError):
            pass  # the node cut it
        return response

    async def serve(ws: Any, subscribe: wire.Subscribe) -> None:
        await ws.send_bytes(wire.encode(wire.Schema(database=subscribe.database, epoch="x", head_seq=2)))
        if subscribe.database == "system":
            await _announce(ws, tmp_path / "mallet", peer, "trickle")
        if subscribe.database == "trickle":
            now = int(time.time() * 1_000_000)
            await ws.send_bytes(_batch([wire.Entry("t", "small", msgspec.msgpack.encode(1), now, "mallet")], 2))
            await _acked(ws)
            big = wire.Entry("t", "big", blobs.reference(ref), now + 1, "mallet")
            await ws.send_bytes(_batch([big], 2, caught_up=True))
        await _hold(ws)

    peer = FakePeer(cluster, tmp_path / "mallet", serve, lambda app: _blob_route(app, trickle))
    cluster.start()
    await cluster.wait_ready()
    await peer.start()
    try:
        assert (await cluster.data("a", "PUT", "/data/trickle/t/first", {"v": 0}))[0] == 200
        await cluster.wait_converged("trickle", ["a", "b"], timeout=60, expect_count=1)
        unharmed = await Unharmed.of(cluster, "a")
        await _register(cluster, "mallet", peer.url, replicates=True)

        def aborted() -> list[dict[str, Any]]:
            return [e for e in cluster["a"].events("blob_transfer_aborted") if e["peer"] == "mallet"]

        def delays() -> list[float]:
            return [
                e["delay_s"]
                for e in cluster["a"].events("reconnect_scheduled")
                if e["peer"] == "mallet" and e["database"] == "trickle" and "blob_min_rate" in e["error"]
            ]

        await wait_for(lambda: len(delays()) >= 4, 120, "a to cut mallet's trickle four times")
        for event in aborted():
            assert (event["database"], event["hash"], event["limit"]) == ("trickle", ref.hex, "min_rate"), event
            assert event["received"] < len(data)
        assert all(delay >= equal_jitter_floor(n) for n, delay in enumerate(delays())), delays()
        assert (await cluster.data("a", "GET", "/data/trickle/t/small"))[0] == 200  # the first batch, each time
        assert (await cluster.data("a", "GET", "/data/trickle/t/big"))[0] == 404  # held back with its blob
        # a serves on meanwhile.
        assert (await cluster.data("b", "PUT", "/data/during/t/x", {"ok": 1}))[0] == 200
        await cluster.wait_converged("during", ["a", "b"], timeout=60, expect_count=1)

        fair.set()

        async def arrived() -> bool:
            return (await cluster.data("a", "GET", "/data/trickle/t/big"))[0] == 200

        await wait_for(arrived, 120, "a to fetch the blob once mallet sends it at a fair rate")
        assert (await cluster.data("a", "GET", "/data/trickle/t/big"))[1]["value"] == value
        assert any(start > 0 for start in served), served  # resumed: what the trickle brought was kept

        async def counted() -> bool:
            series = "replicator_blob_transfers_aborted_total"
            return await _metric(cluster, "a", series, peer="mallet", database="trickle") >= 4

        await wait_for(counted, 60, "a to count the cut downloads")
        await _still_serving(cluster, unharmed, "after_trickle")
    finally:
        await peer.close()
        await cluster.close()


@pytest.mark.timeout(240)
async def test_many_range_requests_for_a_few_bytes_do_not_hash_the_blob_again(
    make_cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    """200 Range requests for the last 4 bytes of an 8 MB blob: the serving worker hashed the file once (for b's
    download), and hashes it again only once it changed on disk, when it is found damaged and refused."""
    cluster = _cluster(make_cluster, tmp_path)
    cluster.start()
    try:
        await cluster.wait_ready()
        assert (await cluster.data("a", "PUT", "/data/ranged/t/first", {"v": 0}))[0] == 200
        await cluster.wait_converged("ranged", ["a", "b"], timeout=60, expect_count=1)
        unharmed = await Unharmed.of(cluster, "a")
        values = [
            hashlib.sha256(str(seed).encode()).hexdigest() * (size // 64) for seed, size in ((1, 8 * MIB), (2, MIB))
        ]
        refs = [blobs.ref_of(msgspec.msgpack.encode(value)) for value in values]
        await _put(cluster, "a", "/data/ranged/t/big", values[0])
        await cluster.wait_converged("ranged", ["a", "b"], timeout=60, expect_count=2)
        series = "replicator_blob_check_bytes_total"

        async def hashed_once() -> bool:
            return await _metric(cluster, "a", series, database="ranged") >= refs[0].size

        await wait_for(hashed_once, 60, "a to count the hash of the blob it served b")

        await _register(cluster, "mallet", "wss://127.0.0.1:9", replicates=False)
        context = _mallet_client(cluster, tmp_path / "mallet")
        url = f"{cluster['a'].data_url}/replication/blobs/ranged/{refs[0].hex}"
        tail = msgspec.msgpack.encode(values[0])[-4:]

        async def last_bytes() -> tuple[int, bytes]:
            headers = {"Range": f"bytes={refs[0].size - 4}-"}
            async with cluster.http.get(url, ssl=context, headers=headers) as response:
                return response.status, await response.read()

        async def allowed() -> bool:
            return (await last_bytes())[0] == 206

        await wait_for(allowed, 60, "mallet's row to reach a's worker")
        for _ in range(200):
            assert await last_bytes() == (206, tail)

        # One more blob, served to b: once its hash is counted, every count the Range requests made was too.
        await _put(cluster, "a", "/data/ranged/t/second", values[1])
        await cluster.wait_converged("ranged", ["a", "b"], timeout=60, expect_count=3)

        async def both() -> float | None:
            found = await _metric(cluster, "a", series, database="ranged")
            return found if found >= refs[0].size + refs[1].size else None

        assert await wait_for(both, 60, "a to count the second blob's hash") == refs[0].size + refs[1].size

        # Damaged on disk since (a rewrite changes the file's times): hashed again, refused, never served.
        path = _blob_folder(cluster, "a", "ranged") / refs[0].hex
        _damage(path, refs[0].size - 4)
        assert (await last_bytes())[0] == 404
        damaged = [e for e in cluster["a"].events("blob_damaged") if e["hash"] == refs[0].hex]
        assert damaged and damaged[0]["peer"] == "mallet"
        await _still_serving(cluster, unharmed, "after_ranges")
    finally:
        await cluster.close()
