"""What a blob costs against a hostile peer (issue 21): a reference above `data.max_value_bytes` is never fetched, a
download is held to a minimum rate over a window and to a deadline that grows with its size (in virtual time), and
the serving end hashes a file once per version, not per Range request, while still finding a damaged one."""

from __future__ import annotations

import asyncio
import io
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from replicator.shared import blobs, messages
from replicator.shared.config import ConfigError, PeerSection, from_mapping
from replicator.shared.logs import EventLog
from replicator.shared.wire import Entry
from replicator.workers import blob_repair, session
from replicator.workers import blobs as transfer
from replicator.workers.context import WorkerContext
from tests.unit.fakeloop import VirtualTimeLoop
from tests.unit.test_blobs import _context, _data, _events

KIB = 1024


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> io.StringIO:
    stream = io.StringIO()
    events = EventLog(stream, level="debug")
    for module in (transfer, blob_repair):
        monkeypatch.setattr(module, "log", events)
    return stream


# -- the pace of a download, in virtual time -----------------------------------------------------------------------


async def _trickle(loop: VirtualTimeLoop, schedule: list[tuple[float, int]]) -> AsyncIterator[bytes]:
    """Chunks of the given sizes, each arriving at its given (virtual) time."""
    for when, size in schedule:
        await asyncio.sleep(max(0.0, when - loop.time()))
        yield b"x" * size


def _receive(
    loop: VirtualTimeLoop, tmp_path: Path, size: int, schedule: list[tuple[float, int]], **limits: float
) -> tuple[str | None, float, int]:
    """Run `receive` over the schedule for a blob of `size` bytes: the limit it broke, when it returned, and the
    bytes the partial file holds."""
    ref = blobs.Ref(bytes(32), size)
    store = blobs.BlobStore(tmp_path / "db.blobs")
    settings = {"min_rate": 64 * KIB, "window": 30.0, "allowance": 60.0, **limits}
    with store.partial(ref) as partial:
        pace = transfer.Pace(size, now=loop.time(), **settings)
        broken = loop.run_until_complete(transfer.receive(_trickle(loop, schedule), partial, pace, loop.time))
        return broken, loop.time(), partial.offset


def test_a_trickle_is_cut_when_its_first_window_ends_short(loop: VirtualTimeLoop, tmp_path: Path) -> None:
    # 1 KiB every 20 s, as the peer sent: the first 30 s window holds 1 KiB of the 1.875 MiB it needs.
    schedule = [(20.0 * n, KIB) for n in range(1, 100)]
    broken, when, held = _receive(loop, tmp_path, 8 * 1024 * KIB, schedule)
    assert (broken, when, held) == (transfer.LIMIT_MIN_RATE, 30.0, KIB)


def test_a_download_at_the_minimum_rate_passes_every_window(loop: VirtualTimeLoop, tmp_path: Path) -> None:
    # 64 KiB each second, from 0.5 s: the first window holds exactly the minimum, and the 2 MiB arrive at 31.5 s.
    schedule = [(n - 0.5, 64 * KIB) for n in range(1, 33)]
    assert _receive(loop, tmp_path, 2048 * KIB, schedule) == (None, 31.5, 2048 * KIB)


def test_each_window_is_judged_by_its_own_bytes(loop: VirtualTimeLoop, tmp_path: Path) -> None:
    # Plenty in the first window; the second (30 s to 60 s) brings 1 MiB of the 1.875 MiB it needs. A chunk that
    # arrives at the very end of a window counts in the next one.
    schedule = [(1.0, 4096 * KIB), (30.0, 1024 * KIB), (70.0, 4096 * KIB)]
    assert _receive(loop, tmp_path, 16 * 1024 * KIB, schedule) == (transfer.LIMIT_MIN_RATE, 60.0, 5120 * KIB)


def test_a_download_past_its_deadline_is_cut_then(loop: VirtualTimeLoop, tmp_path: Path) -> None:
    # 128 KiB with an allowance of 5 s: the deadline is 5 + 128 KiB / 64 KiB/s = 7 s, before the first window ends;
    # the chunk that arrives at 7 s is too late.
    schedule = [(float(n), 16 * KIB) for n in range(1, 20)]
    broken, when, held = _receive(loop, tmp_path, 128 * KIB, schedule, allowance=5.0)
    assert (broken, when, held) == (transfer.LIMIT_DEADLINE, 7.0, 6 * 16 * KIB)


