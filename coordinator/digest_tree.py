"""The digest tree of a table on the admin port, read-only, for `replicator diff` (`coordinator.diff`):

GET /digest/{database}/{table}/tree?level=L&nodes=N,N,...   the 16 child digests (count, xor) of each node of level L:
    {"database", "table", "level", "nodes", "children": [[[count, xor] x 16] per node]}
GET /digest/{database}/{table}/rows?level=L&nodes=N,N,...   the rows under those nodes:
    {"database", "table", "level", "nodes", "rows": [[id, version, origin, tombstone, checksum or null]]}
    (checksum null: the row is damaged here)

They are the anti-entropy queries `Children` and `Rows` (`shared.antientropy_queries`) asked over plain HTTP with the
admin token, and they cost what those cost the serving end, under the same caps: `check_query` (at most MAX_NODES nodes,
each once, within their level) and `answer` (a rows answer of at most MAX_ROWS rows, refused before any row is read when
the bucket digests count more; at most MAX_SCAN_ROWS rows of the buckets below the stored level). Past a cap the request
is a 400 naming it, never answered in part. The store reads in a thread, in chunks under separate holds of the
connection (`Database._bucket_chunks`), QUERIES_PER_PEER requests at a time (`Admission`, WAITING_PER_PEER more waiting
at most listen.request_timeout, 503 beyond), so the coordinator's loop keeps serving.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
from aiohttp import web

from replicator.coordinator.view import AdminView
from replicator.shared import digests
from replicator.shared.antientropy_queries import (
    QUERIES_PER_PEER,
    WAITING_PER_PEER,
    Admission,
    BadQuery,
    Busy,
    Children,
    Rows,
    answer,
    check_query,
)
from replicator.shared.store import BadName, Database, RefusedFile, UnknownDatabase

TREE = "tree"
ROWS = "rows"
_ADMIN = "admin"  # every admin client shares one set of turns: the port is the operator's
_json = msgspec.json.Encoder()


def tree_query(kind: str, database: str, table: str, query: Mapping[str, str]) -> Children | Rows:
    """The anti-entropy query a request asks (`kind`: TREE or ROWS), checked as a peer's is; BadQuery naming what is
    wrong."""
    text = query.get("level")
    if text is None:
        raise BadQuery(f"level is required: 0 to {digests.MAX_LEVEL}")
    try:
        level = int(text)
    except ValueError:
        raise BadQuery(f"level must be a whole number, got {text[:40]!r}") from None
    listed = query.get("nodes", "")
    try:
        nodes = [int(node) for node in listed.split(",")] if listed else []
    except ValueError:
        raise BadQuery(f"nodes must be whole numbers separated by commas, got {listed[:80]!r}") from None
    if not nodes:
        raise BadQuery("nodes is required: the tree nodes of the level, separated by commas")
    made = Children if kind == TREE else Rows
    checked = check_query(made(database=database, table=table, level=level, nodes=nodes))
    assert isinstance(checked, Children | Rows)
    return checked


def encoded(db: Database, query: Children | Rows) -> bytes:
    """The JSON answer to a checked query: blocking SQLite work, bounded by `answer`'s caps; run in a thread."""
    reply = answer(db, query)
    document: dict[str, Any] = {
        "database": query.database,
        "table": query.table,
        "level": query.level,
        "nodes": query.nodes,
    }
    document.update(msgspec.to_builtins(reply))
    return _json.encode(document)


def _error(status: int, message: str) -> web.Response:
    return web.Response(status=status, body=_json.encode({"error": message}), content_type="application/json")


class DigestTree:
    """The handlers of the two routes, with their turns to read."""

    def __init__(self, node: AdminView) -> None:
        self._node = node
        self._turns = Admission(per_peer=QUERIES_PER_PEER, per_worker=QUERIES_PER_PEER, waiting=WAITING_PER_PEER)

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/digest/{database}/{table}/tree", self.tree),
            web.get("/digest/{database}/{table}/rows", self.rows),
        ]

    async def tree(self, request: web.Request) -> web.Response:
        return await self._ask(request, TREE)

    async def rows(self, request: web.Request) -> web.Response:
        return await self._ask(request, ROWS)

    async def _ask(self, request: web.Request, kind: str) -> web.Response:
        name, table = request.match_info["database"], request.match_info["table"]
        try:
            query = tree_query(kind, name, table, request.query)
        except BadQuery as exc:
            return _error(400, str(exc))
        store = self._node.store
        if store is None:
            return _error(503, "the node has not opened its store yet")
        try:
            db = store.database(name)
        except BadName as exc:
            return _error(400, str(exc))
        except RefusedFile as exc:
            return _error(503, str(exc))
        except UnknownDatabase as exc:
            return _error(404, str(exc))
        try:
            async with self._turns.turn(_ADMIN, self._node.config.listen.request_timeout) as turn:
                body = await turn.run(encoded, db, query)
        except Busy as exc:
            response = _error(503, str(exc))
            response.headers["Retry-After"] = "1"
            return response
        except BadQuery as exc:
            return _error(400, str(exc))
        return web.Response(body=body, content_type="application/json")
