"""The files of the data directory: database files checked at boot, and a probe of whether the store can write.

At boot, before any worker opens a database, the coordinator opens every `<name>.sqlite` of the data directory and
checks it: something other than a file in its place, a header that is not SQLite's, a file shorter than its header
says, or `PRAGMA quick_check` (`integrity_check` with `run --check-integrity`) answering anything but "ok". A damaged
file halts the node (exit 3) with a message naming it and what is wrong, since serving from it, or letting a
worker trip over it later, would be worse. With `replication.recover_damaged` it is moved aside, with its -wal and
-shm, to `<data_dir>/damaged/<name>.sqlite.<timestamp>` (`database_moved_aside`); the node then creates the database
empty, which starts it `recovering`, and its peers serve it back.

A file that cannot be checked at all (permissions, a lock another process holds) says nothing about its content:
it is a boot error too, and is never moved aside. A file the store refuses (a symbolic link in place of the file or
of one of its sidecars, `shared.store.refusal`) is not checked either, nor moved: it is not opened, and the store
reports it (`database_file_refused`) while the node serves everything else.

While the node runs, `/readyz` asks a `WriteProbe` whether the store can still write: a full disk, a read-only file
system or a database file that refuses its write lock make the node not ready, with the reason.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from replicator.shared.config import NAME_RE
from replicator.shared.logs import log
from replicator.shared.store import SIDECARS, SUFFIX, refusal

DAMAGED_DIR = "damaged"
HEADER = b"SQLite format 3\x00"
HEADER_SIZE = 100
BUSY_TIMEOUT = 10.0
# A check reports progress every this many SQLite virtual machine steps (about a millisecond's work), so a boot
# checking one large file is seen to be working (coordinator.sd_notify.StartExtension).
PROGRESS_STEPS = 100_000
# Result codes that say the file could not be read, not that its content is wrong (sqlite3.h primary codes).
_CANNOT_TELL = {
    3: "permission denied",  # SQLITE_PERM
    5: "locked by another process",  # SQLITE_BUSY
    6: "locked",  # SQLITE_LOCKED
    7: "out of memory",  # SQLITE_NOMEM
    14: "cannot open",  # SQLITE_CANTOPEN
    23: "not authorized",  # SQLITE_AUTH
}


class Unreadable(Exception):
    """A database file that cannot be checked at all: nothing says it is damaged, so it is never moved aside."""


class DamagedFiles(Exception):
    """Database files are damaged and recover_damaged is off; the message names each one and what is wrong."""


@dataclass(frozen=True)
class Damage:
    database: str
    path: Path
    reason: str
    moved_to: Path | None = None


def database_files(directory: Path) -> list[tuple[str, Path]]:
    """(database, path) of every entry the store would take for a database file, whatever kind of entry it is."""
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        if path.name.endswith(SUFFIX) and NAME_RE.match(path.name[: -len(SUFFIX)]):
            found.append((path.name[: -len(SUFFIX)], path))
    return sorted(found)


def check_file(path: Path, full: bool = False, progress: Callable[[], None] | None = None) -> str | None:
    """What is wrong with the database file at `path`, or None when it is sound (or gone).

    `full`: PRAGMA integrity_check (reads every page and index) instead of quick_check. Raises Unreadable when the
    file cannot be checked. Nothing is followed: a link is not a regular file (`check_databases` leaves the links
    the store refuses to it, unchecked). `progress` is called as the check moves on.
    """
    try:
        info = path.lstat()
    except FileNotFoundError:
        return None
    except PermissionError as exc:
        raise Unreadable(f"database file {path} cannot be checked: {exc.strerror}") from None
    except OSError as exc:
        return f"cannot be looked at: {exc.strerror or exc}"
    if stat.S_ISDIR(info.st_mode):
        return "a directory, not a database file"
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file"
    for suffix in SIDECARS:
        sidecar = Path(f"{path}{suffix}")
        if os.path.lexists(sidecar) and (sidecar.is_symlink() or not sidecar.is_file()):
            return f"its {sidecar.name} is not a regular file"
    if info.st_size == 0:
        return None  # an empty file is an empty database: it is set up and recovered like a new one
    try:
        with path.open("rb") as file:
            header = file.read(HEADER_SIZE)
    except PermissionError as exc:
        raise Unreadable(f"database file {path} cannot be checked: {exc.strerror}") from None
    except OSError as exc:
        return f"cannot be read: {exc.strerror or exc}"
    wrong = _header_problem(path, header, info.st_size)
    if wrong is not None:
        return wrong
    return _pragma_check(path, full, progress)


def _header_problem(path: Path, header: bytes, size: int) -> str | None:
    if len(header) < HEADER_SIZE:
        return f"truncated: {size} bytes, shorter than a database header"
    if header[:16] != HEADER:
        return "not a SQLite database: bad header"
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    if page_size < 512 or page_size & (page_size - 1):
        return f"bad header: page size {page_size}"
    # The size in the header counts only when it was written with the change counter it carries (SQLite's rule);
    # with a -wal holding frames, the pages past the end of the file may still be in the log.
    pages = int.from_bytes(header[28:32], "big")
    wal = Path(f"{path}-wal")
    logged = wal.is_file() and wal.stat().st_size > 0
    if pages and header[24:28] == header[92:96] and not logged and size < pages * page_size:
        return f"truncated: {size} bytes, its header says {pages * page_size}"
    return None


def _pragma_check(path: Path, full: bool, progress: Callable[[], None] | None = None) -> str | None:
    pragma = "integrity_check" if full else "quick_check"
    conn: sqlite3.Connection | None = None
    try:
        conn = sqlite3.connect(
            f"{path.resolve().as_uri()}?mode=rw", uri=True, isolation_level=None, timeout=BUSY_TIMEOUT
        )
        if progress is not None:
            conn.set_progress_handler(lambda: progress() or 0, PROGRESS_STEPS)
        rows = [str(row[0]) for row in conn.execute(f"PRAGMA {pragma}")]
    except sqlite3.Error as exc:
        code = getattr(exc, "sqlite_errorcode", 0) & 0xFF
        if code in _CANNOT_TELL:
            raise Unreadable(f"database file {path} cannot be checked: {_CANNOT_TELL[code]}: {exc}") from None
        return f"{pragma} failed: {exc}"
    finally:
        if conn is not None:
            conn.close()
    if rows == ["ok"]:
        return None
    more = f" (and {len(rows) - 1} more)" if len(rows) > 1 else ""
    return f"{pragma}: {rows[0] if rows else 'no answer'}{more}"


def check_databases(
    directory: Path,
    *,
    full: bool,
    recover: bool,
    wall: Callable[[], float],
    progress: Callable[[], None] | None = None,
) -> tuple[int, list[Damage]]:
    """Check every database file of `directory`: (how many were checked, the damaged ones, now moved aside). A file
    the store refuses (`refusal`) is neither checked nor counted, and never moved. `progress` is called after each
    file and as a check moves on.

    Without `recover`, raises DamagedFiles naming every damaged file; Unreadable for one it cannot check.
    """
    files = [(database, path) for database, path in database_files(directory) if refusal(path) is None]
    damaged = []
    for database, path in files:
        reason = check_file(path, full, progress)
        if reason is not None:
            damaged.append(Damage(database, path, reason))
        if progress is not None:
            progress()
    if damaged and not recover:
        them = "it" if len(damaged) == 1 else "them"
        raise DamagedFiles(
            "; ".join(f"database file {d.path} is damaged: {d.reason}" for d in damaged)
            + f" (move {them} away, or set replication.recover_damaged = true to move {them} aside and recover"
            + f" {them} from peers)"
        )
    moved = []
    for damage in damaged:
        target = move_aside(directory, damage.path, wall)
        log.warning("database_moved_aside", database=damage.database, path=str(target), reason=damage.reason)
        moved.append(Damage(damage.database, damage.path, damage.reason, target))
    return len(files), moved


def move_aside(directory: Path, path: Path, wall: Callable[[], float]) -> Path:
    """Move a database file and its sidecars to `<directory>/damaged/<name>.<UTC timestamp>`; returns the new path.
    The sidecars move first: a -wal left behind would be replayed into the empty file that replaces the damaged one."""
    folder = directory / DAMAGED_DIR
    folder.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(wall()))
    target = folder / f"{path.name}.{stamp}"
    serial = 1
    while any(os.path.lexists(f"{target}{suffix}") for suffix in ("", *SIDECARS)):
        target = folder / f"{path.name}.{stamp}.{serial}"
        serial += 1
    for suffix in SIDECARS:
        if os.path.lexists(f"{path}{suffix}"):
            os.rename(f"{path}{suffix}", f"{target}{suffix}")
    os.rename(path, target)
    return target


# -- while running: can the store write? -------------------------------------------------------------------------

PROBE_BYTES = 64 * 1024  # about what one replicated batch adds to a -wal
PROBE_BUSY_TIMEOUT = 5.0


def probe_write(directory: Path, database: Path, busy_timeout: float = PROBE_BUSY_TIMEOUT) -> str | None:
    """What keeps the store from writing now, or None: a scratch file is written and removed in `directory`, and
    the write lock of `database` is taken and released (nothing is written to the database itself)."""
    scratch = directory / ".readyz-probe"
    try:
        with scratch.open("wb") as file:
            file.write(bytes(PROBE_BYTES))
    except OSError as exc:
        return f"store cannot write: {exc.strerror or exc}: {scratch}"
    finally:
        try:
            scratch.unlink(missing_ok=True)
        except OSError:
            pass
    conn: sqlite3.Connection | None = None
    try:
        conn = sqlite3.connect(
            f"{database.resolve().as_uri()}?mode=rw", uri=True, isolation_level=None, timeout=busy_timeout
        )
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("ROLLBACK")
    except sqlite3.Error as exc:
        return f"store cannot write: {exc}: {database}"
    finally:
        if conn is not None:
            conn.close()
    return None


class WriteProbe:
    """`probe_write` off the loop, at most once per `max_age` seconds (a probe run while others wait serves them
    all), and never longer than `timeout`: a write that hangs is a store that cannot write."""

    def __init__(
        self,
        directory: Path,
        database: Path,
        *,
        loop: asyncio.AbstractEventLoop,
        max_age: float = 1.0,
        timeout: float = 5.0,
    ) -> None:
        self._directory = directory
        self._database = database
        self._loop = loop
        self._max_age = max_age
        self._timeout = timeout
        self._lock = asyncio.Lock()
        self._checked_at: float | None = None
        self._problem: str | None = None
        # A probe still running after its timeout: the next ask waits on it rather than starting another thread.
        self._running: asyncio.Future[str | None] | None = None

    async def problem(self) -> str | None:
        async with self._lock:
            if self._checked_at is not None and self._loop.time() - self._checked_at < self._max_age:
                return self._problem
            if self._running is None:
                self._running = asyncio.ensure_future(asyncio.to_thread(probe_write, self._directory, self._database))
            try:
                async with asyncio.timeout(self._timeout):  # not wait_for (Python 3.11 drops cancellations)
                    found = await asyncio.shield(self._running)
                self._running = None
            except TimeoutError:
                found = f"store cannot write: a write in {self._directory} has not finished in {self._timeout:g} s"
            except Exception as exc:
                self._running = None
                found = f"store cannot write: {exc!r}"
            if found != self._problem:
                if found is not None:
                    log.warning("store_cannot_write", reason=found)
                else:
                    log.info("store_writable", directory=str(self._directory))
            self._problem = found
            self._checked_at = self._loop.time()
            return found
