"""The node's embedded store: one SQLite file in WAL mode per database, `<data_dir>/<database>.sqlite`.

Every process of a node (the coordinator and each worker) opens its own `Store` on the same directory, with
its own connections; SQLite's file locks serialize the writers and WAL lets readers run beside them. Every
write runs in a `BEGIN IMMEDIATE` transaction, so a writer holds the write lock before it reads what it
decides on (the clock, the version a record holds) and never has to retry a transaction that went stale.

Tables of each database file:

    records  (tbl, id) -> value, version, origin, tombstone    current state, tombstones included
    audit    seq -> tbl, id, value, version, origin, tombstone  every commit, local or applied
    cursors  peer -> seq, version, epoch, copy state, copies    our durable position in a peer's log
    acks     peer -> seq, at                                    what each subscriber of ours confirmed
    meta     epoch, hlc                                         the file's identity, the clock's last value

Conflicts resolve last-writer-wins on (version, origin). A record that does not win (an older version, or
the very version held: an identity tie) is skipped and leaves no audit entry. An applied record keeps its
origin in the log, so records relay across hops, and the skip is what stops them circling a mesh forever.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec

from shared import hlc
from shared.config import NAME_RE
from shared.wire import Entry

SUFFIX = ".sqlite"
SYSTEM = "system"
NODES = "nodes"

BUSY_TIMEOUT = 10.0
# IN-list lengths of the batched lookup: a chunk is padded up to the next size, so the statement cache
# holds four statements instead of one per batch length.
_IN_SIZES = (1, 8, 64, 512)
# With exclusions, one audit_after call examines at most this many sequence numbers per entry asked for (and
# at least _MIN_SCAN_WINDOW): a long run of excluded entries costs several calls, not one scan of the log.
_SCAN_FACTOR = 8
_MIN_SCAN_WINDOW = 4096
# Pruning deletes in chunks, each its own transaction, so a first prune of a long log does not hold the write
# lock for longer than the other processes' busy timeout.
_PRUNE_CHUNK = 20_000

_SCHEMA = (
    # A rowid table on purpose: WITHOUT ROWID keeps whole rows in the key b-tree, which with values of a
    # kilobyte or more halves the fan-out and measured twice as slow to write and twice as large on disk.
    """CREATE TABLE IF NOT EXISTS records (
        tbl TEXT NOT NULL, id TEXT NOT NULL, value BLOB NOT NULL, version INTEGER NOT NULL,
        origin TEXT NOT NULL, tombstone INTEGER NOT NULL, PRIMARY KEY (tbl, id))""",
    # Self-catchup asks for the records one origin wrote above a version.
    "CREATE INDEX IF NOT EXISTS records_by_origin ON records (origin, version)",
    """CREATE TABLE IF NOT EXISTS audit (
        seq INTEGER PRIMARY KEY AUTOINCREMENT, tbl TEXT NOT NULL, id TEXT NOT NULL,
        value BLOB NOT NULL, version INTEGER NOT NULL, origin TEXT NOT NULL,
        tombstone INTEGER NOT NULL, committed_at REAL NOT NULL)""",
    # last_own_version() is a max() over one origin's entries.
    "CREATE INDEX IF NOT EXISTS audit_by_origin ON audit (origin, version)",
    """CREATE TABLE IF NOT EXISTS cursors (
        peer TEXT PRIMARY KEY, seq INTEGER, version INTEGER NOT NULL DEFAULT 0,
        epoch TEXT NOT NULL DEFAULT '', copy_snapshot INTEGER, copy_table TEXT, copy_after TEXT,
        copies INTEGER NOT NULL DEFAULT 0)""",
    "CREATE TABLE IF NOT EXISTS acks (peer TEXT PRIMARY KEY, seq INTEGER NOT NULL, at REAL NOT NULL)",
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value) WITHOUT ROWID",
)

_COLUMNS = "tbl, id, value, version, origin, tombstone"
_UPSERT = (
    f"INSERT INTO records ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (tbl, id) DO UPDATE SET "
    "value = excluded.value, version = excluded.version, origin = excluded.origin, "
    "tombstone = excluded.tombstone"
)
_APPEND = f"INSERT INTO audit ({_COLUMNS}, committed_at) VALUES (?, ?, ?, ?, ?, ?, ?)"
_LOOKUP = {
    size: f"SELECT id, version, origin FROM records WHERE tbl = ? AND id IN ({', '.join('?' * size)})"
    for size in _IN_SIZES
}
_SET_CURSOR = (
    "INSERT INTO cursors (peer, seq, version, epoch) VALUES (?, ?, ?, ?) ON CONFLICT (peer) DO UPDATE "
    "SET seq = excluded.seq, version = excluded.version, epoch = excluded.epoch, "
    "copy_snapshot = NULL, copy_table = NULL, copy_after = NULL"
)


class BadName(ValueError):
    """A database, table or node name outside `[A-Za-z0-9_-]{1,64}`."""


class BadRecord(ValueError):
    """A record that cannot be stored: an empty id, or a version outside 1..2**63-1."""


class UnknownDatabase(LookupError):
    """The database has no file and was not asked to be created."""

    def __init__(self, name: str) -> None:
        super().__init__(f"unknown database {name!r}")
        self.name = name


def check_name(name: str, kind: str = "name") -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise BadName(f"bad {kind} name {name!r}: use 1 to 64 of A-Z a-z 0-9 _ -")
    return name


class Cursor(msgspec.Struct, frozen=True, kw_only=True):
    """This node's durable position in one peer's audit log for one database, with its bulk-copy state."""

    seq: int | None  # None: no live position, so the next subscription asks for a bulk copy
    version: int = 0  # the version of the entry at `seq` as received, so the peer can tell a replaced log
    epoch: str = ""  # the epoch of the peer's database file the position belongs to
    copy_snapshot: int | None = None  # set while a bulk copy up to this sender sequence is in progress
    copy_table: str | None = None
    copy_after: str | None = None  # the last id of copy_table applied
    copies: int = 0  # bulk copies taken from this peer, ever


def _entry(row: tuple) -> Entry:
    tbl, record_id, value, version, origin, tombstone = row
    return Entry(tbl, record_id, value, version, origin, bool(tombstone))


def _check_entries(entries: Iterable[Entry]) -> None:
    """Reject a peer's record that would break the data model, before anything is written."""
    tables: set[str] = set()
    origins: set[str] = set()
    for entry in entries:
        if not 0 < entry.version <= hlc.MAX_VERSION:
            raise BadRecord(f"record {entry.table!r}/{entry.id!r}: version {entry.version} is out of range")
        if not entry.id:
            raise BadRecord(f"record in {entry.table!r} has an empty id")
        tables.add(entry.table)
        origins.add(entry.origin)
    for table in tables:
        check_name(table, "table")
    for origin in origins:
        check_name(origin, "origin")


