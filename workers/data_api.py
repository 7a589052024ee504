"""The data API on the node port: records by database, table and id, JSON in and out.

Bad input (a bad name, a body that is not JSON, a value too large) is answered 4xx with a message naming what is
wrong; it never reaches the store. Values are stored as msgpack, so any JSON value round-trips.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from shared.config import NAME_RE
from shared.store import BadName, DamagedRecord, Database, UnknownDatabase
from shared.wire import Entry
from workers.context import SYSTEM, WorkerContext

MAX_ID_LENGTH = 1024
MAX_LIST_LIMIT = 10_000
DEFAULT_LIST_LIMIT = 100

_json = msgspec.json.Encoder()


def _error(status: int, message: str) -> web.Response:
    return web.Response(status=status, body=_json.encode({"error": message}), content_type="application/json")


def _ok(payload: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=_json.encode(payload), content_type="application/json")


class BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class DataApi:
    def __init__(self, ctx: WorkerContext) -> None:
        self._ctx = ctx
        self._max_value = ctx.config.replication.max_frame_bytes // 4

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
            token = self._ctx.config.data.token
            if token:
                given = request.headers.get("Authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                    return _error(401, "a bearer token is required (Authorization: Bearer <token>)")
            try:
                return await handler(request)
            except BadRequest as exc:
                return _error(exc.status, exc.message)
            except BadName as exc:
                return _error(400, str(exc))
            except UnknownDatabase as exc:
                return _error(404, str(exc))
            except DamagedRecord as exc:
                # Never the damaged bytes: the error names the record, and a peer's copy replaces it.
                interval = self._ctx.config.replication.antientropy_interval
                response = _error(503, str(exc))
                response.headers["Retry-After"] = str(max(1, round(interval)))
                return response

        return guarded

    def _names(self, request: web.Request, *, write: bool) -> tuple[str, str]:
        database = request.match_info["database"]
        table = request.match_info["table"]
        for kind, name in (("database", database), ("table", table)):
            if not NAME_RE.match(name):
                raise BadRequest(400, f"bad {kind} name {name[:80]!r}: use 1 to 64 of A-Z a-z 0-9 _ -")
        if write and database == SYSTEM:
            raise BadRequest(403, "the system database is written through the admin API (/nodes)")
        return database, table

    def _id(self, request: web.Request) -> str:
        record_id = request.match_info["id"]
        if not record_id or len(record_id) > MAX_ID_LENGTH:
            raise BadRequest(400, f"bad id: 1 to {MAX_ID_LENGTH} characters")
        return record_id

    def _database(self, name: str, *, write: bool) -> Database:
        return self._ctx.database(name, create=write)

    def _encode_value(self, value: Any) -> bytes:
        data = msgspec.msgpack.encode(value)
        if len(data) > self._max_value:
            raise BadRequest(413, f"value of {len(data)} bytes exceeds the limit of {self._max_value}")
        return data

    async def _body(self, request: web.Request) -> Any:
        raw = await request.read()
        try:
            return msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            raise BadRequest(400, f"body is not valid JSON: {exc}") from None

    def _written(self, database: str, count: int) -> None:
        self._ctx.feeds.poke(database)
        self._ctx.counters.inc("replicator_records_written_total", database, value=count)

    @staticmethod
    def _record(entry: Entry) -> dict[str, Any]:
        return {
            "id": entry.id,
            "value": msgspec.msgpack.decode(entry.value),
            "version": entry.version,
            "origin": entry.origin,
        }

    async def put(self, request: web.Request) -> web.Response:
        database, table = self._names(request, write=True)
        record_id = self._id(request)
        value = self._encode_value(await self._body(request))
        version = self._database(database, write=True).put(table, record_id, value)
        self._written(database, 1)
        return _ok({"id": record_id, "version": version})

    async def get(self, request: web.Request) -> web.Response:
        database, table = self._names(request, write=False)
        record_id = self._id(request)
        entry = self._database(database, write=False).get(table, record_id)
        if entry is None:
            return _error(404, f"no record {record_id!r} in {database}/{table}")
        return _ok(self._record(entry))

    async def delete(self, request: web.Request) -> web.Response:
        database, table = self._names(request, write=True)
        record_id = self._id(request)
        try:
            db = self._database(database, write=False)
        except UnknownDatabase:
            return _error(404, f"no record {record_id!r} in {database}/{table}")
        version = db.delete(table, record_id)
        if version is None:
            return _error(404, f"no record {record_id!r} in {database}/{table}")
        self._written(database, 1)
        return _ok({"id": record_id, "version": version})

    async def post_batch(self, request: web.Request) -> web.Response:
        database, table = self._names(request, write=True)
        body = await self._body(request)
        if not isinstance(body, list):
            raise BadRequest(400, 'body must be a JSON array of {"id", "value"} objects')
        items: list[tuple[str, bytes]] = []
        for index, item in enumerate(body):
            if not isinstance(item, dict) or "value" not in item or not isinstance(item.get("id"), str):
                raise BadRequest(400, f'item {index}: expected {{"id": string, "value": any}}')
            record_id = item["id"]
            if not record_id or len(record_id) > MAX_ID_LENGTH:
                raise BadRequest(400, f"item {index}: bad id: 1 to {MAX_ID_LENGTH} characters")
            items.append((record_id, self._encode_value(item["value"])))
        if items:
            self._database(database, write=True).put_many(table, items)
            self._written(database, len(items))
        return _ok({"count": len(items)})

    async def list(self, request: web.Request) -> web.Response:
        database, table = self._names(request, write=False)
        after = request.query.get("after") or None
        try:
            limit = int(request.query.get("limit", DEFAULT_LIST_LIMIT))
        except ValueError:
            raise BadRequest(400, f"limit must be a whole number, got {request.query.get('limit')!r}") from None
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise BadRequest(400, f"limit must be 1 to {MAX_LIST_LIMIT}, got {limit}")
        entries = self._database(database, write=False).scan(table, after, limit)
        return _ok([self._record(entry) for entry in entries])
