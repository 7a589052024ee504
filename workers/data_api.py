"""The data API on the node port: records by database, table and id, JSON in and out.

Bad input (a bad name or header, a body that is not JSON, nests too deep, holds a number msgpack cannot, a value too
large, a body that does not arrive in time) is answered 4xx with a message naming what is wrong; it never reaches the
store. A full disk is 507. Values are stored as msgpack, so any JSON value within those limits round-trips.

A value whose msgpack reaches `data.blob_threshold` is written as a blob file first and the record holds a reference
to it (`shared.blobs`); reads return the value itself. A blob that is missing or damaged on this node is a 503 naming
the record, never wrong bytes. Bodies and values are limited to `data.max_value_bytes` (413 beyond). A database whose
file the store refuses (a symbolic link, `shared.store.refusal`) is a 503 naming the file, for reads and writes alike:
it is neither served nor created over.

`answer_errors`, installed on the whole node port, makes whatever else goes wrong a 500 with a JSON reason and one
sampled log line: no request can put a traceback in the log.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import sqlite3
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from replicator.shared import blobs, confirm
from replicator.shared.config import NAME_RE, is_loopback
from replicator.shared.histograms import WRITE_CONFIRM_SECONDS
from replicator.shared.logs import log, where
from replicator.shared.store import (
    BadName,
    DamagedRecord,
    Database,
    DatabaseRemoving,
    RefusedFile,
    TooManyDatabases,
    UnknownDatabase,
)
from replicator.shared.wire import Entry
from replicator.workers import record_history
from replicator.workers.confirm import MAX_WAITING_READS, MAX_WAITING_WRITES, covered
from replicator.workers.context import SYSTEM, WorkerContext

MAX_ID_LENGTH = 1024
MAX_LIST_LIMIT = 10_000
DEFAULT_LIST_LIMIT = 100
# Levels of JSON nesting a body may have. msgspec's decoder recurses and the interpreter's limit is about 1,000
# frames, shared with whatever called it: 999 levels were a RecursionError and a 500 (issue 9).
MAX_DEPTH = 64
# Values are stored as msgpack, whose integers are signed or unsigned 64-bit.
INT_RANGE = "-2**63 to 2**64 - 1"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_json = msgspec.json.Encoder()


class BlobUnavailable(Exception):
    """A record's blob is missing or damaged on this node: the record is not served until the blob is repaired."""

    def __init__(self, database: str, entry: Entry, ref: blobs.Ref) -> None:
        super().__init__(
            f"record {entry.table}/{entry.id[:200]} of database {database!r} holds a blob (sha256 {ref.hex}, {ref.size}"
            f" bytes) that is missing or damaged on this node; it is served again once repaired from a peer"
            f" (replicator repair-blobs {database})"
        )
        self.database = database
        self.ref = ref


def _error(status: int, message: str) -> web.Response:
    return web.Response(status=status, body=_json.encode({"error": message}), content_type="application/json")


def _ok(payload: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=_json.encode(payload), content_type="application/json")


TOKEN_HEADER = "X-Replicator-Token"
AFTER_HEADER = "X-Replicator-After"
CONFIRM_HEADER = "X-Replicator-Confirm"


class BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def decode_body(raw: bytes) -> Any:
    """The JSON value of a request body; BadRequest naming what is wrong with it."""
    try:
        value = msgspec.json.decode(raw)
    except RecursionError:
        raise BadRequest(400, f"body nests deeper than {MAX_DEPTH} levels of arrays and objects") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(400, f"body is not valid JSON: {exc}") from None
    # A body cannot nest deeper than it has brackets: most are checked by counting, without a walk.
    if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH and _nests_deeper(value, MAX_DEPTH):
        raise BadRequest(400, f"body nests deeper than {MAX_DEPTH} levels of arrays and objects")
    return value


