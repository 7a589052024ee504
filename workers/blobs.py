"""Blob transfer between nodes: blobs travel beside the record stream, over HTTPS on the node port.

    GET /replication/blobs/{database}/{sha256}     [Range: bytes=N-]

The server (`serve`) authorizes the peer like any replication request, verifies the file against its sha256 before
sending a byte (a damaged blob is never served: 404, as a missing one), and streams it in CHUNK pieces; each write
waits for the socket to drain, so TCP's window is the back-pressure, and `replication.blob_rate` optionally caps the
rate. A receiver fetches from the peer it got the reference from (`ensure`), into `<sha256>.part`, resuming with a
Range request where an interrupted download stopped, and renames the file into place only once its size and sha256
are right.

`ensure` is the durability watermark: a batch (or an anti-entropy pull) is applied only once every blob its records
refer to is safe here, so the cursor it advances never passes a record whose blob is still on the way. A download
that fails (the link broke, a timeout) raises `FetchFailed`: the session ends, nothing of the batch is applied, and
the next session resumes the partial file. A blob the peer does not have (404) cannot come from it however long the
stream waits: the record is applied without it, `blob_missing` is logged as an error and counted, and the repair
(`workers.blob_repair`) fetches it later from any peer that has it.
"""

from __future__ import annotations

import asyncio
import re
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from replicator.shared import blobs, wire
from replicator.shared.config import NAME_RE
from replicator.shared.http_errors import error_response, error_text
from replicator.shared.logs import log
from replicator.shared.wire import Entry
from replicator.workers import antientropy
from replicator.workers.context import WorkerContext

CHUNK = 256 * 1024
# A download that receives nothing for this long is cut (the session reconnects and resumes it).
FETCH_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=15.0, sock_read=30.0)
BUSY_WAIT = 0.1  # another download of the same blob holds its partial file: look again this often
PARALLEL_DOWNLOADS = 4  # blobs of one batch downloaded at once
_RANGE = re.compile(r"^bytes=(\d{1,19})-$")
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-\d+/\d+$")


class FetchFailed(wire.SessionError):
    """A blob could not be downloaded (link, timeout, a peer's error, bytes that are not the blob): the batch
    waiting for it is not applied, and the session ends."""

    code = wire.CLOSE_GOING_AWAY


def blob_url(peer_url: str, database: str, ref: blobs.Ref) -> str:
    """Where the peer whose replication URL is `peer_url` (wss://) serves a blob."""
    scheme, _, rest = peer_url.partition("://")
    return f"{'http' if scheme == 'ws' else 'https'}://{rest.rstrip('/')}/replication/blobs/{database}/{ref.hex}"


# -- the receiving end ---------------------------------------------------------------------------------------------


def wanted(ctx: WorkerContext, database: str, entries: list[Entry]) -> list[tuple[Entry, blobs.Ref]]:
    """The blobs the entries refer to that this node does not hold yet, each once."""
    found: dict[bytes, tuple[Entry, blobs.Ref]] = {}
    store: blobs.BlobStore | None = None
    for entry in entries:
        if entry.tombstone:
            continue
        ref = blobs.parse(entry.value)
        if ref is None or ref.digest in found:
            continue
        store = store or blobs.for_database(ctx.store.data_dir, database)
        if not store.has(ref):
            found[ref.digest] = (entry, ref)
    return list(found.values())


