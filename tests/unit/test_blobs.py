"""Blobs: the reference format, the file store (write, verify, resume a partial download), the transfer between a
serving and a fetching end, the data API's handling of large values, and the repair's pacing in virtual time."""

from __future__ import annotations

import asyncio
import io
import json
import os
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given
from hypothesis import strategies as st

from replicator.shared import blobs
from replicator.shared.config import from_mapping
from replicator.shared.logs import EventLog
from replicator.shared.store import Store
from replicator.shared.wire import Entry
from replicator.workers import blob_repair
from replicator.workers import blobs as transfer
from replicator.workers.antientropy import PeerError, Round, local_transport
from replicator.workers.blob_repair import BlobRepair, Missing
from replicator.workers.context import WorkerContext
from replicator.workers.counters import Counters
from replicator.workers.data_api import DataApi, answer_errors
from tests.unit.fakeloop import VirtualTimeLoop

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False), st.text()),
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children)),
    max_leaves=20,
)


def _data(size: int, seed: int = 1) -> bytes:
    return msgspec.msgpack.encode(bytes((seed * 7 + i * 31) % 251 for i in range(size)).hex()[:size])


# -- the reference -------------------------------------------------------------------------------------------------


def test_a_reference_is_43_bytes_and_parses_back() -> None:
    data = _data(5000)
    ref = blobs.ref_of(data)
    value = blobs.reference(ref)
    assert len(value) == blobs.REFERENCE_BYTES == 43
    assert blobs.parse(value) == ref and ref.size == len(data)
    assert isinstance(msgspec.msgpack.decode(value), msgspec.msgpack.Ext)


@given(json_values)
def test_no_json_value_is_taken_for_a_reference(value: Any) -> None:
    assert blobs.parse(msgspec.msgpack.encode(value)) is None


# -- the file store ------------------------------------------------------------------------------------------------


def test_a_written_blob_is_held_verified_and_read_back(tmp_path: Path) -> None:
    store = blobs.for_database(tmp_path, "db")
    data = _data(300_000)
    ref = store.write(data)
    assert store.path(ref) == tmp_path / "db.blobs" / ref.hex
    assert store.has(ref) and store.verify(ref) is None and store.read(ref) == data
    assert store.names() == [ref.hex]
    assert store.write(data) == ref  # content-addressed: the same bytes, the same file
    assert not [path for path in store.directory.iterdir() if path.name.startswith(".tmp-")]


def test_a_damaged_or_missing_blob_is_never_read(tmp_path: Path) -> None:
    store = blobs.for_database(tmp_path, "db")
    data = _data(10_000)
    ref = store.write(data)
    path = store.path(ref)
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size, one bit off
    assert store.has(ref)  # the cheap check sees the size only
    assert store.read(ref) is None
    assert store.verify(ref) == "damaged: its content does not match its sha256"
    store.discard(ref)
    assert store.read(ref) is None and store.verify(ref) == "missing" and not store.has(ref)


def test_a_partial_download_resumes_where_it_stopped(tmp_path: Path) -> None:
    store = blobs.for_database(tmp_path, "db")
    data = _data(100_000)
    ref = blobs.ref_of(data)
    with store.partial(ref) as partial:
        assert partial.offset == 0
        partial.write(data[:40_000])
    with store.partial(ref) as partial:  # a new process, after a cut: the bytes held are hashed again
        assert partial.offset == 40_000 and not partial.complete
        partial.write(data[40_000:])
        assert partial.complete
        partial.finish()
    assert store.read(ref) == data
    assert not store.path(ref).with_name(ref.hex + blobs.PART).exists()


def test_a_partial_download_is_held_by_one_download_at_a_time(tmp_path: Path) -> None:
    store = blobs.for_database(tmp_path, "db")
    ref = blobs.ref_of(_data(1000))
    with store.partial(ref), pytest.raises(blobs.BlobBusy):
        store.partial(ref)
    store.partial(ref).close()  # released