def _nests_deeper(value: Any, limit: int) -> bool:
    """Whether a decoded JSON value has arrays or objects more than `limit` levels deep (iterative: the depth is the
    input's). One level at a time, by exact type (JSON decodes to plain dicts and lists): every bulk body is walked,
    and this way costs 0.2 µs per record instead of 0.5."""
    level = [value] if value.__class__ is dict or value.__class__ is list else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        below = []
        for item in level:
            for child in item.values() if item.__class__ is dict else item:
                if child.__class__ is dict or child.__class__ is list:
                    below.append(child)
        level = below
    return False


def encode_value(value: Any, limit: int) -> bytes:
    """A decoded JSON value as stored (msgpack); BadRequest when it cannot be, or is over `limit` bytes."""
    try:
        data = msgspec.msgpack.encode(value)
    except OverflowError:
        raise BadRequest(400, f"a number is out of range: integers must lie in {INT_RANGE} (64 bits)") from None
    if len(data) > limit:
        raise BadRequest(413, f"value of {len(data)} bytes exceeds the limit of {limit}")
    return data


def check_id(record_id: str, prefix: str = "") -> str:
    """A record id as the store takes it: 1 to MAX_ID_LENGTH characters of valid Unicode (`prefix` starts the
    message: which item of a batch)."""
    if not record_id or len(record_id) > MAX_ID_LENGTH:
        raise BadRequest(400, f"{prefix}bad id: 1 to {MAX_ID_LENGTH} characters")
    if not record_id.isascii():
        try:
            record_id.encode()
        except UnicodeEncodeError:
            raise BadRequest(400, f"{prefix}bad id: not valid Unicode text") from None
    return record_id


def authorization_refusal(header: str | None, token: str) -> str | None:
    """Why a request with this Authorization header is refused when the data API's token is `token` ("" for
    none); None when it is let in. Compared in constant time, as bytes: the header may hold anything."""
    if not token:
        return None
    if header is None:
        return "a bearer token is required (Authorization: Bearer <token>)"
    if not header.isascii():
        # A header's bytes that are not ASCII (or not UTF-8 at all) can never match a token; say so.
        return "the Authorization header is not ASCII text; a bearer token is required (Authorization: Bearer <token>)"
    if not hmac.compare_digest(header.encode(), f"Bearer {token}".encode()):
        return "a bearer token is required (Authorization: Bearer <token>); the one given does not match"
    return None


def _disk_full(exc: BaseException) -> bool:
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", None)
        return (code is not None and code & 0xFF == sqlite3.SQLITE_FULL) or "disk is full" in str(exc)
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def _busy(exc: BaseException) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    return isinstance(exc, sqlite3.OperationalError) and code is not None and code & 0xFF == sqlite3.SQLITE_BUSY