def test_a_silent_peer_is_cut_without_a_byte(loop: VirtualTimeLoop, tmp_path: Path) -> None:
    assert _receive(loop, tmp_path, 1024 * KIB, [(10_000.0, KIB)], window=10.0) == (transfer.LIMIT_MIN_RATE, 10.0, 0)


def test_the_deadline_scales_with_what_is_left_to_receive() -> None:
    pace = transfer.Pace(640 * KIB, min_rate=64 * KIB, window=30.0, allowance=60.0, now=100.0)
    assert pace.deadline == 170.0 and pace.next_check() == 130.0
    assert pace.check(129.999) is None
    pace.add(30 * 64 * KIB)
    assert pace.check(130.0) is None and pace.next_check() == 160.0
    assert pace.check(160.0) == transfer.LIMIT_MIN_RATE


def test_a_transfer_cut_for_its_pace_is_refused_input_so_the_backoff_is_not_reset() -> None:
    async def run(error: BaseException) -> bool:
        async def fail() -> None:
            raise error

        task = asyncio.ensure_future(fail())
        await asyncio.gather(task, return_exceptions=True)
        return session.refused_input(task)

    assert asyncio.run(run(transfer.TransferAborted("slow", transfer.LIMIT_MIN_RATE)))
    assert not asyncio.run(run(transfer.FetchFailed("the link broke")))


# -- the config ----------------------------------------------------------------------------------------------------

BASE: dict[str, Any] = {"node": {"name": "a", "url": "wss://127.0.0.1:9925", "workers": 1}}


def test_the_blob_limits_have_defaults_an_operator_expects() -> None:
    settings = from_mapping(BASE, "node.toml").replication
    assert (settings.blob_min_rate, settings.blob_rate_window, settings.blob_deadline) == (65536.0, 30.0, 60.0)


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"blob_min_rate": 0.0}, "key 'replication.blob_min_rate': must be a finite number of bytes per second in (0,"),
        ({"blob_rate_window": -1.0}, "key 'replication.blob_rate_window': must be a finite number of seconds in (0,"),
        ({"blob_deadline": float("inf")}, "key 'replication.blob_deadline': must be a finite number of seconds"),
        (
            {"blob_rate": 1000.0},
            "key 'replication.blob_rate': must be 0 (no limit) or at least replication.blob_min_rate (65536 bytes",
        ),
    ],
)
def test_a_blob_limit_that_makes_no_sense_names_the_key(values: dict[str, float], expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        from_mapping({**BASE, "replication": values}, "node.toml")
    assert expected in str(caught.value)


def test_a_serving_rate_cap_at_or_above_the_minimum_rate_is_accepted() -> None:
    config = from_mapping({**BASE, "replication": {"blob_rate": 2000.0, "blob_min_rate": 1000.0}}, "node.toml")
    assert config.replication.blob_rate == 2000.0


# -- the size limit ------------------------------------------------------------------------------------------------


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[asyncio.AbstractEventLoop, WorkerContext, WorkerContext, str, list[str]]]:
    """A serving node ("a", behind a plain-HTTP test server) and a fetching one ("b", max_value_bytes 1 MiB); the
    Range headers a was asked for."""
    serving = _context(tmp_path, "a")
    fetching = _context(tmp_path, "b", max_value_bytes=1024 * KIB)
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


def _counted(ctx: WorkerContext) -> dict[tuple[str, tuple[str, ...]], float]:
    return {(delta.name, tuple(delta.labels)): delta.value for delta in ctx.counters.drain()}


def test_a_reference_above_max_value_bytes_is_never_fetched(pair, captured: io.StringIO) -> None:  # type: ignore[no-untyped-def]
    loop, _, fetching, url, ranges = pair
    huge = blobs.Ref(bytes(range(32)), 2**62)
    mine = blobs.for_database(fetching.store.data_dir, "db")
    mine.directory.mkdir(parents=True)
    left = mine.path(huge).with_name(huge.hex + blobs.PART)
    left.write_bytes(b"x" * 5000)  # what an older version grew, resumed across sessions

    async def run() -> None:
        async with aiohttp.ClientSession() as http:
            await transfer.fetch(fetching, http, url, "db", huge, mine, peer="a")

    with pytest.raises(transfer.BlobRefused) as caught:
        loop.run_until_complete(run())
    assert "claims 4611686018427387904 bytes, above data.max_value_bytes (1048576)" in caught.value.reason
    assert ranges == [] and not left.exists()  # nothing asked, nothing kept
    (event,) = _events(captured, "blob_refused")
    assert (event["level"], event["peer"], event["database"], event["hash"]) == ("warning", "a", "db", huge.hex)
    assert (event["size"], event["limit"], event["partial_removed"]) == (2**62, 1024 * KIB, 5000)
    assert _counted(fetching) == {("replicator_blobs_refused_total", ("a", "db")): 1.0}