def test_bytes_that_are_not_the_blob_are_dropped(tmp_path: Path) -> None:
    store = blobs.for_database(tmp_path, "db")
    data = _data(1000)
    ref = blobs.ref_of(data)
    with store.partial(ref) as partial:
        partial.write(bytes(len(data)))
        with pytest.raises(blobs.BlobMismatch):
            partial.finish()
        assert partial.offset == 0
        with pytest.raises(blobs.BlobMismatch):
            partial.write(data + b"x")
    assert not store.has(ref)
    assert not store.path(ref).with_name(ref.hex + blobs.PART).exists()  # nothing left to resume


# -- the transfer --------------------------------------------------------------------------------------------------


def _context(tmp_path: Path, name: str, **data: Any) -> WorkerContext:
    config = from_mapping(
        {
            "node": {"name": name, "url": "wss://127.0.0.1:9925", "workers": 1},
            "data": {"token": "t", **data},
            "replication": {"max_frame_bytes": 65536},
        },
        "",
    )
    directory = tmp_path / name
    directory.mkdir()
    return WorkerContext(
        worker_id=0,
        config=config,
        store=Store(directory, name),
        counters=Counters(),
        client_ssl=ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT),
        report=lambda message: None,
    )


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> io.StringIO:
    stream = io.StringIO()
    events = EventLog(stream, level="debug")
    for module in (transfer, blob_repair):
        monkeypatch.setattr(module, "log", events)
    return stream


def _events(stream: io.StringIO, event: str) -> list[dict[str, Any]]:
    return [record for line in stream.getvalue().splitlines() if (record := json.loads(line))["event"] == event]


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[asyncio.AbstractEventLoop, WorkerContext, WorkerContext, str, list[str]]]:
    """A serving node ("a", behind a plain-HTTP test server) and a fetching one ("b"); the Range headers a asked for."""
    serving = _context(tmp_path, "a")
    fetching = _context(tmp_path, "b")
    serving.store.database("db", create=True)
    ranges: list[str] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        ranges.append(request.headers.get("Range", ""))
        return await transfer.serve(serving, request, "b")

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_get("/replication/blobs/{database}/{hash}", handler)
    server = TestServer(app)
    loop.run_until_complete(server.start_server())
    try:
        yield loop, serving, fetching, f"ws://127.0.0.1:{server.port}", ranges
    finally:
        loop.run_until_complete(server.close())
        loop.close()
        serving.store.close()
        fetching.store.close()


def _fetch(loop: asyncio.AbstractEventLoop, ctx: WorkerContext, url: str, ref: blobs.Ref) -> bool:
    async def run() -> bool:
        async with aiohttp.ClientSession() as http:
            store = blobs.for_database(ctx.store.data_dir, "db")
            return await transfer.fetch(ctx, http, url, "db", ref, store, peer="a")

    return loop.run_until_complete(run())


def test_a_fetch_resumes_a_partial_file_with_a_range_request(pair, captured) -> None:  # type: ignore[no-untyped-def]
    loop, serving, fetching, url, ranges = pair
    data = _data(700_000)
    ref = blobs.for_database(serving.store.data_dir, "db").write(data)
    mine = blobs.for_database(fetching.store.data_dir, "db")
    with mine.partial(ref) as partial:
        partial.write(data[:300_000])  # what a cut download left
    assert _fetch(loop, fetching, url, ref)
    assert ranges == ["bytes=300000-"]
    assert mine.read(ref) == data
    assert [(e["resumed_from"], e["size"]) for e in _events(captured, "blob_fetched")] == [(300_000, len(data))]
    assert _fetch(loop, fetching, url, ref) and len(ranges) == 1  # held: nothing asked


def test_a_blob_the_peer_lacks_or_holds_damaged_is_not_fetched(pair) -> None:  # type: ignore[no-untyped-def]
    loop, serving, fetching, url, _ = pair
    data = _data(2000)
    theirs = blobs.for_database(serving.store.data_dir, "db")
    ref = blobs.ref_of(data)
    assert not _fetch(loop, fetching, url, ref)
    theirs.write(data)
    theirs.path(ref).write_bytes(bytes(len(data)))  # damaged there: never served
    assert not _fetch(loop, fetching, url, ref)
    assert not blobs.for_database(fetching.store.data_dir, "db").has(ref)