@web.middleware
async def answer_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure on the node port is an answer with a JSON reason, never a traceback in the log.

    An HTTP error that aiohttp raises (404, 405, 413) keeps its status. Any other exception is a 500 naming only
    its type, and one `request_failed` warning, sampled by type and place.
    """
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = _error(exc.status, exc.text or exc.reason)
        for name in ("Allow", "Retry-After", "WWW-Authenticate"):
            if name in exc.headers:
                response.headers[name] = exc.headers[name]
        return response
    except (ConnectionResetError, ConnectionAbortedError, BrokenPipeError):
        # The client went away mid-request: there is nobody to answer and nothing wrong here.
        log.debug("request_aborted", method=request.method, path=request.path[:200])
        return _error(500, "connection lost")
    except Exception as exc:
        error_type = type(exc).__name__
        log.warning(
            "request_failed",
            method=request.method,
            path=request.path[:200],
            error_type=error_type,
            where=where(exc),
            sample_by=("error_type", "where"),
        )
        if request.writer.output_size > 0 and request.transport is not None:
            request.transport.close()  # an answer was under way: another cannot follow it on this connection
        return _error(500, f"internal error ({error_type})")


class DataApi:
    def __init__(self, ctx: WorkerContext) -> None:
        self._ctx = ctx
        self._reads_waiting = 0  # reads waiting for their token here now
        self._history_turns = asyncio.Semaphore(record_history.HISTORY_AT_ONCE)

    def routes(self) -> list[web.RouteDef]:
        return [
            web.put("/data/{database}/{table}/{id}", self._guard(self.put)),
            web.get("/data/{database}/{table}/{id}", self._guard(self.get)),
            web.delete("/data/{database}/{table}/{id}", self._guard(self.delete)),
            web.post("/data/{database}/{table}", self._guard(self.post_batch)),
            web.get("/data/{database}/{table}", self._guard(self.list)),
        ]

    def _guard(
        self, handler: Callable[[web.Request], Awaitable[web.Response]]
    ) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def guarded(request: web.Request) -> web.Response:
            refusal = authorization_refusal(request.headers.get("Authorization"), self._ctx.config.data.token)
            if refusal is not None:
                response = _error(401, refusal)
                response.headers["WWW-Authenticate"] = "Bearer"
                return response
            try:
                return await handler(request)
            except confirm.Refused as exc:
                return _error(400, str(exc))
            except BadRequest as exc:
                response = _error(exc.status, exc.message)
                if exc.status in (408, 413):
                    response.force_close()  # the rest of the body may still be on its way
                return response
            except BadName as exc:
                return _error(400, str(exc))
            except DatabaseRemoving as exc:
                # The database was deleted and its file is leaving this node, for a moment (coordinator.drops).
                response = _error(503, str(exc))
                response.headers["Retry-After"] = "1"
                return response
            except RefusedFile as exc:
                # The file is there but will not be opened until an operator replaces it (logged once by the store).
                return _error(503, str(exc))
            except UnknownDatabase as exc:
                return _error(404, str(exc))
            except BlobUnavailable as exc:
                log.warning(
                    "blob_unavailable",
                    database=exc.database,
                    hash=exc.ref.hex,
                    reason=str(exc),
                    sample_by=("database",),
                )
                response = _error(503, str(exc))
                response.headers["Retry-After"] = "60"
                return response
            except DamagedRecord as exc:
                # Never the damaged bytes: the error names the record, and a peer's copy replaces it.
                interval = self._ctx.config.replication.antientropy_interval
                response = _error(503, str(exc))
                response.headers["Retry-After"] = str(max(1, round(interval)))
                return response
            except (sqlite3.Error, OSError) as exc:
                database = request.match_info.get("database", "")
                if _disk_full(exc):
                    log.warning("disk_full", database=database, error=str(exc), sample_by=())
                    return _error(507, "the node's disk is full: nothing was written (reads still work)")
                if _busy(exc):
                    response = _error(503, f"database {database!r} is busy; try again")
                    response.headers["Retry-After"] = "1"
                    return response
                raise

        return guarded

    def _names(self, request: web.Request, *, write: bool) -> tuple[str, str]:
        database = request.match_info["database"]
        table = request.match_info["table"]
        for kind, name in (("database", database), ("table", table)):
            if not NAME_RE.fullmatch(name):
                raise BadRequest(400, f"bad {kind} name {name[:80]!r}: use 1 to 64 of A-Z a-z 0-9 _ -")
        if write and database == SYSTEM:
            raise BadRequest(403, "the system database is written through the admin API (/nodes)")
        return database, table

    def _id(self, request: web.Request) -> str:
        return check_id(request.match_info["id"])

    def _database(self, name: str, *, write: bool) -> Database:
        try:
            return self._ctx.database(name)
        except RefusedFile:
            raise
        except UnknownDatabase:
            if not write:
                raise
        self._may_create(name)
        try:
            return self._ctx.database(name, create=True)
        except TooManyDatabases as exc:
            # Another process of the node took the last place since `_may_create` counted (the store decides).
            raise BadRequest(409, str(exc)) from None

    def _may_create(self, name: str) -> None:
        """BadRequest when this client may not create the database `name`."""
        config = self._ctx.config
        if not config.data.token and not is_loopback(config.listen.host):
            raise BadRequest(403, "creating a database needs data.token set: this node listens beyond loopback")
        limit = config.data.max_databases
        held = sum(1 for other in self._ctx.store.names() if other != SYSTEM)
        if held >= limit:
            raise BadRequest(409, str(TooManyDatabases(name, held, limit)))

    def _encode_value(self, value: Any) -> bytes:
        return encode_value(value, self._ctx.config.data.max_value_bytes)

    def _blobs(self, database: str) -> blobs.BlobStore:
        return blobs.for_database(self._ctx.store.data_dir, database)

    def _inline_limit(self) -> int:
        """The largest value's msgpack a record holds itself: below `data.blob_threshold`, and at most a quarter of a
        replication frame (a value inline travels inside one), whatever the threshold."""
        config = self._ctx.config
        return min(config.data.blob_threshold - 1, config.replication.max_frame_bytes // 4)

    async def _stored(self, database: str, data: bytes) -> bytes:
        """What a record stores for a value's msgpack: the value itself, or the reference to the blob it was just
        written to (durably, before the record is)."""
        if len(data) <= self._inline_limit():
            return data
        ref = await asyncio.to_thread(self._blobs(database).write, data)
        return blobs.reference(ref)

    async def _value(self, database: str, entry: Entry) -> tuple[Any, int]:
        """A record's value as the client wrote it (read from its blob when it has one), and the bytes read."""
        ref = blobs.parse(entry.value)
        if ref is None:
            return msgspec.msgpack.decode(entry.value), 0
        data = await asyncio.to_thread(self._blobs(database).read, ref)
        if data is None:
            raise BlobUnavailable(database, entry, ref)
        return msgspec.msgpack.decode(data), len(data)

    async def _read_body(self, request: web.Request) -> bytes:
        """The whole body, at most data.max_value_bytes (aiohttp's client_max_size is the replication frame's)."""
        limit = self._ctx.config.data.max_value_bytes
        too_large = f"the body exceeds the limit of {limit} bytes (data.max_value_bytes)"
        if request.content_length is not None and request.content_length > limit:
            raise BadRequest(413, too_large)
        body = bytearray()
        while chunk := await request.content.readany():
            body.extend(chunk)
            if len(body) > limit:
                raise BadRequest(413, too_large)
        return bytes(body)

    async def _body(self, request: web.Request) -> Any:
        timeout = self._ctx.config.listen.request_timeout
        try:
            async with asyncio.timeout(timeout):
                raw = await self._read_body(request)
        except TimeoutError:
            raise BadRequest(408, f"the body did not arrive within listen.request_timeout ({timeout:g} s)") from None
        except (ConnectionError, web.RequestPayloadError) as exc:
            raise BadRequest(400, f"the body could not be read: {exc}") from None
        return decode_body(raw)

    def _written(self, database: str, count: int) -> None:
        self._ctx.counters.inc("replicator_records_written_total", database, value=count)

    @staticmethod
    def _record(entry: Entry, value: Any) -> dict[str, Any]:
        return {"id": entry.id, "value": value, "version": entry.version, "origin": entry.origin}

    # -- confirmations and session tokens (shared.confirm) -------------------------------------------------------

    def _confirmation(self, request: web.Request, database: str) -> tuple[int, float]:
        """How many other nodes a write must reach before its answer, and for how long it may wait: checked before
        anything is written (a spec that cannot be met is a 400, not a write left waiting)."""
        data = self._ctx.config.data
        if "confirm" in request.query:
            spec = confirm.parse_spec(request.query["confirm"], "confirm")
        elif CONFIRM_HEADER in request.headers:
            spec = confirm.parse_spec(request.headers[CONFIRM_HEADER], CONFIRM_HEADER)
        else:
            spec = data.confirm
        timeout = confirm.parse_timeout(request.query.get("timeout"), data.confirm_timeout)
        if spec == 0:
            return 0, timeout
        holders = confirm.holders_of(self._ctx.config, self._ctx.registry(), database)
        need = confirm.needed(spec, len(holders), database)
        if need and self._ctx.waiters.full():
            raise BadRequest(503, f"{MAX_WAITING_WRITES} writes wait for confirmations here already: nothing written")
        return need, timeout

    async def _written_answer(
        self, database: str, payload: dict[str, Any], version: int | None, need: int, timeout: float
    ) -> web.Response:
        """A write's answer once it is committed here: its token, and once `need` other nodes hold it (or a 504 at
        `timeout` that says what is committed and how far it got, so a client can retry it idempotently)."""
        if version is None:  # nothing was written (an empty batch)
            return _ok({**payload, "confirmed": 0} if need else payload)
        token = confirm.format_token({self._ctx.node: version})
        if need:
            started = asyncio.get_running_loop().time()
            outcome = await self._ctx.waiters.wait(database, self._ctx.node, version, need, timeout)
            if not outcome.done or outcome.gone or outcome.confirmed < need:
                self._ctx.counters.inc("replicator_write_confirm_timeouts_total", database)
                why = (
                    f"database {database!r} was removed from this node while the write waited"
                    if outcome.gone
                    else f"{outcome.confirmed} of {need} confirmations arrived within {timeout:g} s"
                )
                response = _ok(
                    {
                        **payload,
                        "error": f"the write is committed on {self._ctx.node} but not confirmed: {why}",
                        "committed": True,
                        "confirmed": outcome.confirmed,
                        "needed": need,
                        "nodes": outcome.nodes,
                        "token": token,
                    },
                    status=504,
                )
                response.headers[TOKEN_HEADER] = token
                return response
            elapsed = asyncio.get_running_loop().time() - started
            self._ctx.counters.observe(WRITE_CONFIRM_SECONDS, elapsed)
            payload = {**payload, "confirmed": outcome.confirmed, "nodes": outcome.nodes}
        response = _ok(payload)
        response.headers[TOKEN_HEADER] = token
        return response

    async def _after(self, request: web.Request, database: str, db: Database) -> web.Response | None:
        """A read with a session token waits until this node covers it: None then, else the 504 naming what is
        missing."""
        header = request.headers.get(AFTER_HEADER)
        if header is None:
            return None
        token = confirm.parse_token(header)
        timeout = confirm.parse_timeout(request.query.get("timeout"), self._ctx.config.data.confirm_timeout)
        if self._reads_waiting >= MAX_WAITING_READS:
            raise BadRequest(503, f"{MAX_WAITING_READS} reads wait for their tokens here already; try again")
        self._reads_waiting += 1
        try:
            missing = await covered(db, self._ctx.feeds.get(database), token, timeout)
        finally:
            self._reads_waiting -= 1
        if not missing:
            return None
        self._ctx.counters.inc("replicator_read_after_timeouts_total", database)
        behind = ", ".join(f"{origin} up to {token[origin]} (holds {held})" for origin, held in sorted(missing.items()))
        return _ok(
            {
                "error": f"{self._ctx.node} does not hold database {database!r} as far as the token yet"
                f" (waited {timeout:g} s): it lacks {behind}",
                "missing": {origin: {"wanted": token[origin], "held": held} for origin, held in missing.items()},
            },
            status=504,
        )

    async def put(self, request: web.Request) -> web.Response:
        database, table = self._names(request, write=True)
        record_id = self._id(request)
        data = self._encode_value(await self._body(request))
        need, timeout = self._confirmation(request, database)
        db = self._database(database, write=True)
        version = db.put(table, record_id, await self._stored(database, data))
        self._written(database, 1)
        return await self._written_answer(database, {"id": record_id, "version": version}, version, need, timeout)

    async def get(self, request: web.Request) -> web.Response:
        database, table = self._names(request, write=False)
        record_id = self._id(request)
        db = self._database(database, write=False)
        if (behind := await self._after(request, database, db)) is not None:
            return behind
        try:
            if record_history.wanted(request.query):
                return await self._history(request, database, table, record_id)
        except record_history.BadHistoryQuery as exc:
            raise BadRequest(400, str(exc)) from None
        entry = db.get(table, record_id)
        if entry is None:
            return _error(404, f"no record {record_id!r} in {database}/{table}")
        value, _ = await self._value(database, entry)
        return _ok(self._record(entry, value))

    async def _history(self, request: web.Request, database: str, table: str, record_id: str) -> web.Response:
        """`?history=true`: the record's state and audit entries here (`workers.record_history`)."""
        limit, before = record_history.options(request.query)
        db = self._database(database, write=False)
        wait = self._ctx.config.listen.request_timeout
        try:
            async with asyncio.timeout(wait):
                await self._history_turns.acquire()
        except TimeoutError:
            response = _error(503, f"{record_history.HISTORY_AT_ONCE} history requests are being answered; try again")
            response.headers["Retry-After"] = "1"
            return response
        try:
            history = await asyncio.to_thread(db.history, table, record_id, limit, before=before)
        finally:
            self._history_turns.release()
        if before is None and record_history.absent(history):
            return _error(404, f"no record {record_id!r} in {database}/{table}")
        return _ok(record_history.document(database, table, record_id, history, limit))

    async def delete(self, request: web.Request) -> web.Response:
        database, table = self._names(request, write=True)
        record_id = self._id(request)
        need, timeout = self._confirmation(request, database)
        try:
            db = self._database(database, write=False)
        except UnknownDatabase:
            return _error(404, f"no record {record_id!r} in {database}/{table}")
        version = db.delete(table, record_id)
        if version is None:
            return _error(404, f"no record {record_id!r} in {database}/{table}")
        self._written(database, 1)
        return await self._written_answer(database, {"id": record_id, "version": version}, version, need, timeout)

    async def post_batch(self, request: web.Request) -> web.Response:
        database, table = self._names(request, write=True)
        body = await self._body(request)
        if not isinstance(body, list):
            raise BadRequest(400, 'body must be a JSON array of {"id", "value"} objects')
        need, timeout = self._confirmation(request, database)
        # Every item is checked before anything is written (a blob included). Per item, only what it needs: the
        # common id is checked inline, the message of a bad one is made when it is bad, and only a value too large
        # to be held inline is awaited on its way to a blob (0.2 µs per item instead of 0.6).
        limit = self._ctx.config.data.max_value_bytes
        inline = self._inline_limit()
        items: list[tuple[str, bytes]] = []
        blobs_needed = False
        for index, item in enumerate(body):
            if not isinstance(item, dict) or "value" not in item or not isinstance(record_id := item.get("id"), str):
                raise BadRequest(400, f'item {index}: expected {{"id": string, "value": any}}')
            if not (0 < len(record_id) <= MAX_ID_LENGTH and record_id.isascii()):
                check_id(record_id, f"item {index}: ")
            data = encode_value(item["value"], limit)
            blobs_needed = blobs_needed or len(data) > inline
            items.append((record_id, data))
        version = None
        if items:
            db = self._database(database, write=True)
            if blobs_needed:
                items = [(record_id, await self._stored(database, data)) for record_id, data in items]
            version = max(db.put_many(table, items))
            self._written(database, len(items))
        return await self._written_answer(database, {"count": len(items)}, version, need, timeout)

    async def list(self, request: web.Request) -> web.Response:
        database, table = self._names(request, write=False)
        after = request.query.get("after") or None
        try:
            limit = int(request.query.get("limit", DEFAULT_LIST_LIMIT))
        except ValueError:
            raise BadRequest(400, f"limit must be a whole number, got {request.query.get('limit')!r}") from None
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise BadRequest(400, f"limit must be 1 to {MAX_LIST_LIMIT}, got {limit}")
        db = self._database(database, write=False)
        if (behind := await self._after(request, database, db)) is not None:
            return behind
        entries = db.scan(table, after, limit)
        # A page of blobs could be gigabytes: it ends after the record that takes it past data.max_value_bytes.
        budget = self._ctx.config.data.max_value_bytes
        records = []
        for entry in entries:
            value, size = await self._value(database, entry)
            records.append(self._record(entry, value))
            budget -= size
            if budget < 0:
                break
        return _ok(records)