async def ensure(
    ctx: WorkerContext,
    http: aiohttp.ClientSession,
    database: str,
    peer_url: str,
    peer: str,
    entries: list[Entry],
) -> None:
    """Return once every blob `entries` refer to is held here or known to be missing at the peer; FetchFailed when a
    download fails. The session's reader goes on meanwhile (answering the sender's pings); the sender's window
    stops it sending more than a few batches ahead."""
    missing = wanted(ctx, database, entries)
    if not missing:
        return
    store = blobs.for_database(ctx.store.data_dir, database)
    limit = asyncio.Semaphore(PARALLEL_DOWNLOADS)

    async def one(entry: Entry, ref: blobs.Ref) -> None:
        async with limit:
            if await fetch(http, ctx.client_ssl, peer_url, database, ref, store, peer=peer):
                return
        ctx.counters.inc("replicator_blobs_missing_total", database)
        log.error(
            "blob_missing",
            peer=peer,
            database=database,
            table=entry.table,
            id=entry.id[:200],
            hash=ref.hex,
            size=ref.size,
            reason="the peer does not hold the blob; the record is applied without it until repair-blobs",
        )

    # A few downloads at a time: one at a time leaves the link idle between a blob's request, its fsync and its
    # rename. The first failure ends the others (their partial files stay, to be resumed).
    downloads = [asyncio.ensure_future(one(entry, ref)) for entry, ref in _unique(missing)]
    try:
        await asyncio.gather(*downloads)
    finally:
        for download in downloads:
            download.cancel()
        await asyncio.gather(*downloads, return_exceptions=True)


def _unique(missing: list[tuple[Entry, blobs.Ref]]) -> list[tuple[Entry, blobs.Ref]]:
    """One download per blob, however many records of the batch refer to it."""
    seen: set[str] = set()
    unique = []
    for entry, ref in missing:
        if ref.hex not in seen:
            seen.add(ref.hex)
            unique.append((entry, ref))
    return unique


def for_round(
    ctx: WorkerContext, http: aiohttp.ClientSession, database: str, peer_url: str, peer: str
) -> Callable[[list[Entry]], Awaitable[None]]:
    """`ensure` for an anti-entropy round with the peer: a download that fails ends the round (PeerError)."""

    async def ensure_round(entries: list[Entry]) -> None:
        try:
            await ensure(ctx, http, database, peer_url, peer, entries)
        except FetchFailed as exc:
            raise antientropy.PeerError(exc.reason) from None

    return ensure_round


async def fetch(
    http: aiohttp.ClientSession,
    client_ssl: ssl.SSLContext,
    peer_url: str,
    database: str,
    ref: blobs.Ref,
    store: blobs.BlobStore,
    *,
    peer: str = "",
) -> bool:
    """Download `ref` from the peer into `store`, resuming what an earlier download left. True once the blob is held
    here, False when the peer does not have it; FetchFailed when the download fails."""
    url = blob_url(peer_url, database, ref)
    while not store.has(ref):
        try:
            partial = await _off_loop(store.partial, ref)
        except blobs.BlobBusy:
            await asyncio.sleep(BUSY_WAIT)  # another session or worker is downloading it: wait for its outcome
            continue
        except OSError as exc:
            raise FetchFailed(f"blob {ref.hex}: cannot write its partial file: {exc}") from None
        try:
            if not await _download(http, client_ssl, url, partial, peer, database):
                return False
        finally:
            partial.close()
    return True


async def _download(
    http: aiohttp.ClientSession, client_ssl: ssl.SSLContext, url: str, partial: blobs.Partial, peer: str, database: str
) -> bool:
    ref = partial.ref
    resumed = partial.offset
    try:
        if not partial.complete:
            headers = {"Range": f"bytes={partial.offset}-"} if partial.offset else {}
            async with http.get(url, ssl=client_ssl, headers=headers, timeout=FETCH_TIMEOUT) as response:
                if response.status == 404:
                    partial.restart()
                    return False
                if response.status == 200:
                    partial.restart()  # the whole blob is coming
                    resumed = 0
                elif response.status == 206:
                    found = _CONTENT_RANGE.match(response.headers.get("Content-Range", ""))
                    if found is None or int(found.group(1)) != partial.offset:
                        raise FetchFailed(f"{url}: a range that does not start at byte {partial.offset}")
                else:
                    text = error_text(await response.content.read(1024))
                    if response.status == 416:
                        partial.restart()
                    raise FetchFailed(f"{url} answered {response.status}: {text}")
                async for chunk in response.content.iter_chunked(CHUNK):
                    partial.write(chunk)
            if not partial.complete:
                raise FetchFailed(f"{url}: the answer ended at byte {partial.offset} of {ref.size}")
        await asyncio.to_thread(partial.finish)
    except blobs.BlobMismatch as exc:
        raise FetchFailed(f"{url}: {exc}") from None
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise FetchFailed(f"blob {ref.hex} from {url}: {exc or type(exc).__name__}") from None
    # One line per blob would flood the log during a catch-up; a resumed download is worth seeing.
    fetched = log.info if resumed else log.debug
    fetched("blob_fetched", peer=peer, database=database, hash=ref.hex, size=ref.size, resumed_from=resumed)
    return True


