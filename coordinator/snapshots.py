"""Online snapshots of a node's databases, which `replicator backup` fetches over the admin port.

A snapshot is one SQLite online backup (`sqlite3.Connection.backup`) of the database file, taken in a thread through
a read-only connection of its own into `<data_dir>/.snapshots/`, in a single step: one read transaction, so the copy
is the file as of one commit. In WAL mode a reader blocks no writer, so the node keeps serving writes meanwhile; a
backup in several steps would start over whenever another connection commits between two of them, and under steady
writes never end. The positions the manifest records (per origin, complete and top; whether the file was recovering)
are read from the copy itself, so they describe exactly what it holds.

What a snapshot costs is bounded: at most `MAX_SNAPSHOTS` at once on a node (another is refused, `Busy`, 503), none
without room for a copy of the file (`NoRoom`, 507), and its file lives as long as the request: it is removed when
the answer ends, is cut or fails, and whatever a crashed run left in `.snapshots/` is removed when the next one starts
(the node owns its data directory, `shared.data_lock`).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
import shutil
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path

import msgspec

from replicator.shared.store import BUSY_TIMEOUT, SIDECARS

DIRECTORY = ".snapshots"
SUFFIX = ".snapshot"
MAX_SNAPSHOTS = 2
READ_CHUNK = 1024 * 1024


class Busy(Exception):
    """MAX_SNAPSHOTS snapshots are being taken or sent already."""


class NoRoom(Exception):
    """The data directory's file system has no room for a copy of the database."""


class Position(msgspec.Struct, frozen=True):
    origin: str
    complete: int  # every version of the origin up to it is in the copy (or superseded there)
    top: int  # the newest version of the origin in the copy


class Snapshot(msgspec.Struct, frozen=True):
    database: str
    path: str
    size: int
    sha256: str
    owner: str
    recovering: bool  # the file was itself recovering: its own origin is complete only as far as peers confirmed
    positions: list[Position]


def take(source: Path, target: Path, database: str) -> Snapshot:
    """Copy `source` into `target` as of one commit and describe the copy (blocking: run it in a thread). The
    copy is a single file (rollback journal mode); `target` is removed again when this fails."""
    try:
        src = sqlite3.connect(f"{source.absolute().as_uri()}?mode=ro", uri=True, timeout=BUSY_TIMEOUT)
        try:
            dst = sqlite3.connect(target, isolation_level=None)
            try:
                src.backup(dst)
                dst.execute("PRAGMA journal_mode = DELETE").fetchone()
                positions = [
                    Position(origin, int(complete), int(top))
                    for origin, complete, top in dst.execute(
                        "SELECT origin, complete, top FROM origins ORDER BY origin"
                    )
                ]
                meta = dict(dst.execute("SELECT key, value FROM meta WHERE key IN ('owner', 'recovering')"))
            finally:
                dst.close()
        finally:
            src.close()
        hasher = hashlib.sha256()
        size = 0
        with open(target, "rb") as file:
            while chunk := file.read(READ_CHUNK):
                hasher.update(chunk)
                size += len(chunk)
    except BaseException:
        _remove(target)
        raise
    return Snapshot(
        database=database,
        path=str(target),
        size=size,
        sha256=hasher.hexdigest(),
        owner=str(meta.get("owner") or ""),
        recovering=bool(meta.get("recovering")),
        positions=positions,
    )


def _remove(target: Path) -> None:
    for suffix in ("", *SIDECARS):
        with suppress(OSError):
            os.unlink(f"{target}{suffix}")


def _size(path: Path) -> int:
    total = 0
    for suffix in ("", "-wal"):
        with suppress(OSError):
            total += os.stat(f"{path}{suffix}").st_size
    return total


class Snapshots:
    """The snapshots of one node's data directory, at most MAX_SNAPSHOTS at once."""

    def __init__(self, data_dir: Path, limit: int = MAX_SNAPSHOTS) -> None:
        self.directory = data_dir / DIRECTORY
        self.limit = limit
        self.active = 0
        # What an earlier run left (a crash mid-answer): no snapshot of this run exists yet.
        shutil.rmtree(self.directory, ignore_errors=True)

    @asynccontextmanager
    async def taken(self, source: Path, database: str) -> AsyncIterator[Snapshot]:
        """A snapshot of the database file `source`, its file removed when the block ends (Busy, NoRoom)."""
        if self.active >= self.limit:
            raise Busy(f"{self.active} snapshots are being taken or sent (at most {self.limit} at once); try again")
        self.active += 1
        target = self.directory / f"{database}.{secrets.token_hex(8)}{SUFFIX}"
        try:
            self.directory.mkdir(exist_ok=True)
            needed = _size(source)
            free = shutil.disk_usage(self.directory).free
            if free < needed:
                raise NoRoom(f"{free} bytes free in {self.directory}, a copy of {database!r} needs {needed}")
            work = asyncio.ensure_future(asyncio.to_thread(take, source, target, database))
            try:
                snapshot = await asyncio.shield(work)
            except asyncio.CancelledError:
                # The thread runs on: the slot and the file are freed once it ends, not before.
                await asyncio.gather(work, return_exceptions=True)
                raise
            yield snapshot
        finally:
            _remove(target)
            self.active -= 1
