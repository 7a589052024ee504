"""Blob transfer between nodes: blobs travel beside the record stream, over HTTPS on the node port.

    GET /replication/blobs/{database}/{sha256}     [Range: bytes=N-]

The server (`serve`) authorizes the peer like any replication request, verifies the file against its sha256 before
sending a byte (a damaged blob is never served: 404, as a missing one), and streams it in CHUNK pieces; each write
waits for the socket to drain, so TCP's window is the back-pressure, and `replication.blob_rate` optionally caps the
rate. The verification is remembered per version of the file (`shared.blobs.Checked`): a Range request reads the
bytes it asks for, not the whole blob again. An answer from the first byte hashes what it sends, and stops before
its last chunk when the file no longer matches its sha256 (the answer is cut, the file is checked again at the next
request and found damaged). An answer runs at most `replication.blob_deadline` + its bytes / `blob_min_rate`.

A receiver fetches from the peer it got the reference from (`ensure`), into `<sha256>.part`, resuming with a
Range request where an interrupted download stopped, and renames the file into place only once its size and sha256
are right. A reference above `data.max_value_bytes` is never fetched (`BlobRefused`: `blob_refused` is logged and
counted, and the record is applied without its blob, as one the peer lacks). A download is held to its `Pace`: each
`replication.blob_rate_window` must bring `blob_min_rate` x window bytes, and the whole of it must arrive within
`blob_deadline` + its size / `blob_min_rate`; a download that breaks either is cut (`TransferAborted`, logged as
`blob_transfer_aborted` and counted), its partial file kept for the next attempt, which comes on the session's
reconnect backoff: a cut never starts that schedule over (`workers.session.refused_input`).

`ensure` is the durability watermark: a batch (or an anti-entropy pull) is applied only once every blob its records
refer to is safe here, so the cursor it advances never passes a record whose blob is still on the way. A download
that fails (the link broke, a timeout) raises `FetchFailed`: the session ends, nothing of the batch is applied, and
the next session resumes the partial file. A blob the peer does not have (404) cannot come from it however long the
stream waits: the record is applied without it, `blob_missing` is logged as an error and counted, and the repair
(`workers.blob_repair`) fetches it later from any peer that has it. A refused blob takes the same way, logged as
`blob_refused` instead (and the repair refuses it too, until `data.max_value_bytes` is raised).
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from replicator.shared import blobs, wire
from replicator.shared.config import NAME_RE, Config
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


LIMIT_MIN_RATE = "min_rate"
LIMIT_DEADLINE = "deadline"


class FetchFailed(wire.SessionError):
    """A blob could not be downloaded (link, timeout, a peer's error, bytes that are not the blob): the batch
    waiting for it is not applied, and the session ends."""

    code = wire.CLOSE_GOING_AWAY


class BlobRefused(FetchFailed):
    """A blob this node does not fetch at all: its reference claims more bytes than `data.max_value_bytes`. A
    batch is applied past it (the record without its blob); a repair names it as not repaired."""


class TransferAborted(FetchFailed):
    """A download cut for its pace: slower than `replication.blob_min_rate` over a window (`limit` "min_rate"),
    or past its deadline ("deadline"). Its partial file stays, to be resumed by the next attempt."""

    def __init__(self, reason: str, limit: str) -> None:
        super().__init__(reason)
        self.limit = limit


class Pace:
    """The minimum rate and the deadline one download is held to, on the loop's clock (monotonic seconds).

    From `now`, each window of `window` seconds must bring at least `min_rate` x `window` bytes (bytes count in the
    window in which they arrive), and the whole download must end by `now + allowance + remaining / min_rate`.
    The deadline also covers what the windows do not see: the wait for the answer's head, and the final fsync."""

    def __init__(self, remaining: int, *, min_rate: float, window: float, allowance: float, now: float) -> None:
        self.min_rate = min_rate
        self.window = window
        self.started = now
        self.deadline = now + allowance + remaining / min_rate
        self.received = 0
        self.window_bytes = 0  # received in the window in progress
        self._window_end = now + window

    @classmethod
    def of(cls, config: Config, remaining: int, now: float) -> Pace:
        settings = config.replication
        return cls(
            remaining,
            min_rate=settings.blob_min_rate,
            window=settings.blob_rate_window,
            allowance=settings.blob_deadline,
            now=now,
        )

    def next_check(self) -> float:
        """When `check` may next find a limit broken, if no byte arrives before."""
        return min(self._window_end, self.deadline)

    def check(self, now: float) -> str | None:
        """The limit the download has broken by `now` (LIMIT_DEADLINE, LIMIT_MIN_RATE), else None. Call it before
        `add` for bytes that arrived at `now`: they belong to the window in progress at `now`."""
        if now >= self.deadline:
            return LIMIT_DEADLINE
        while now >= self._window_end:
            if self.window_bytes < self.min_rate * self.window:
                return LIMIT_MIN_RATE
            self._window_end += self.window
            self.window_bytes = 0
        return None

    def add(self, count: int) -> None:
        self.received += count
        self.window_bytes += count


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
    """Return once every blob `entries` refer to is held here, known to be missing at the peer, or refused for its
    size; FetchFailed when a download fails. The session's reader goes on meanwhile (answering the sender's
    pings); the sender's window stops it sending more than a few batches ahead."""
    missing = wanted(ctx, database, entries)
    if not missing:
        return
    store = blobs.for_database(ctx.store.data_dir, database)
    limit = asyncio.Semaphore(PARALLEL_DOWNLOADS)

    async def one(entry: Entry, ref: blobs.Ref) -> None:
        try:
            async with limit:
                if await fetch(ctx, http, peer_url, database, ref, store, peer=peer, record=entry):
                    return
        except BlobRefused:
            return  # logged and counted; applied without its blob, as below
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
    ctx: WorkerContext,
    http: aiohttp.ClientSession,
    peer_url: str,
    database: str,
    ref: blobs.Ref,
    store: blobs.BlobStore,
    *,
    peer: str = "",
    record: Entry | None = None,
) -> bool:
    """Download `ref` from the peer into `store`, resuming what an earlier download left. True once the blob is held
    here, False when the peer does not have it; BlobRefused (logged, counted) when its reference claims more than
    `data.max_value_bytes`, FetchFailed when the download fails. `record` is the entry that refers to it, if any,
    named in the log."""
    limit = ctx.config.data.max_value_bytes
    refusal = blobs.too_large(ref, limit)
    if refusal is not None:
        # A partial file can only be an older version's or one from a larger limit: it may never be resumed now.
        freed = await asyncio.to_thread(store.discard_partial, ref)
        ctx.counters.inc("replicator_blobs_refused_total", peer, database)
        log.warning(
            "blob_refused",
            sample_by=("peer", "database"),
            peer=peer,
            database=database,
            hash=ref.hex,
            size=ref.size,
            limit=limit,
            **({"table": record.table, "id": record.id[:200]} if record is not None else {}),
            partial_removed=freed,
            reason="the reference claims more than data.max_value_bytes; the record is kept without its blob",
        )
        raise BlobRefused(refusal)
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
            if not await _download(ctx, http, url, partial, peer, database):
                return False
        finally:
            partial.close()
    return True