async def _off_loop(function: Callable[..., blobs.Partial], *args: Any) -> blobs.Partial:
    """`function(*args)` on a thread. A caller cancelled meanwhile stops waiting, but the call runs to its end, and
    the Partial it opened (a descriptor and a lock) is closed then."""
    call = asyncio.ensure_future(asyncio.to_thread(function, *args))
    try:
        return await asyncio.shield(call)
    except asyncio.CancelledError:
        call.add_done_callback(_close_orphan)
        raise


def _close_orphan(call: asyncio.Future[blobs.Partial]) -> None:
    if not call.cancelled() and call.exception() is None:
        call.result().close()


# -- the serving end -----------------------------------------------------------------------------------------------


async def serve(ctx: WorkerContext, request: web.Request, peer: str) -> web.StreamResponse:
    """Stream one blob to an authorized peer, from the byte a Range header asks for."""
    database = request.match_info["database"]
    name = request.match_info["hash"]
    if not NAME_RE.match(database):
        return error_response(400, f"bad database name {database[:80]!r}")
    if not blobs.HEX_RE.match(name):
        return error_response(400, f"bad blob name {name[:80]!r}: a sha256 in lowercase hex")
    if not ctx.replicates(database):
        return error_response(403, f"database {database!r} is not replicated here")
    if not ctx.store.path(database).exists():
        return error_response(404, f"unknown database {database!r}")
    store = blobs.for_database(ctx.store.data_dir, database)
    size = await asyncio.to_thread(store.check, name)
    if size is None:
        if store.path(name).exists():
            log.error("blob_damaged", peer=peer, database=database, hash=name, reason="its content does not match")
        return error_response(404, f"blob {name} of {database} is not held here")
    start = 0
    wanted_range = request.headers.get("Range")
    if wanted_range is not None:
        found = _RANGE.match(wanted_range.strip())
        if found is None:
            return error_response(400, "only Range: bytes=N- is served")
        start = int(found.group(1))
        if start >= size:
            refused = error_response(416, f"the blob has {size} bytes")
            refused.headers["Content-Range"] = f"bytes */{size}"
            return refused
    response = web.StreamResponse(status=206 if start else 200)
    response.content_type = "application/octet-stream"
    response.content_length = size - start
    if start:
        response.headers["Content-Range"] = f"bytes {start}-{size - 1}/{size}"
    rate = ctx.config.replication.blob_rate
    try:
        file = await asyncio.to_thread(open, store.path(name), "rb")
        try:
            await response.prepare(request)
            file.seek(start)
            while chunk := await asyncio.to_thread(file.read, CHUNK):
                await response.write(chunk)  # waits while the peer's window is full
                if rate > 0:
                    await asyncio.sleep(len(chunk) / rate)
        finally:
            file.close()
        await response.write_eof()
    except (ConnectionError, FileNotFoundError) as exc:
        # The peer went away mid-blob (it resumes from what it got), or the file left since it was checked.
        log.debug("blob_serve_ended", peer=peer, database=database, hash=name, error=type(exc).__name__)
        if not response.prepared:
            return error_response(404, f"blob {name} of {database} is not held here")
    return response
