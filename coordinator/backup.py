"""`replicator backup --admin URL --out DIR`: a consistent copy of every database of a running node, over its admin
port (`coordinator.admin_backup`), so it may run on another machine than the node.

Each database is one snapshot as of one commit (`coordinator.snapshots`), taken while the node serves, one after
another, with its blob files; each file is written under a temporary name, checked against the size and sha256 the
node gave, fsynced and renamed. The manifest (`coordinator.backup_manifest`) is written last: a backup cut short has
none and `restore` refuses it. `--out` must be a new or empty folder: nothing is ever overwritten.

Progress goes to stderr, one line per database; `--json` prints a summary on stdout. Exit 0 when the backup is whole,
1 when the node cannot be reached or a copy failed, 2 on a usage error (a folder that is not empty).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import msgspec

from replicator import __version__
from replicator.coordinator import admin_url, backup_manifest
from replicator.coordinator.admin_backup import HEAD_LENGTH, MAX_HEAD, SnapshotHead
from replicator.coordinator.admin_client import admin_headers
from replicator.coordinator.backup_manifest import DatabaseEntry, FileEntry, Manifest
from replicator.shared import blobs
from replicator.shared.config import NAME_RE

EXIT_FAILED = 1
EXIT_USAGE = 2
READ_CHUNK = 1024 * 1024
# A snapshot refused because the node takes MAX_SNAPSHOTS already (another backup runs) is asked again, this long.
BUSY_PATIENCE = 600.0
BUSY_PAUSE = 5.0
DEFAULT_TIMEOUT = 3600.0  # seconds per request: a database of many GB arrives within it on a slow link


class Failed(Exception):
    """The backup cannot go on; the message says why."""


async def cmd_backup(
    admin: str,
    out: str,
    *,
    as_json: bool = False,
    token: str = "",
    timeout: float = DEFAULT_TIMEOUT,
    wall: Callable[[], float] = time.time,
    config: str | None = None,
) -> int:
    directory = Path(out)
    if not await asyncio.to_thread(_empty, directory):
        return _fail(f"--out {out}: not an empty folder; a backup goes into a new one, never over files", EXIT_USAGE)
    base = admin_url.trimmed(admin)
    headers = admin_headers(token)
    try:
        async with aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=timeout), headers=headers
        ) as http:
            manifest = await _backup(http, base, directory, wall)
    except aiohttp.InvalidURL:
        return _fail(f"--admin {admin!r} is not a URL (e.g. http://127.0.0.1:9926)", EXIT_USAGE)
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        if (hint := await admin_url.explain(base, exc, config)) is not None:
            return _fail(f"{hint}; {out} holds no backup", EXIT_USAGE)
        return _fail(f"cannot back up through {base}: {exc or type(exc).__name__}; {out} holds no backup", EXIT_FAILED)
    except Failed as exc:
        return _fail(f"{exc}; {out} holds no backup", EXIT_FAILED)
    files = [entry.file for entry in manifest.databases] + [b for entry in manifest.databases for b in entry.blobs]
    summary = {
        "node": manifest.node,
        "time": manifest.time,
        "out": str(directory),
        "manifest": str(directory / backup_manifest.MANIFEST),
        "databases": [
            {"database": entry.database, "bytes": entry.file.size, "blobs": len(entry.blobs)}
            for entry in manifest.databases
        ],
        "files": len(files),
        "bytes": sum(item.size for item in files),
    }
    if as_json:
        print(json.dumps(summary, indent=2, sort_keys=True))
    else:
        print(
            f"backup of node {manifest.node} in {directory}: {len(manifest.databases)} databases, {summary['bytes']}"
            f" bytes in {len(files)} files"
        )
    return 0


async def _backup(http: aiohttp.ClientSession, base: str, directory: Path, wall: Callable[[], float]) -> Manifest:
    async with http.get(f"{base}/backup") as response:
        document = await _json(response, f"{base}/backup")
    try:
        node, began, node_version = str(document["node"]), float(document["time"]), str(document["version"])
        names = [str(item["database"]) for item in document["databases"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise Failed(f"{base}/backup answered an unexpected document ({exc})") from None
    await asyncio.to_thread(directory.mkdir, parents=True, exist_ok=True)
    entries = []
    for name in names:
        if not NAME_RE.match(name):
            raise Failed(f"{base}/backup names a database {name[:80]!r} that is not a database name")
        entry = await _database(http, base, directory, name)
        if entry is None:
            _progress(f"database {name}: deleted on the node meanwhile, not in the backup")
            continue
        entries.append(entry)
        _progress(
            f"database {name}: {entry.file.size} bytes, {len(entry.blobs)} blobs, {len(entry.positions)} origins,"
            f" sha256 {entry.file.sha256[:16]}"
        )
    await asyncio.to_thread(backup_manifest.sync_folder, directory)
    manifest = Manifest(
        format=backup_manifest.FORMAT,
        node=node,
        time=began,
        finished=wall(),
        node_version=node_version,
        version=__version__,
        databases=entries,
    )
    await asyncio.to_thread(backup_manifest.write, directory, manifest)
    return manifest


async def _database(http: aiohttp.ClientSession, base: str, directory: Path, name: str) -> DatabaseEntry | None:
    url = f"{base}/backup/{quote(name)}"
    waited = 0.0
    while True:
        async with http.get(url) as response:
            if response.status == 503 and "Retry-After" in response.headers and waited < BUSY_PATIENCE:
                _progress(f"database {name}: the node takes other snapshots; asking again in {BUSY_PAUSE:g} s")
            elif response.status == 404:
                return None
            elif response.status != 200:
                await _json(response, url)  # raises with the node's reason
            else:
                head = await _head(response, url)
                target = f"{name}.sqlite"
                size, digest = await _receive(response, directory / target, head.size)
                if (size, digest) != (head.size, head.sha256):
                    raise Failed(f"{url}: received {size} bytes of sha256 {digest}, the node sent {head.sha256}")
                break
        await asyncio.sleep(BUSY_PAUSE)  # a pause between two asks, not a wait for a condition
        waited += BUSY_PAUSE
    blob_files = await _blobs(http, base, directory, name)
    return DatabaseEntry(
        database=name,
        taken_at=head.taken_at,
        owner=head.owner,
        recovering=head.recovering,
        positions=head.positions,
        file=FileEntry(target, size, digest),
        blobs=blob_files,
    )


async def _head(response: aiohttp.ClientResponse, url: str) -> SnapshotHead:
    length = HEAD_LENGTH.unpack(await response.content.readexactly(HEAD_LENGTH.size))[0]
    if length > MAX_HEAD:
        raise Failed(f"{url}: a snapshot description of {length} bytes (at most {MAX_HEAD})")
    try:
        return msgspec.json.decode(await response.content.readexactly(length), type=SnapshotHead)
    except msgspec.DecodeError as exc:
        raise Failed(f"{url}: the snapshot description does not decode: {exc}") from None


async def _receive(response: aiohttp.ClientResponse, path: Path, expected: int) -> tuple[int, str]:
    """Write the rest of the answer (at most `expected` bytes) to `path`, through a temporary name, fsynced; its
    size and sha256."""
    sink = await asyncio.to_thread(_Sink, path)
    try:
        async for chunk in response.content.iter_chunked(READ_CHUNK):
            if sink.size + len(chunk) > expected:
                raise Failed(f"{response.url}: more than the {expected} bytes announced")
            await asyncio.to_thread(sink.write, chunk)
        return await asyncio.to_thread(sink.finish)
    finally:
        sink.close()


class _Sink:
    """A file being received: written under a temporary name, renamed into place once fsynced."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._temporary = path.with_name(f".{path.name}.part")
        self._file = open(self._temporary, "wb")  # noqa: SIM115  # closed by close(), after finish or a failure
        self._hasher = hashlib.sha256()
        self.size = 0

    def write(self, chunk: bytes) -> None:
        self._hasher.update(chunk)
        self._file.write(chunk)
        self.size += len(chunk)

    def finish(self) -> tuple[int, str]:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._temporary, self.path)
        return self.size, self._hasher.hexdigest()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
            self._temporary.unlink(missing_ok=True)