async def _download(
    ctx: WorkerContext, http: aiohttp.ClientSession, url: str, partial: blobs.Partial, peer: str, database: str
) -> bool:
    ref = partial.ref
    resumed = partial.offset
    loop = asyncio.get_running_loop()
    pace = Pace.of(ctx.config, ref.size - partial.offset, loop.time())
    within = asyncio.timeout_at(pace.deadline)
    try:
        async with within:
            if not partial.complete:
                headers = {"Range": f"bytes={partial.offset}-"} if partial.offset else {}
                async with http.get(url, ssl=ctx.client_ssl, headers=headers, timeout=FETCH_TIMEOUT) as response:
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
                    announced = response.content_length
                    if announced is not None and announced != ref.size - partial.offset:
                        raise FetchFailed(
                            f"{url}: an answer of {announced} bytes where {ref.size - partial.offset} are missing"
                        )
                    broken = await receive(response.content.iter_chunked(CHUNK), partial, pace, loop.time)
                    if broken is not None:
                        raise _aborted(ctx, pace, broken, url, ref, peer, database, loop.time())
                if not partial.complete:
                    raise FetchFailed(f"{url}: the answer ended at byte {partial.offset} of {ref.size}")
            await asyncio.to_thread(partial.finish)
    except blobs.BlobMismatch as exc:
        raise FetchFailed(f"{url}: {exc}") from None
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        if within.expired():
            raise _aborted(ctx, pace, LIMIT_DEADLINE, url, ref, peer, database, loop.time()) from None
        raise FetchFailed(f"blob {ref.hex} from {url}: {exc or type(exc).__name__}") from None
    # One line per blob would flood the log during a catch-up; a resumed download is worth seeing.
    fetched = log.info if resumed else log.debug
    fetched("blob_fetched", peer=peer, database=database, hash=ref.hex, size=ref.size, resumed_from=resumed)
    return True