def test_ensure_applies_past_a_blob_missing_at_the_source_loudly(pair, captured) -> None:  # type: ignore[no-untyped-def]
    loop, serving, fetching, url, _ = pair
    held, lost = _data(3000, 1), _data(3000, 2)
    blobs.for_database(serving.store.data_dir, "db").write(held)
    entries = [
        Entry("t", "held", blobs.reference(blobs.ref_of(held)), 1, "a"),
        Entry("t", "lost", blobs.reference(blobs.ref_of(lost)), 2, "a"),
        Entry("t", "small", msgspec.msgpack.encode(1), 3, "a"),
    ]

    async def run() -> None:
        async with aiohttp.ClientSession() as http:
            await transfer.ensure(fetching, http, "db", url, "a", entries)

    loop.run_until_complete(run())
    assert blobs.for_database(fetching.store.data_dir, "db").read(blobs.ref_of(held)) == held
    (missing,) = _events(captured, "blob_missing")
    assert (missing["level"], missing["peer"], missing["table"], missing["id"]) == ("error", "a", "t", "lost")
    assert missing["hash"] == blobs.ref_of(lost).hex
    assert [(d.name, d.labels, d.value) for d in fetching.counters.drain()] == [
        ("replicator_blobs_missing_total", ["db"], 1.0)
    ]


def test_a_cut_download_keeps_what_arrived_and_the_next_one_resumes(pair, monkeypatch, captured) -> None:  # type: ignore[no-untyped-def]
    loop, serving, fetching, url, ranges = pair
    data = _data(2_000_000)
    ref = blobs.for_database(serving.store.data_dir, "db").write(data)
    mine = blobs.for_database(fetching.store.data_dir, "db")
    write = blobs.Partial.write

    def write_then_cut(partial: blobs.Partial, chunk: bytes) -> None:
        write(partial, chunk)
        task = asyncio.current_task()
        assert task is not None
        task.cancel()  # the session ends (a cut, a shutdown) right after the first chunk landed

    async def cut() -> None:
        async with aiohttp.ClientSession() as http:
            await transfer.fetch(fetching, http, url, "db", ref, mine, peer="a")

    monkeypatch.setattr(blobs.Partial, "write", write_then_cut)
    with pytest.raises(asyncio.CancelledError):
        loop.run_until_complete(cut())
    monkeypatch.setattr(blobs.Partial, "write", write)
    kept = mine.path(ref).with_name(ref.hex + blobs.PART).stat().st_size
    assert 0 < kept < len(data) and not mine.has(ref)
    assert _fetch(loop, fetching, url, ref) and mine.read(ref) == data
    assert ranges == ["", f"bytes={kept}-"]
    assert [e["resumed_from"] for e in _events(captured, "blob_fetched")] == [kept]


# -- the data API --------------------------------------------------------------------------------------------------


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[asyncio.AbstractEventLoop, TestClient, WorkerContext]]:
    ctx = _context(tmp_path, "a", blob_threshold=4096, max_value_bytes=200_000)
    loop = asyncio.new_event_loop()

    async def start() -> TestClient:
        app = web.Application(client_max_size=ctx.config.replication.max_frame_bytes, middlewares=[answer_errors])
        app.router.add_routes(DataApi(ctx).routes())
        client = TestClient(TestServer(app))
        await client.start_server()
        return client

    client = loop.run_until_complete(start())
    try:
        yield loop, client, ctx
    finally:
        loop.run_until_complete(client.close())
        loop.run_until_complete(ctx.feeds.close())
        loop.close()
        ctx.store.close()


def _send(loop: asyncio.AbstractEventLoop, client: TestClient, method: str, path: str, body: Any = None) -> Any:
    async def run() -> tuple[int, Any]:
        data = None if body is None else io.BytesIO(body if isinstance(body, bytes) else json.dumps(body).encode())
        async with client.request(method, path, data=data, headers={"Authorization": "Bearer t"}) as response:
            return response.status, await response.json()

    return loop.run_until_complete(run())