def _empty(directory: Path) -> bool:
    """A folder a backup may go into: absent, or an empty folder."""
    return not directory.exists() or (directory.is_dir() and not any(directory.iterdir()))


async def _blobs(http: aiohttp.ClientSession, base: str, directory: Path, name: str) -> list[FileEntry]:
    """Every blob file of the database, listed after its snapshot: a blob is written before the record that refers
    to it commits, so each one the snapshot refers to is there (or damaged, and then the restored node fetches it
    from peers)."""
    url = f"{base}/backup/{quote(name)}/blobs"
    async with http.get(url) as response:
        listing = await _json(response, url)
    found = []
    folder = f"{name}{blobs.SUFFIX}"
    for item in listing.get("blobs", []):
        blob = str(item.get("name", ""))
        if not blobs.HEX_RE.match(blob):
            raise Failed(f"{url} lists a blob {blob[:80]!r} that is not a sha256")
        async with http.get(f"{url}/{blob}") as response:
            if response.status == 404:
                continue  # gone since the listing: not referred to by the snapshot any more
            if response.status != 200:
                await _json(response, f"{url}/{blob}")
            size, digest = await _receive(response, directory / folder / blob, 1 << 62)
        if digest != blob:
            _progress(f"database {name}: blob {blob} is damaged on the node, left out (peers serve it back)")
            await asyncio.to_thread((directory / folder / blob).unlink)
            continue
        found.append(FileEntry(f"{folder}/{blob}", size, digest))
    if found:
        await asyncio.to_thread(backup_manifest.sync_folder, directory / folder)
    return found


async def _json(response: aiohttp.ClientResponse, url: str) -> Any:
    text = await response.text()
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if response.status != 200 or not isinstance(body, dict):
        reason = body.get("error") if isinstance(body, dict) else None
        raise Failed(f"{url} answered {response.status}: {reason or text.strip()[:200]}")
    return body


def _progress(line: str) -> None:
    print(f"replicator backup: {line}", file=sys.stderr, flush=True)


def _fail(message: str, code: int) -> int:
    print(f"replicator backup: {message}", file=sys.stderr)
    return code