def test_a_batch_is_applied_past_a_refused_blob_and_the_blobs_within_the_limit_arrive(pair, captured) -> None:  # type: ignore[no-untyped-def]
    loop, serving, fetching, url, ranges = pair
    theirs = blobs.for_database(serving.store.data_dir, "db")
    fits, over = _data(1000 * KIB, 1), _data(2048 * KIB, 2)
    theirs.write(fits)
    theirs.write(over)  # held there, within a's limit: b's is smaller
    entries = [
        Entry("t", "over", blobs.reference(blobs.ref_of(over)), 1, "a"),
        Entry("t", "fits", blobs.reference(blobs.ref_of(fits)), 2, "a"),
        Entry("t", "small", msgspec.msgpack.encode(1), 3, "a"),
    ]

    async def run() -> None:
        async with aiohttp.ClientSession() as http:
            await transfer.ensure(fetching, http, "db", url, "a", entries)

    loop.run_until_complete(run())  # returns: nothing of the batch is held back
    mine = blobs.for_database(fetching.store.data_dir, "db")
    assert mine.read(blobs.ref_of(fits)) == fits
    assert not mine.has(blobs.ref_of(over)) and mine.names() == [blobs.ref_of(fits).hex]
    assert not mine.path(blobs.ref_of(over)).with_name(blobs.ref_of(over).hex + blobs.PART).exists()
    assert ranges == [""]  # only the blob within the limit was asked for
    (event,) = _events(captured, "blob_refused")
    assert (event["table"], event["id"], event["size"]) == ("t", "over", len(over))
    assert _events(captured, "blob_missing") == []


def test_the_repair_names_a_refused_blob_without_asking_a_peer(tmp_path: Path, captured) -> None:  # type: ignore[no-untyped-def]
    ctx = _context(tmp_path, "b", max_value_bytes=1024 * KIB)
    ctx.config.peers.append(PeerSection(name="a", url="wss://127.0.0.1:9"))  # never asked: nothing listens there
    db = ctx.store.database("db", create=True)
    huge = blobs.Ref(bytes(range(32)), 2**62)
    db.put("t", "huge", blobs.reference(huge))
    request = messages.RepairBlobs(database="db", request=1)

    async def run() -> Any:
        async with aiohttp.ClientSession() as http:
            return await blob_repair.repair_database(ctx, http, request, lambda: 0.5)

    try:
        answer = asyncio.run(run())
    finally:
        ctx.store.close()
    assert (answer.scanned, answer.missing, answer.repaired) == (1, 1, 0)
    (failure,) = answer.failed
    assert failure.id == "huge" and "above data.max_value_bytes (1048576)" in failure.reason


# -- the serving end hashes a file once ----------------------------------------------------------------------------


def _get(loop: asyncio.AbstractEventLoop, url: str, path: str, start: int | None) -> tuple[int, bytes]:
    async def run() -> tuple[int, bytes]:
        headers = {"Range": f"bytes={start}-"} if start is not None else {}
        async with aiohttp.ClientSession() as http, http.get(url + path, headers=headers) as response:
            try:
                return response.status, await response.read()
            except aiohttp.ClientPayloadError:
                return -response.status, b""  # the answer was cut

    return loop.run_until_complete(run())