def test_a_large_value_is_a_blob_written_before_its_record_and_read_back_unchanged(api) -> None:  # type: ignore[no-untyped-def]
    loop, client, ctx = api
    value = {"text": "é" * 20_000, "n": [1, 2.5, None]}
    assert _send(loop, client, "PUT", "/data/db/t/big", value)[0] == 200
    entry = ctx.store.database("db").get("t", "big")
    assert entry is not None
    ref = blobs.parse(entry.value)
    assert ref is not None and blobs.for_database(ctx.store.data_dir, "db").has(ref)
    status, record = _send(loop, client, "GET", "/data/db/t/big")
    assert status == 200 and record["value"] == value
    # A batch mixes small values (inline) and large ones (blobs); a listing returns both as written.
    items = [{"id": "s", "value": 1}, {"id": "x", "value": "x" * 10_000}]
    assert _send(loop, client, "POST", "/data/db/u", items) == (200, {"count": 2})
    assert blobs.parse(ctx.store.database("db").get("u", "s").value) is None  # type: ignore[union-attr]
    assert blobs.parse(ctx.store.database("db").get("u", "x").value) is not None  # type: ignore[union-attr]
    status, listing = _send(loop, client, "GET", "/data/db/u")
    assert status == 200 and [(r["id"], r["value"]) for r in listing] == [(i["id"], i["value"]) for i in items]


def test_a_missing_blob_is_a_503_naming_the_record_never_wrong_bytes(api) -> None:  # type: ignore[no-untyped-def]
    loop, client, ctx = api
    assert _send(loop, client, "PUT", "/data/db/t/big", "y" * 20_000)[0] == 200
    ref = blobs.parse(ctx.store.database("db").get("t", "big").value)  # type: ignore[union-attr]
    assert ref is not None
    store = blobs.for_database(ctx.store.data_dir, "db")
    store.path(ref).write_bytes(b"z" * ref.size)  # damaged
    status, answer = _send(loop, client, "GET", "/data/db/t/big")
    assert status == 503
    assert "record t/big of database 'db'" in answer["error"] and ref.hex in answer["error"]
    assert "repair-blobs" in answer["error"]
    store.discard(ref)
    assert _send(loop, client, "GET", "/data/db/t/big")[0] == 503
    assert _send(loop, client, "GET", "/data/db/t")[0] == 503


def test_a_body_or_value_over_max_value_bytes_is_a_413_naming_the_limit(api) -> None:  # type: ignore[no-untyped-def]
    loop, client, _ = api
    status, answer = _send(loop, client, "PUT", "/data/db/t/x", "x" * 250_000)
    assert status == 413 and "limit of 200000 bytes (data.max_value_bytes)" in answer["error"]
    status, answer = _send(
        loop, client, "POST", "/data/db/t", [{"id": str(i), "value": "x" * 50_000} for i in range(5)]
    )
    assert status == 413 and "data.max_value_bytes" in answer["error"]
    # Under the limit and above the replication frame's client_max_size (65,536): taken, as a blob.
    assert _send(loop, client, "PUT", "/data/db/t/x", "x" * 150_000)[0] == 200
    assert _send(loop, client, "GET", "/data/db/t/x")[1]["value"] == "x" * 150_000


# -- the repair's pacing, in virtual time --------------------------------------------------------------------------


def _sweep(loop: VirtualTimeLoop, count: int, repaired: set[str]) -> tuple[blob_repair.Outcome, list[float]]:
    attempts: list[float] = []

    async def fetch(item: Missing) -> str | None:
        attempts.append(loop.time())
        return None if item.id in repaired else "a: does not hold it"

    ref = blobs.Ref(bytes(32), 5000)
    items = [Missing("t", f"r{index}", ref) for index in range(count)]
    outcome = loop.run(BlobRepair("db", fetch, rng=lambda: 0.5, clock=loop.time).run(items))
    return outcome, attempts


def test_the_repair_pauses_between_records_on_the_seed_schedule(loop: VirtualTimeLoop, captured) -> None:  # type: ignore[no-untyped-def]
    outcome, attempts = _sweep(loop, 7, repaired={"r3"})
    # 0.05 -> 1 s, full jitter (a draw of 0.5: half the ceiling); no pause before the first record; a repaired
    # record starts the schedule over.
    assert outcome.delays == pytest.approx([0.025, 0.05, 0.1, 0.025, 0.05, 0.1], abs=1e-12)
    assert attempts == pytest.approx([0.0, 0.025, 0.075, 0.175, 0.2, 0.25, 0.35], abs=1e-12)
    assert outcome.repaired == 1 and [item.id for item, _ in outcome.failed] == ["r0", "r1", "r2", "r4", "r5", "r6"]
    assert [e["id"] for e in _events(captured, "blob_repaired")] == ["r3"]


