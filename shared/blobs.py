"""Blobs: values at or above `data.blob_threshold`, kept as files beside the database and referenced from the record.

A blob record's stored value is a *reference*, a msgpack extension value (type `EXT_TYPE`) carrying the sha256 and
the size of the value's msgpack bytes: 43 bytes that no JSON value can encode to, so a reference is never taken for
a value and a value never for a reference. The record's checksum, digests and anti-entropy compare references,
which is what they should: equal references mean equal content. The value itself is a file named by its sha256:

    <data_dir>/<database>.blobs/<sha256 hex>          the value's msgpack bytes, complete and verified
    <data_dir>/<database>.blobs/<sha256 hex>.part     a download in progress (resumed where it stopped)
    <data_dir>/<database>.blobs/.tmp-*                a local write in progress

A file reaches its final name only complete: written (or downloaded) under another name, fsynced, renamed, and the
folder fsynced. Content addressing makes every writer of one name write the same bytes, so a rename over an
existing file is harmless. Only one process appends to a `.part` file at a time: it holds an exclusive `flock` on it.

A reference a peer sends may claim any size up to 2^64: no download starts for one above `data.max_value_bytes`
(`too_large`), and a `.part` file never holds more bytes than its reference says (`Partial.write`). The serving end
hashes a file once per version of it, not per request (`Checked`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import os
import re
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import msgspec

from replicator.shared.config import NAME_RE

EXT_TYPE = 7  # the msgpack extension type of a blob reference
SUFFIX = ".blobs"
PART = ".part"
HEX_RE = re.compile(r"^[0-9a-f]{64}\Z")
READ_CHUNK = 1024 * 1024
_SIZE_BYTES = 8
_PAYLOAD = 32 + _SIZE_BYTES
# ext 8 (0xc7), payload length 40, type: every reference starts with these three bytes and is 43 bytes long.
_PREFIX = bytes((0xC7, _PAYLOAD, EXT_TYPE))
REFERENCE_BYTES = len(_PREFIX) + _PAYLOAD


class Ref(NamedTuple):
    """What a blob record stores: the sha256 and the length of the value's msgpack bytes."""

    digest: bytes
    size: int

    @property
    def hex(self) -> str:
        return self.digest.hex()


def reference(ref: Ref) -> bytes:
    """The stored value of a blob record."""
    return msgspec.msgpack.encode(msgspec.msgpack.Ext(EXT_TYPE, ref.digest + ref.size.to_bytes(_SIZE_BYTES, "big")))


def parse(value: bytes) -> Ref | None:
    """The blob a stored value refers to, or None when the value is an ordinary one."""
    if len(value) != REFERENCE_BYTES or not value.startswith(_PREFIX):
        return None
    return Ref(bytes(value[3:35]), int.from_bytes(value[35:], "big"))


def ref_of(data: bytes) -> Ref:
    return Ref(hashlib.sha256(data).digest(), len(data))


def too_large(ref: Ref, limit: int) -> str | None:
    """Why a blob is not fetched for its size (above `data.max_value_bytes`, which no local write may pass either),
    None when its size is within the limit."""
    if ref.size <= limit:
        return None
    return f"blob {ref.hex}: its reference claims {ref.size} bytes, above data.max_value_bytes ({limit})"


class BlobMismatch(Exception):
    """Bytes that do not add up to the blob they are meant to be (size or sha256); nothing was kept."""


class BlobBusy(Exception):
    """Another download of the same blob holds its partial file."""


def for_database(data_dir: str | os.PathLike[str], database: str) -> BlobStore:
    if not NAME_RE.match(database):
        raise ValueError(f"bad database name {database!r}")
    return BlobStore(Path(data_dir) / f"{database}{SUFFIX}")