async def receive(
    chunks: AsyncIterator[bytes], partial: blobs.Partial, pace: Pace, clock: Callable[[], float]
) -> str | None:
    """Write `chunks` into the partial file as they come, held to `pace`: None once they ended, else the limit the
    download broke (LIMIT_MIN_RATE, LIMIT_DEADLINE), checked when it is due whether or not a chunk arrives."""
    iterator = aiter(chunks)
    read: asyncio.Future[bytes] | None = None
    try:
        while True:
            if read is None:
                read = asyncio.ensure_future(anext(iterator))
            await asyncio.wait({read}, timeout=max(0.0, pace.next_check() - clock()))
            broken = pace.check(clock())
            if broken is not None:
                return broken
            if not read.done():
                continue
            try:
                chunk = read.result()
            except StopAsyncIteration:
                return None
            read = None
            pace.add(len(chunk))
            partial.write(chunk)
    finally:
        if read is not None and not read.done():
            read.cancel()
            await asyncio.gather(read, return_exceptions=True)


def _aborted(
    ctx: WorkerContext, pace: Pace, limit: str, url: str, ref: blobs.Ref, peer: str, database: str, now: float
) -> TransferAborted:
    settings = ctx.config.replication
    elapsed = now - pace.started
    if limit == LIMIT_MIN_RATE:
        reason = (
            f"blob {ref.hex} from {url}: {pace.window_bytes} bytes in {pace.window:g} s, slower than"
            f" replication.blob_min_rate ({pace.min_rate:g} bytes per second)"
        )
    else:
        reason = (
            f"blob {ref.hex} from {url}: not received within {pace.deadline - pace.started:.1f} s"
            f" (replication.blob_deadline {settings.blob_deadline:g} s + its size at blob_min_rate)"
        )
    ctx.counters.inc("replicator_blob_transfers_aborted_total", peer, database)
    log.warning(
        "blob_transfer_aborted",
        sample_by=("peer", "database"),
        peer=peer,
        database=database,
        hash=ref.hex,
        size=ref.size,
        limit=limit,
        received=pace.received,
        elapsed_s=round(elapsed, 3),
        reason=reason,
    )
    return TransferAborted(reason, limit)


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

    def hashed(count: int) -> None:
        ctx.counters.inc("replicator_blob_check_bytes_total", database, value=count)

    size = await ctx.blob_checks.size(store, name, hashed)
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
    settings = ctx.config.replication
    # The receiver cuts an answer slower than this; past it, this end stops holding a file and a task for it.
    deadline = settings.blob_deadline + (size - start) / settings.blob_min_rate
    # From the first byte, what is sent is hashed on the way: a file damaged since it was checked is found before
    # its last chunk goes, so the receiver never holds a whole wrong blob, and is refused at its next request.
    hasher = hashlib.sha256() if start == 0 else None
    try:
        async with asyncio.timeout(deadline):
            file = await asyncio.to_thread(open, store.path(name), "rb")
            try:
                await response.prepare(request)
                file.seek(start)
                sent = start
                while sent < size:
                    chunk = await asyncio.to_thread(file.read, min(CHUNK, size - sent))
                    if not chunk:
                        raise _Damaged(f"the file ends at byte {sent} of {size}")
                    if hasher is not None:
                        hasher.update(chunk)
                        if sent + len(chunk) == size and hasher.hexdigest() != name:
                            raise _Damaged("its content does not match")
                    await response.write(chunk)  # waits while the peer's window is full
                    sent += len(chunk)
                    if settings.blob_rate > 0:
                        await asyncio.sleep(len(chunk) / settings.blob_rate)
            finally:
                file.close()
        await response.write_eof()
    except _Damaged as exc:
        ctx.blob_checks.forget(store, name)
        log.error("blob_damaged", peer=peer, database=database, hash=name, reason=exc.reason)
        _cut(request, response)
        if not response.prepared:
            return error_response(404, f"blob {name} of {database} is not held here")
    except TimeoutError:
        if not response.prepared:
            return error_response(503, f"blob {name} of {database}: not opened within {deadline:.1f} s")
        log.warning(
            "blob_serve_ended",
            sample_by=("peer", "database"),
            peer=peer,
            database=database,
            hash=name,
            error="deadline",
            deadline_s=round(deadline, 3),
        )
        _cut(request, response)
    except (ConnectionError, FileNotFoundError) as exc:
        # The peer went away mid-blob (it resumes from what it got), or the file left since it was checked.
        log.debug("blob_serve_ended", peer=peer, database=database, hash=name, error=type(exc).__name__)
        if not response.prepared:
            return error_response(404, f"blob {name} of {database} is not held here")
    return response


class _Damaged(Exception):
    """The file being served no longer matches what was checked."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _cut(request: web.Request, response: web.StreamResponse) -> None:
    """End an answer before its last byte: the connection is closed, so the receiver sees a short answer, never a
    complete one."""
    response.force_close()
    if request.transport is not None:
        request.transport.close()