def test_past_its_60_s_budget_the_repair_goes_on_unpaced_and_warns_once_per_100(
    loop: VirtualTimeLoop, captured
) -> None:  # type: ignore[no-untyped-def]
    outcome, attempts = _sweep(loop, 330, repaired={"r300"})
    delays = outcome.delays
    # Records 1..124 are paced: 0.025, 0.05, 0.1, 0.2, 0.4, then the 1 s ceiling's half, 118 times, and a last pause
    # clamped to what is left of the budget, so that record 124 starts exactly at 60 s.
    assert delays[:5] == pytest.approx([0.025, 0.05, 0.1, 0.2, 0.4], abs=1e-12)
    assert delays[5:123] == [0.5] * 118
    assert delays[123] == pytest.approx(0.225, abs=1e-9)
    assert attempts[124] == 60.0
    # Records 125..300 run unpaced, at 60 s, with a warning at the first and the 101st of them.
    assert outcome.unpaced == 176 and attempts[125:301] == [60.0] * 176
    assert [e["records"] for e in _events(captured, "blob_repair_unpaced")] == [1, 101]
    # Record 300 was repaired: the schedule and its budget start over.
    assert delays[124:] == pytest.approx([0.025, 0.05, 0.1, 0.2, 0.4] + [0.5] * 24, abs=1e-12)
    assert attempts[301] == pytest.approx(60.025, abs=1e-9)
    assert len(delays) == 124 + 29 and outcome.repaired == 1 and len(outcome.failed) == 329


def test_a_damaged_blob_file_counts_as_missing_for_the_repair(tmp_path: Path) -> None:
    store = Store(tmp_path, "a")
    try:
        db = store.database("db", create=True)
        files = blobs.for_database(tmp_path, "db")
        good, bad, gone = (_data(2000, seed) for seed in (1, 2, 3))
        for name, data in (("good", good), ("bad", bad), ("gone", gone)):
            db.put("t", name, blobs.reference(files.write(data)))
        db.put("t", "small", msgspec.msgpack.encode("v"))
        files.path(blobs.ref_of(bad)).write_bytes(bytes(2000 + 5))
        files.discard(blobs.ref_of(gone))
        scanned, missing = asyncio.run(blob_repair.find_missing(db, files))
        assert scanned == 3
        assert [(m.id, m.reason) for m in missing] == [
            ("bad", "damaged: its content does not match its sha256"),
            ("gone", "missing"),
        ]
    finally:
        store.close()
    assert os.path.isdir(tmp_path / "db.blobs")


# -- anti-entropy pulls blobs before it applies ------------------------------------------------------------------


def test_anti_entropy_applies_a_pulled_record_only_once_its_blob_is_safe(tmp_path: Path) -> None:
    stores = [Store(tmp_path / name, name) for name in ("a", "b")]
    a, b = (store.database("d", create=True) for store in stores)
    data = _data(5000)
    a.put("t", "big", blobs.reference(blobs.ref_of(data)))
    a.put("t", "small", msgspec.msgpack.encode(1))
    asked: list[list[str]] = []

    async def lost(entries: list[Entry]) -> None:
        asked.append(sorted(entry.id for entry in entries))
        raise PeerError("blob 1234 from https://a: the link broke")

    result = asyncio.run(Round(b, local_transport(a), rate=1e9, blobs=lost).run())
    assert asked == [["big", "small"]] and result.error.endswith("the link broke")
    assert b.get("t", "big") is None and result.repaired == 0  # nothing of the failed pull was applied

    async def held(entries: list[Entry]) -> None:
        asked.append(sorted(entry.id for entry in entries))

    result = asyncio.run(Round(b, local_transport(a), rate=1e9, blobs=held).run())
    assert result.error == "" and result.repaired == 2 and b.get("t", "big") is not None
    for store in stores:
        store.close()