def test_many_range_requests_hash_the_blob_once(pair, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    loop, serving, _, url, _ = pair
    theirs = blobs.for_database(serving.store.data_dir, "db")
    data = _data(8 * 1024 * KIB)
    ref = theirs.write(data)
    checks: list[str] = []
    check = blobs.BlobStore.check

    def counted(store: blobs.BlobStore, name: str) -> int | None:
        checks.append(name)
        return check(store, name)

    monkeypatch.setattr(blobs.BlobStore, "check", counted)
    path = f"/replication/blobs/db/{ref.hex}"
    base = _base(url)
    for _ in range(200):
        assert _get(loop, base, path, len(data) - 4) == (206, data[-4:])
    assert checks == [ref.hex]
    assert _counted(serving) == {("replicator_blob_check_bytes_total", ("db",)): float(len(data))}

    # Requests that arrive while the file is being hashed wait for that one hash.
    serving.blob_checks = blobs.Checked()
    checks.clear()

    async def together() -> list[int]:
        async with aiohttp.ClientSession() as http:

            async def one() -> int:
                async with http.get(base + path, headers={"Range": f"bytes={len(data) - 4}-"}) as response:
                    await response.read()
                    return response.status

            return await asyncio.gather(*(one() for _ in range(20)))

    assert loop.run_until_complete(together()) == [206] * 20 and checks == [ref.hex]

    # A file rewritten since is another version: hashed again, and a damaged one is never served.
    theirs.path(ref).write_bytes(bytes(len(data)))
    assert _get(loop, base, path, len(data) - 4)[0] == 404
    assert checks == [ref.hex, ref.hex]


def _base(url: str) -> str:
    return "http" + url.removeprefix("ws")


def test_a_file_damaged_after_its_check_is_cut_before_its_last_byte_then_refused(pair, monkeypatch, captured) -> None:  # type: ignore[no-untyped-def]
    loop, serving, fetching, url, _ = pair
    theirs = blobs.for_database(serving.store.data_dir, "db")
    data = _data(700 * KIB)
    ref = theirs.write(data)
    # Bit rot that leaves every time of the file as it was: the remembered check still matches it.
    monkeypatch.setattr(blobs.Checked, "_version", staticmethod(_timeless_version))
    base = _base(url)
    path = f"/replication/blobs/db/{ref.hex}"
    assert _get(loop, base, path, None) == (200, data)
    with open(theirs.path(ref), "r+b") as file:
        file.seek(len(data) - 10)
        file.write(b"rotrotrot!")
    status, _ = _get(loop, base, path, None)
    assert status == -200  # cut: the receiver never holds the whole wrong blob
    assert [e["reason"] for e in _events(captured, "blob_damaged")] == ["its content does not match"]
    assert _get(loop, base, path, None)[0] == 404  # checked again: refused as damaged
    mine = blobs.for_database(fetching.store.data_dir, "db")

    async def fetched() -> bool:
        async with aiohttp.ClientSession() as http:
            return await transfer.fetch(fetching, http, url, "db", ref, mine, peer="a")

    assert loop.run_until_complete(fetched()) is False and not mine.has(ref)


def _timeless_version(path: Path) -> Any:
    try:
        found = path.stat()
    except FileNotFoundError:
        return None
    return blobs._Version(str(path), found.st_dev, found.st_ino, found.st_size, 0, 0)


def test_the_checks_remembered_are_bounded(tmp_path: Path) -> None:
    store = blobs.BlobStore(tmp_path / "db.blobs")
    checked = blobs.Checked(entries=3)
    hashed: list[int] = []

    async def run() -> list[int | None]:
        refs = [store.write(_data(2000, seed)) for seed in range(5)]
        sizes = [await checked.size(store, ref.hex, hashed.append) for ref in refs]
        sizes.append(await checked.size(store, refs[-1].hex, hashed.append))  # remembered
        sizes.append(await checked.size(store, refs[0].hex, hashed.append))  # forgotten: the oldest went
        return sizes

    sizes = asyncio.run(run())
    assert len(checked) == 3 and len(hashed) == 6
    assert all(size == len(_data(2000, 0)) for size in sizes)
    assert asyncio.run(checked.size(store, "0" * 64)) is None  # no such file: nothing hashed, nothing kept
    assert len(hashed) == 6 and os.path.isdir(store.directory)


def test_a_peer_answer_longer_than_the_blob_is_refused_before_a_byte_is_written(tmp_path: Path) -> None:
    # Partial.write is the backstop: a .part file never holds more than its reference says.
    ref = blobs.Ref(bytes(32), 10)
    with blobs.BlobStore(tmp_path / "db.blobs").partial(ref) as partial:
        partial.write(b"x" * 6)
        with pytest.raises(blobs.BlobMismatch):
            partial.write(b"x" * 5)
        assert partial.offset == 0 and os.fstat(partial._fd).st_size == 0
