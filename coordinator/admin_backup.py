"""The admin port's backup endpoints, which `replicator backup` reads (`coordinator.backup`).

GET /backup   what a backup of this node holds: {"node", "time", "version", "databases": [{"database", "bytes"}]}
GET /backup/{database}   a snapshot of the database taken now (`coordinator.snapshots`), as one body:

    +----------------------+---------------------------+-----------------------------+
    | 8 bytes: length N     | N bytes: JSON description | the snapshot file's bytes   |
    | (unsigned, big end.)  | (SnapshotHead)            | (SnapshotHead.size of them) |
    +----------------------+---------------------------+-----------------------------+

    The description comes first because it is known only once the copy is made, and the positions of a database
    with many origins do not fit in a header. 503 while MAX_SNAPSHOTS are in progress, 507 without room for the copy.
GET /backup/{database}/blobs   the blob files of the database: {"database", "blobs": [{"name", "size"}]}
GET /backup/{database}/blobs/{sha256}   one blob file, as it is stored (its name is the sha256 of its bytes)

Every one of them needs the admin token (`coordinator.admin_access`): a backup is every record of the node.
"""

from __future__ import annotations

import asyncio
import os
import struct
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from replicator import __version__
from replicator.coordinator.snapshots import MAX_SNAPSHOTS, Busy, NoRoom, Position, Snapshots
from replicator.coordinator.view import AdminView
from replicator.shared import blobs
from replicator.shared.config import NAME_RE
from replicator.shared.store import RefusedFile, UnknownDatabase

HEAD_LENGTH = struct.Struct(">Q")
MAX_HEAD = 64 * 1024 * 1024  # a description of a million origins; the reader refuses more
SEND_CHUNK = 1024 * 1024
_json = msgspec.json.Encoder()


class SnapshotHead(msgspec.Struct, frozen=True):
    """What the body of GET /backup/{database} says of the snapshot before its bytes."""

    database: str
    node: str
    taken_at: float  # the node's wall clock when the copy was made
    size: int
    sha256: str
    owner: str
    recovering: bool
    positions: list[Position]


def _error(status: int, message: str) -> web.Response:
    return web.Response(status=status, body=_json.encode({"error": message}), content_type="application/json")


class BackupEndpoints:
    def __init__(self, node: AdminView) -> None:
        self._node = node
        self._snapshots: Snapshots | None = None  # made on the first snapshot: it clears what a crash left

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/backup", self.manifest)
        app.router.add_get("/backup/{database}", self.snapshot)
        app.router.add_get("/backup/{database}/blobs", self.blob_list)
        app.router.add_get("/backup/{database}/blobs/{name}", self.blob)

    def _data_dir(self) -> Path:
        assert self._node.store is not None
        return self._node.store.data_dir

    async def manifest(self, request: web.Request) -> web.Response:
        store = self._node.store
        assert store is not None
        databases: list[dict[str, Any]] = []
        for name in store.names():
            size = 0
            for suffix in ("", "-wal"):
                try:
                    size += os.stat(f"{store.path(name)}{suffix}").st_size
                except OSError:
                    pass
            databases.append({"database": name, "bytes": size})
        document = {
            "node": self._node.name,
            "time": self._node.wall(),
            "version": __version__,
            "max_snapshots": MAX_SNAPSHOTS,
            "databases": databases,
        }
        return web.Response(body=_json.encode(document), content_type="application/json")

    def _path(self, name: str) -> Path | web.Response:
        store = self._node.store
        assert store is not None
        if not NAME_RE.match(name):
            return _error(400, f"bad database name {name[:80]!r}: use 1 to 64 of A-Z a-z 0-9 _ -")
        try:
            store.database(name)  # a refused file is not copied: it would be restored as it is
        except RefusedFile as exc:
            return _error(503, str(exc))
        except UnknownDatabase:
            return _error(404, f"this node holds no database {name!r}")
        return store.path(name)

    async def snapshot(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["database"]
        path = self._path(name)
        if isinstance(path, web.Response):
            return path
        if self._snapshots is None:
            self._snapshots = Snapshots(self._data_dir())
        try:
            async with self._snapshots.taken(path, name) as taken:
                head = _json.encode(
                    SnapshotHead(
                        database=name,
                        node=self._node.name,
                        taken_at=self._node.wall(),
                        size=taken.size,
                        sha256=taken.sha256,
                        owner=taken.owner,
                        recovering=taken.recovering,
                        positions=taken.positions,
                    )
                )
                response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
                response.content_length = HEAD_LENGTH.size + len(head) + taken.size
                await response.prepare(request)
                await response.write(HEAD_LENGTH.pack(len(head)) + head)
                file = await asyncio.to_thread(Path(taken.path).open, "rb")
                try:
                    while chunk := await asyncio.to_thread(file.read, SEND_CHUNK):
                        await response.write(chunk)
                finally:
                    file.close()
                await response.write_eof()
                return response
        except Busy as exc:
            answer = _error(503, str(exc))
            answer.headers["Retry-After"] = "5"
            return answer
        except NoRoom as exc:
            return _error(507, str(exc))

    async def blob_list(self, request: web.Request) -> web.Response:
        name = request.match_info["database"]
        if isinstance(refused := self._path(name), web.Response):
            return refused
        store = blobs.for_database(self._data_dir(), name)

        def listing() -> list[dict[str, Any]]:
            found = []
            for blob in store.names():
                try:
                    found.append({"name": blob, "size": store.path(blob).stat().st_size})
                except FileNotFoundError:
                    pass
            return found

        found = await asyncio.to_thread(listing)
        return web.Response(body=_json.encode({"database": name, "blobs": found}), content_type="application/json")

    async def blob(self, request: web.Request) -> web.StreamResponse:
        name, blob = request.match_info["database"], request.match_info["name"]
        if isinstance(refused := self._path(name), web.Response):
            return refused
        if not blobs.HEX_RE.match(blob):
            return _error(400, f"not a sha256 in hex: {blob[:80]!r}")
        path = blobs.for_database(self._data_dir(), name).path(blob)
        if not path.is_file():
            return _error(404, f"no blob {blob} in database {name!r}")
        return web.FileResponse(path, headers={"Content-Type": "application/octet-stream"})