class BlobStore:
    """The blob files of one database. Stateless beyond its folder: any number of them, in any process, agree."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    def path(self, ref: Ref | str) -> Path:
        name = ref if isinstance(ref, str) else ref.hex
        if not HEX_RE.match(name):
            raise ValueError(f"not a sha256 in hex: {name[:80]!r}")
        return self.directory / name

    def has(self, ref: Ref) -> bool:
        """The blob's file is in place with the right size (cheap: no read; `verify` reads)."""
        try:
            return self.path(ref).stat().st_size == ref.size
        except FileNotFoundError:
            return False

    def verify(self, ref: Ref) -> str | None:
        """Why the blob cannot be served ("missing", or how it is damaged), None when its file is intact."""
        size = self.check(ref.hex)
        if size is None:
            return "missing" if not self.path(ref).exists() else "damaged: its content does not match its sha256"
        if size != ref.size:
            return f"damaged: {size} bytes where the record says {ref.size}"
        return None

    def check(self, name: str) -> int | None:
        """The size of the blob file `name` (a sha256 in hex) when its content matches the name, else None."""
        hasher = hashlib.sha256()
        size = 0
        try:
            with open(self.path(name), "rb") as file:
                while chunk := file.read(READ_CHUNK):
                    hasher.update(chunk)
                    size += len(chunk)
        except FileNotFoundError:
            return None
        return size if hasher.hexdigest() == name else None

    def read(self, ref: Ref) -> bytes | None:
        """The blob's bytes, verified; None when the file is missing or damaged (never wrong bytes)."""
        try:
            data = self.path(ref).read_bytes()
        except FileNotFoundError:
            return None
        return data if len(data) == ref.size and hashlib.sha256(data).digest() == ref.digest else None

    def write(self, data: bytes) -> Ref:
        """Store `data` as a blob (durably, before this returns) and return its reference."""
        ref = ref_of(data)
        if self.has(ref):
            return ref
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, self.path(ref))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
        _sync_folder(self.directory)
        return ref

    def discard(self, ref: Ref) -> None:
        """Remove the blob's file (a damaged one, before it is fetched again)."""
        self.path(ref).unlink(missing_ok=True)

    def discard_partial(self, ref: Ref) -> int:
        """Remove what a download of `ref` left (one that may not be resumed: the blob is above the size limit);
        the bytes freed, 0 when there was none."""
        path = self.path(ref).with_name(ref.hex + PART)
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            return 0
        return size

    def partial(self, ref: Ref) -> Partial:
        """The download of `ref`, resumed from what an earlier one left. BlobBusy while another holds it."""
        self.directory.mkdir(parents=True, exist_ok=True)
        return Partial(self, ref)

    def names(self) -> list[str]:
        """The complete blob files held (their sha256 in hex)."""
        try:
            return sorted(path.name for path in self.directory.iterdir() if HEX_RE.match(path.name))
        except FileNotFoundError:
            return []