def _initialize(conn: sqlite3.Connection) -> str:
    """Create the schema and the epoch unless the file has them; returns the epoch."""
    if conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'").fetchone():
        row = conn.execute("SELECT value FROM meta WHERE key = 'epoch'").fetchone()
        if row is not None:
            return str(row[0])
    conn.execute("BEGIN IMMEDIATE")
    try:
        for statement in _SCHEMA:
            conn.execute(statement)
        conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('epoch', ?)", (secrets.token_hex(16),))
        conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('hlc', 0)")
        epoch = conn.execute("SELECT value FROM meta WHERE key = 'epoch'").fetchone()[0]
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return str(epoch)


def _build_file(path: Path) -> None:
    """Make a new database file aside, in WAL mode with its schema and epoch, then link it into place.

    Processes that create the same database at once each build their own file and only the first link
    wins, so no process ever opens a half-made file or races another to switch it to WAL mode.
    """
    spare = path.with_name(f".{path.name}.{secrets.token_hex(8)}.new")
    conn = sqlite3.connect(spare, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = WAL").fetchone()
        _initialize(conn)
    finally:
        # Closing the only connection checkpoints the WAL into the file and removes it.
        conn.close()
    try:
        os.link(spare, path)
    except FileExistsError:
        pass
    finally:
        for suffix in ("", "-wal", "-shm"):
            Path(f"{spare}{suffix}").unlink(missing_ok=True)


class Database:
    """One database file, through one connection of this process.

    A lock serializes the calls, so a caller may move them to a thread executor; asyncio code calls them
    inline.
    """

    def __init__(
        self,
        path: Path,
        name: str,
        node: str,
        clock: hlc.WallClock,
        *,
        create: bool = False,
        synchronous: str = "NORMAL",
    ) -> None:
        self.name = name
        self.path = path
        self._node = node
        self._clock = clock
        self._lock = threading.RLock()
        # data_version() combines SQLite's count of other connections' commits with our own commit count.
        self._changes = 0
        self._seen_data_version = 0
        if create and not path.exists():
            _build_file(path)
        try:
            self._conn = sqlite3.connect(
                f"{path.resolve().as_uri()}?mode=rw",
                uri=True,
                timeout=BUSY_TIMEOUT,
                isolation_level=None,
                check_same_thread=False,
            )
        except sqlite3.OperationalError:
            if not path.exists():
                raise UnknownDatabase(name) from None
            raise
        try:
            # Switching to WAL needs an exclusive lock and does not wait for it, so only a file that is not
            # in WAL mode yet (one made by another tool) is switched; ours are born in WAL mode.
            if self._conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                self._conn.execute("PRAGMA journal_mode = WAL").fetchone()
            # NORMAL in WAL mode keeps every commit atomic and survives a process crash; only an OS crash or
            # a power loss can lose the last commits, and then a batch and its cursor are lost together.
            self._conn.execute(f"PRAGMA synchronous = {synchronous}")
            self._conn.execute("PRAGMA temp_store = MEMORY")
            self.epoch: str = _initialize(self._conn)
            self._seen_data_version = self._conn.execute("PRAGMA data_version").fetchone()[0]
        except BaseException:
            self._conn.close()
            raise

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __repr__(self) -> str:
        return f"<Database {self.name} {self.path}>"

    # -- transactions ----------------------------------------------------------------------------------

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            conn = self._conn
            before = conn.total_changes
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                # Some errors (disk full, I/O) have already rolled the transaction back.
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            if conn.total_changes != before:
                self._changes += 1

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """A read transaction: every statement inside sees the same snapshot."""
        with self._lock:
            conn = self._conn
            conn.execute("BEGIN")
            try:
                yield conn
            finally:
                if conn.in_transaction:
                    conn.execute("COMMIT")

    def _now(self) -> float:
        return self._clock() / 1e9

    @staticmethod
    def _clock_value(conn: sqlite3.Connection) -> int:
        row = conn.execute("SELECT value FROM meta WHERE key = 'hlc'").fetchone()
        return int(row[0]) if row is not None else 0

    @staticmethod
    def _set_clock(conn: sqlite3.Connection, value: int) -> None:
        conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('hlc', ?)", (value,))

    # -- local writes ----------------------------------------------------------------------------------

    def put(self, table: str, id: str, value: bytes) -> int:
        """Upsert one record written on this node; returns its version."""
        return self.put_many(table, [(id, value)])[0]

    def put_many(self, table: str, items: list[tuple[str, bytes]]) -> list[int]:
        """Upsert records written on this node in one transaction; returns their versions, in order."""
        check_name(table, "table")
        if not items:
            return []
        for record_id, _ in items:
            if not isinstance(record_id, str) or not record_id:
                raise BadRecord(f"record in {table!r}: the id must be a non-empty string, not {record_id!r}")
        with self._write() as conn:
            # The clock is past every version the file holds (applying moves it), so a local write always
            # wins and needs no lookup.
            first = hlc.tick(self._clock_value(conn), self._clock)
            rows = [
                (table, record_id, value, first + index, self._node, 0)
                for index, (record_id, value) in enumerate(items)
            ]
            self._append(conn, rows)
            last = first + len(items) - 1
            self._set_clock(conn, last)
        return list(range(first, last + 1))

    def delete(self, table: str, id: str) -> int | None:
        """Tombstone a record; returns the tombstone's version, or None when there is no live record."""
        check_name(table, "table")
        with self._write() as conn:
            held = conn.execute("SELECT tombstone FROM records WHERE tbl = ? AND id = ?", (table, id))
            row = held.fetchone()
            if row is None or row[0]:
                return None
            version = hlc.tick(self._clock_value(conn), self._clock)
            self._append(conn, [(table, id, b"", version, self._node, 1)])
            self._set_clock(conn, version)
        return version

    def _append(self, conn: sqlite3.Connection, rows: list[tuple]) -> None:
        """Write winning rows to the records and append them to the audit log."""
        conn.executemany(_UPSERT, rows)
        now = self._now()
        conn.executemany(_APPEND, [(*row, now) for row in rows])

    # -- reads -----------------------------------------------------------------------------------------

    def get(self, table: str, id: str) -> Entry | None:
        """The live record, or None when it is absent or a tombstone."""
        with self._lock:
            row = self._conn.execute(
                f"SELECT {_COLUMNS} FROM records WHERE tbl = ? AND id = ? AND tombstone = 0", (table, id)
            ).fetchone()
        return _entry(row) if row is not None else None

    def scan(self, table: str, after: str | None, limit: int) -> list[Entry]:
        """Live records of a table in id order after `after` (from the start when None or empty)."""
        with self._lock:
            rows = self._conn.execute(
                f"SELECT {_COLUMNS} FROM records WHERE tbl = ? AND id > ? AND tombstone = 0 ORDER BY id LIMIT ?",
                (table, after or "", limit),
            ).fetchall()
        return [_entry(row) for row in rows]

    def tables(self) -> list[str]:
        """Tables holding at least one record or tombstone, in name order."""
        with self._lock:
            return self._tables(self._conn)

    @staticmethod
    def _tables(conn: sqlite3.Connection) -> list[str]:
        # A skip scan over the primary key: one index seek per table, not a pass over every record.
        tables: list[str] = []
        row = conn.execute("SELECT min(tbl) FROM records").fetchone()
        while row[0] is not None:
            tables.append(row[0])
            row = conn.execute("SELECT min(tbl) FROM records WHERE tbl > ?", (row[0],)).fetchone()
        return tables

    def last_seq(self) -> int:
        """The highest audit sequence ever used; it does not move back when entries are pruned."""
        with self._lock:
            return self._head(self._conn)

    @staticmethod
    def _head(conn: sqlite3.Connection) -> int:
        # AUTOINCREMENT keeps the highest sequence ever used here, even after the entries are deleted.
        row = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'audit'").fetchone()
        return int(row[0]) if row is not None else 0

    def first_seq(self) -> int:
        """The lowest audit sequence still held (last_seq() + 1 when the log is empty).

        A subscriber whose cursor is below first_seq() - 1 has missed pruned entries and needs a bulk copy.
        """
        with self._read() as conn:
            row = conn.execute("SELECT min(seq) FROM audit").fetchone()
            return int(row[0]) if row[0] is not None else self._head(conn) + 1

    def data_version(self) -> int:
        """A number that changes whenever anyone, this process or another, commits a change to the file."""
        with self._lock:
            seen = self._conn.execute("PRAGMA data_version").fetchone()[0]
            if seen != self._seen_data_version:
                self._seen_data_version = seen
                self._changes += 1
            return self._changes

    # -- streaming (sender side) -----------------------------------------------------------------------

    def audit_after(
        self, seq: int, limit: int, exclude: frozenset[str] = frozenset()
    ) -> tuple[list[tuple[int, Entry]], int]:
        """Audit entries after `seq` in order, without the excluded origins, at most `limit` of them.

        Also returns the highest sequence examined, which the subscriber's cursor may move to even when every
        entry up to it was excluded. With exclusions the examined range is bounded, so the list can come back
        empty while the sequence moves; it never moves past an entry that was not examined.
        """
        if limit < 1:
            return [], seq
        select = f"SELECT seq, {_COLUMNS} FROM audit"
        with self._read() as conn:
            if not exclude:
                rows = conn.execute(f"{select} WHERE seq > ? ORDER BY seq LIMIT ?", (seq, limit)).fetchall()
                return [(row[0], _entry(row[1:])) for row in rows], rows[-1][0] if rows else seq
            first = conn.execute("SELECT min(seq) FROM audit WHERE seq > ?", (seq,)).fetchone()[0]
            if first is None:
                return [], seq
            # The window starts at the first entry held, so a pruned stretch does not use it up.
            upper = first + max(limit * _SCAN_FACTOR, _MIN_SCAN_WINDOW) - 1
            marks = ", ".join("?" * len(exclude))
            rows = conn.execute(
                f"{select} WHERE seq > ? AND seq <= ? AND origin NOT IN ({marks}) ORDER BY seq LIMIT ?",
                (seq, upper, *sorted(exclude), limit),
            ).fetchall()
            if len(rows) == limit:
                scanned = rows[-1][0]
            else:
                scanned = min(upper, conn.execute("SELECT max(seq) FROM audit").fetchone()[0])
        return [(row[0], _entry(row[1:])) for row in rows], scanned

    def entry_version_at(self, seq: int) -> int | None:
        with self._lock:
            row = self._conn.execute("SELECT version FROM audit WHERE seq = ?", (seq,)).fetchone()
        return int(row[0]) if row is not None else None

    def copy_walk(
        self, table: str, after_id: str | None, limit: int, exclude: frozenset[str] = frozenset()
    ) -> list[Entry]:
        """Records of a table, tombstones included, in id order after `after_id` (from the start when None
        or empty), without the excluded origins."""
        clause = ""
        params: list[object] = [table, after_id or ""]
        if exclude:
            clause = f" AND origin NOT IN ({', '.join('?' * len(exclude))})"
            params.extend(sorted(exclude))
        params.append(limit)
        with self._lock:
            rows = self._conn.execute(
                f"SELECT {_COLUMNS} FROM records WHERE tbl = ? AND id > ?{clause} ORDER BY id LIMIT ?", params
            ).fetchall()
        return [_entry(row) for row in rows]

    def records_by_origin_after(
        self, origin: str, version: int, limit: int, after: tuple[str, str] | None = None
    ) -> list[Entry]:
        """Records (tombstones included) written by `origin` with a version above `version`, in (table, id)
        order, after the (table, id) position `after`."""
        query = f"SELECT {_COLUMNS} FROM records WHERE origin = ? AND version > ?"
        params: tuple[object, ...] = (origin, version)
        if after is not None:
            query += " AND (tbl, id) > (?, ?)"
            params += (after[0], after[1])
        with self._lock:
            rows = self._conn.execute(f"{query} ORDER BY tbl, id LIMIT ?", (*params, limit)).fetchall()
        return [_entry(row) for row in rows]

    def last_own_version(self) -> int:
        """The highest version among audit entries originated by this node (0 when none is held)."""
        with self._lock:
            row = self._conn.execute("SELECT max(version) FROM audit WHERE origin = ?", (self._node,)).fetchone()
        return int(row[0]) if row[0] is not None else 0

    # -- applying (subscriber side) --------------------------------------------------------------------

    def apply_batch(
        self,
        peer: str,
        entries: list[Entry],
        cursor_seq: int | None,
        cursor_version: int = 0,
        epoch: str = "",
    ) -> int:
        """Apply a peer's records last-writer-wins and, unless `cursor_seq` is None, move this database's
        cursor for the peer to it, in one transaction. Returns how many records won."""
        _check_entries(entries)
        with self._write() as conn:
            won = self._apply(conn, entries)
            if cursor_seq is not None:
                # A live position supersedes a bulk copy that was in progress.
                conn.execute(_SET_CURSOR, (peer, cursor_seq, cursor_version, epoch))
        return won

    def _apply(self, conn: sqlite3.Connection, entries: list[Entry]) -> int:
        if not entries:
            return 0
        held = self._lookup(conn, entries)
        rows: list[tuple] = []
        # In batch order, each entry against the state the earlier ones left, so a batch carrying several
        # versions of one record ends exactly as if its entries were applied one by one.
        for entry in entries:
            key = (entry.table, entry.id)
            candidate = (entry.version, entry.origin)
            current = held.get(key)
            if current is not None and candidate <= current:
                continue
            held[key] = candidate
            if entry.tombstone:
                rows.append((entry.table, entry.id, b"", entry.version, entry.origin, 1))
            else:
                rows.append((entry.table, entry.id, entry.value, entry.version, entry.origin, 0))
        if rows:
            self._append(conn, rows)
        top = max(entry.version for entry in entries)
        last = self._clock_value(conn)
        if top > last:
            self._set_clock(conn, hlc.receive(last, top))
        return len(rows)

    @staticmethod
    def _lookup(conn: sqlite3.Connection, entries: list[Entry]) -> dict[tuple[str, str], tuple[int, str]]:
        """The (version, origin) held for every record the entries touch, a few IN queries per table."""
        by_table: dict[str, set[str]] = {}
        for entry in entries:
            by_table.setdefault(entry.table, set()).add(entry.id)
        held: dict[tuple[str, str], tuple[int, str]] = {}
        largest = _IN_SIZES[-1]
        for table, id_set in by_table.items():
            ids = sorted(id_set)
            for start in range(0, len(ids), largest):
                chunk = ids[start : start + largest]
                size = next(size for size in _IN_SIZES if size >= len(chunk))
                chunk.extend(chunk[-1:] * (size - len(chunk)))
                for record_id, version, origin in conn.execute(_LOOKUP[size], (table, *chunk)):
                    held[(table, record_id)] = (version, origin)
        return held

    def cursor(self, peer: str) -> Cursor | None:
        with self._lock:
            row = self._conn.execute(
                "SELECT seq, version, epoch, copy_snapshot, copy_table, copy_after, copies FROM cursors WHERE peer = ?",
                (peer,),
            ).fetchone()
        if row is None:
            return None
        seq, version, epoch, snapshot, table, after, copies = row
        return Cursor(
            seq=seq,
            version=version,
            epoch=epoch,
            copy_snapshot=snapshot,
            copy_table=table,
            copy_after=after,
            copies=copies,
        )

    def begin_copy(self, peer: str, snapshot_seq: int, epoch: str) -> None:
        """A bulk copy from the peer up to its `snapshot_seq` starts; the live position is dropped."""
        with self._write() as conn:
            conn.execute(
                "INSERT INTO cursors (peer, seq, version, epoch, copy_snapshot, copies) "
                "VALUES (?, NULL, 0, ?, ?, 1) ON CONFLICT (peer) DO UPDATE SET seq = NULL, version = 0, "
                "epoch = excluded.epoch, copy_snapshot = excluded.copy_snapshot, copy_table = NULL, "
                "copy_after = NULL, copies = copies + 1",
                (peer, epoch, snapshot_seq),
            )

    def apply_copy_batch(self, peer: str, records: list[Entry], table: str, last_id: str) -> int:
        """Apply one copy batch last-writer-wins and persist the copy position, in one transaction."""
        _check_entries(records)
        check_name(table, "table")
        with self._write() as conn:
            won = self._apply(conn, records)
            conn.execute("UPDATE cursors SET copy_table = ?, copy_after = ? WHERE peer = ?", (table, last_id, peer))
        return won

    def finish_copy(self, peer: str, snapshot_seq: int, epoch: str, version: int = 0) -> None:
        """The copy is complete: the live position becomes the snapshot sequence; the copy state is gone."""
        with self._write() as conn:
            conn.execute(_SET_CURSOR, (peer, snapshot_seq, version, epoch))

    def reset_cursor(self, peer: str) -> None:
        """Forget the position in the peer's log, so the next subscription copies; the copy count stays."""
        with self._write() as conn:
            conn.execute(
                "UPDATE cursors SET seq = NULL, version = 0, epoch = '', copy_snapshot = NULL, "
                "copy_table = NULL, copy_after = NULL WHERE peer = ?",
                (peer,),
            )

    # -- retention -------------------------------------------------------------------------------------

    def record_ack(self, peer: str, seq: int) -> None:
        """A subscriber confirmed it holds our log up to `seq`."""
        with self._write() as conn:
            conn.execute(
                "INSERT INTO acks (peer, seq, at) VALUES (?, ?, ?) "
                "ON CONFLICT (peer) DO UPDATE SET seq = excluded.seq, at = excluded.at",
                (peer, seq, self._now()),
            )

    def acks(self) -> dict[str, int]:
        with self._lock:
            return dict(self._conn.execute("SELECT peer, seq FROM acks").fetchall())

    def prune_audit(self, peers: list[str], retention_seconds: float, now: float) -> int:
        """Delete the audit entries every listed peer has acknowledged, and those older than the retention
        window whoever still needs them. Returns how many entries were deleted. `now` is wall-clock seconds
        since the epoch, the scale of the store's clock that stamped the entries.

        With no peer listed nothing counts as acknowledged: a node that has not learned its subscribers yet
        must not drop the log they will resume from. Only a prefix of the log is ever deleted, so the log
        stays contiguous, which audit_after's scan bound relies on.
        """
        with self._read() as conn:
            floor = 0
            if peers:
                acked = dict(conn.execute("SELECT peer, seq FROM acks").fetchall())
                if all(peer in acked for peer in peers):
                    floor = min(acked[peer] for peer in peers)
            young = conn.execute(
                "SELECT seq FROM audit WHERE committed_at >= ? ORDER BY seq LIMIT 1",
                (now - retention_seconds,),
            ).fetchone()
            # Everything before the first young entry is old; with no young entry, the whole log is.
            floor = max(floor, young[0] - 1 if young is not None else self._head(conn))
            low = conn.execute("SELECT min(seq) FROM audit").fetchone()[0]
        deleted = 0
        while low is not None and low <= floor:
            high = min(floor, low + _PRUNE_CHUNK - 1)
            with self._write() as conn:
                deleted += conn.execute("DELETE FROM audit WHERE seq <= ?", (high,)).rowcount
            low = high + 1
        return deleted

    # -- verification ----------------------------------------------------------------------------------

    def digest(self) -> dict[str, dict[str, int | str]]:
        """Per table: the number of live records and a sha256 over all rows, tombstones included, in id order.

        The hash covers id, version, origin, tombstone flag and value, one msgpack array per row so that no
        two different sequences of rows hash alike; two nodes with equal digests hold the same data.
        """
        encode = msgspec.msgpack.Encoder().encode
        result: dict[str, dict[str, int | str]] = {}
        with self._read() as conn:
            for table in self._tables(conn):
                digest = hashlib.sha256()
                count = 0
                rows = conn.execute(
                    "SELECT id, version, origin, tombstone, value FROM records WHERE tbl = ? ORDER BY id",
                    (table,),
                )
                for record_id, version, origin, tombstone, value in rows:
                    digest.update(encode((record_id, version, origin, bool(tombstone), value)))
                    count += not tombstone
                result[table] = {"count": count, "digest": digest.hexdigest()}
        return result


class Store:
    """The databases of one node under `data_dir`, as this process opens them (one connection each)."""

    def __init__(
        self,
        data_dir: str | Path,
        node_name: str,
        clock: hlc.WallClock = time.time_ns,
        *,
        synchronous: str = "NORMAL",
    ) -> None:
        self.data_dir = Path(data_dir)
        self.node = check_name(node_name, "node")
        self._clock = clock
        self._synchronous = synchronous
        self._databases: dict[str, Database] = {}
        self._lock = threading.Lock()

    def path(self, name: str) -> Path:
        return self.data_dir / f"{check_name(name, 'database')}{SUFFIX}"

    def database(self, name: str, create: bool = False) -> Database:
        """The database `name`, opened once per Store; UnknownDatabase if it has no file, unless `create`."""
        path = self.path(name)
        with self._lock:
            db = self._databases.get(name)
            if db is not None:
                return db
            if not create and not path.exists():
                raise UnknownDatabase(name)
            if create:
                self.data_dir.mkdir(parents=True, exist_ok=True)
            db = Database(path, name, self.node, self._clock, create=create, synchronous=self._synchronous)
            self._databases[name] = db
            return db

    def names(self) -> list[str]:
        """The databases on disk, whether this process has opened them or not."""
        if not self.data_dir.is_dir():
            return []
        stems = (path.name[: -len(SUFFIX)] for path in self.data_dir.iterdir() if path.name.endswith(SUFFIX))
        return sorted(stem for stem in stems if NAME_RE.match(stem))

    def close(self) -> None:
        with self._lock:
            databases = list(self._databases.values())
            self._databases.clear()
        for db in databases:
            db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the node registry: `system.nodes` ---------------------------------------------------------------------


class NodeRow(msgspec.Struct, kw_only=True):
    """One node of the cluster as the registry holds it; the record id is the node name."""

    name: str
    url: str
    databases: list[str] = msgspec.field(default_factory=lambda: ["*"])
    replicates: bool = False
    leader: bool = False
    revoked: list[str] = []  # revoked certificate serials
    holds: list[str] = []  # the database names the node holds


_node_decoder = msgspec.msgpack.Decoder(NodeRow)
_REGISTRY_PAGE = 1000


def read_nodes(db: Database) -> dict[str, NodeRow]:
    """The live rows of the registry by node name; a row that does not decode is skipped."""
    nodes: dict[str, NodeRow] = {}
    after: str | None = None
    while True:
        page = db.scan(NODES, after, _REGISTRY_PAGE)
        for entry in page:
            if not NAME_RE.match(entry.id):
                continue
            try:
                row = _node_decoder.decode(entry.value)
            except msgspec.DecodeError:
                continue
            # Last-writer-wins keys on the record id, so the id names the node whatever the value says.
            nodes[entry.id] = row if row.name == entry.id else msgspec.structs.replace(row, name=entry.id)
        if len(page) < _REGISTRY_PAGE:
            return nodes
        after = page[-1].id


def write_node(db: Database, row: NodeRow) -> int:
    return db.put(NODES, check_name(row.name, "node"), msgspec.msgpack.encode(row))


def delete_node(db: Database, name: str) -> int | None:
    return db.delete(NODES, name)