class Partial:
    """A blob being downloaded into `<sha256>.part`, under an exclusive lock. `offset` is where to resume.

    `finish` may run on a thread: `close` waits for it, so the descriptor is never closed under a call using it."""

    def __init__(self, store: BlobStore, ref: Ref) -> None:
        self.ref = ref
        self._store = store
        self._mutex = threading.Lock()
        self._path = store.path(ref).with_name(ref.hex + PART)
        self._fd = self._lock()
        self._hasher = hashlib.sha256()
        self.offset = 0
        try:
            self._resume()
        except BaseException:
            self.close()
            raise

    def _lock(self) -> int:
        while True:
            fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise BlobBusy(self.ref.hex) from None
                raise
            # The holder before us may have renamed or removed the file we opened: lock the one at the path.
            try:
                same = os.stat(self._path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return fd
            os.close(fd)

    def _resume(self) -> None:
        size = os.fstat(self._fd).st_size
        if size > self.ref.size:
            self.restart()
            return
        os.lseek(self._fd, 0, os.SEEK_SET)
        while self.offset < size:
            chunk = os.read(self._fd, min(READ_CHUNK, size - self.offset))
            if not chunk:
                break
            self._hasher.update(chunk)
            self.offset += len(chunk)
        os.ftruncate(self._fd, self.offset)
        os.lseek(self._fd, self.offset, os.SEEK_SET)

    def restart(self) -> None:
        """Drop what is held and start from the first byte (the peer did not resume)."""
        os.ftruncate(self._fd, 0)
        os.lseek(self._fd, 0, os.SEEK_SET)
        self._hasher = hashlib.sha256()
        self.offset = 0

    def write(self, chunk: bytes) -> None:
        if self.offset + len(chunk) > self.ref.size:
            self.restart()
            raise BlobMismatch(f"blob {self.ref.hex}: more than the {self.ref.size} bytes it should hold")
        view = memoryview(chunk)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        self._hasher.update(chunk)
        self.offset += len(chunk)

    @property
    def complete(self) -> bool:
        return self.offset == self.ref.size

    def finish(self) -> None:
        """Verify the whole blob, make it durable and give it its final name; BlobMismatch (the partial file is
        dropped) when the bytes are not the blob."""
        with self._mutex:
            self._finish()

    def _finish(self) -> None:
        if self._fd < 0:
            raise BlobMismatch(f"blob {self.ref.hex}: the download was closed")
        if self.offset != self.ref.size or self._hasher.digest() != self.ref.digest:
            got = self.offset
            self.restart()
            raise BlobMismatch(
                f"blob {self.ref.hex}: {got} bytes received that do not match its sha256 and size {self.ref.size}"
            )
        os.fsync(self._fd)
        os.replace(self._path, self._store.path(self.ref))
        _sync_folder(self._store.directory)

    def close(self) -> None:
        """Release the lock; an empty partial file goes (nothing to resume), a started one stays."""
        with self._mutex:
            if self._fd < 0:
                return
            try:
                if self.offset == 0:
                    self._path.unlink(missing_ok=True)
            finally:
                os.close(self._fd)  # releases the flock
                self._fd = -1

    def __enter__(self) -> Partial:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


CHECKED_ENTRIES = 4096  # files whose check `Checked` remembers, per process: about 1 MB at most


class _Version(NamedTuple):
    """One version of a file: a file replaced, rewritten or truncated has another."""

    path: str
    device: int
    inode: int
    size: int
    modified_ns: int
    changed_ns: int


class Checked:
    """What the sha256 check of each blob file found (its size when intact, None when damaged), remembered per
    version of the file: its path, device, inode, size and modification and change times. A file replaced,
    rewritten or truncated since is another version and is hashed again; a file is hashed once per version
    however many requests ask for it, and requests that arrive while it is being hashed wait for that one hash.

    Bounded: the CHECKED_ENTRIES most recently used versions are kept. Bit rot that changes no time is not seen
    here: `BlobStore.read` (the data API) and `BlobStore.verify` (repair-blobs) hash every time, a receiver checks
    the sha256 of every download, and the serving end hashes a whole blob as it sends it (`workers.blobs.serve`),
    calling `forget` when it finds the file damaged."""

    def __init__(self, entries: int = CHECKED_ENTRIES) -> None:
        self._entries = entries
        self._found: OrderedDict[_Version, int | None] = OrderedDict()
        self._running: dict[_Version, asyncio.Future[int | None]] = {}

    def __len__(self) -> int:
        return len(self._found)

    @staticmethod
    def _version(path: Path) -> _Version | None:
        try:
            found = path.stat()
        except FileNotFoundError:
            return None
        return _Version(str(path), found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns, found.st_ctime_ns)

    async def size(self, store: BlobStore, name: str, on_hashed: Callable[[int], None] | None = None) -> int | None:
        """`store.check(name)`, hashed on a thread only when this version of the file was not checked before;
        `on_hashed(bytes)` is told the size of each file hashed. The hash runs to its end, and is remembered,
        even when every request waiting for it has gone."""
        version = self._version(store.path(name))
        if version is None:
            return None
        if version in self._found:
            self._found.move_to_end(version)
            return self._found[version]
        running = self._running.get(version)
        if running is None:
            running = asyncio.ensure_future(asyncio.to_thread(store.check, name))
            self._running[version] = running
            running.add_done_callback(lambda task: self._hashed(version, task, on_hashed))
        return await asyncio.shield(running)

    def _hashed(
        self, version: _Version, task: asyncio.Future[int | None], on_hashed: Callable[[int], None] | None
    ) -> None:
        del self._running[version]
        if task.cancelled() or task.exception() is not None:
            return  # an I/O error: nothing is remembered, the next request hashes again
        if on_hashed is not None:
            on_hashed(version.size)
        self._found[version] = task.result()
        while len(self._found) > self._entries:
            self._found.popitem(last=False)

    def forget(self, store: BlobStore, name: str) -> None:
        """Check the file again at its next request (it was found damaged another way)."""
        path = str(store.path(name))
        for version in [version for version in self._found if version.path == path]:
            del self._found[version]


def _sync_folder(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
