"""The node's embedded store: one SQLite file in WAL mode per database, `<data_dir>/<database>.sqlite`.

Every process of a node (the coordinator and each worker) opens its own `Store` on the same directory, with
its own connections; SQLite's file locks serialize the writers and WAL lets readers run beside them. Every
write runs in a `BEGIN IMMEDIATE` transaction, so a writer holds the write lock before it reads what it
decides on (the clock, the version a record holds) and never has to retry a transaction that went stale.

Tables of each database file:

    records  (tbl, id) -> value, version, origin, tombstone,   current state, tombstones included, with each
                          bucket, checksum                     row's digest bucket and checksum
    digests  (tbl, bucket) -> count, live, xor                 the bucket digests anti-entropy compares
    audit    seq -> tbl, id, value, version, origin, tombstone,  every commit, local or applied (history); local
                local                                           marks what this node wrote itself
    origins  origin -> complete, top                            what this file holds of each origin
    purged   origin -> scanned                                  how far tombstones were purged (all holders had them)
    meta     epoch, hlc, owner, floor, recovering               identity, the clock, whose file it is, its own
                                                                history (`shared.own_writes`)

Every row carries the checksum of its content (`shared.digests`); a row that no longer matches it is damaged: it
is never served (reads raise `DamagedRecord`), its checksum is set to DAMAGED, which moves its bucket's digest,
and anti-entropy replaces it from a peer. Triggers keep the bucket digests in the transaction of every change
to a row, whoever makes it, the sqlite3 shell included.

Conflicts resolve last-writer-wins on (version, origin). A record that does not win (an older version, or
the very version held: an identity tie) is skipped and leaves no audit entry. An applied record keeps its
origin, so records relay across hops, and the skip is what stops them circling a mesh forever.

Replication is by origin. `origins.complete` is a promise: this file holds every record version the origin
wrote up to that version, or a newer version of the same record. It only ever rises, and only in the
transaction that applies what justifies it (a sender's mark, see `apply_batch`). A sender serves an origin
from the records table in version order (index `records_by_origin`), so what it serves never depends on how
much of the audit log is kept: pruning the log cannot make anyone skip a write. The owner's own origin is
complete up to its newest write in the file, except in a file that is `recovering`: one this node did not
build from its own writes (a new, empty or lost file, another node's file, or one a peer shows went back in
time: `regress`); there the own origin counts only what peers have confirmed, until the coordinator sees the
peers have served it (`finish_recovery`). What the node knows of its own writes is decided in one place,
`shared.own_writes`; this module keeps its state in the file.

The store opens only regular files: a `<name>.sqlite` that is a symbolic link, to anything, or whose -wal, -shm or
-journal is one (SQLite opens those by name beside it), is refused (`refusal`, `RefusedFile`), never followed and
never changed; the rest of the data directory is served as usual. The data directory itself may be a link.
"""

from __future__ import annotations

import fcntl
import functools
import gc
import hashlib
import os
import secrets
import shutil
import sqlite3
import stat
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

import msgspec

from replicator.shared import blobs, deletion, digests, hlc, own_writes
from replicator.shared.config import NAME_RE
from replicator.shared.deletion import NO_DELETION, DeletionFloors
from replicator.shared.digests import DAMAGED
from replicator.shared.logs import log
from replicator.shared.wire import Entry

_place = digests.place

SUFFIX = ".sqlite"
# What SQLite keeps beside a database file, under the file's name and these suffixes.
SIDECARS = ("-wal", "-shm", "-journal")
SYSTEM = "system"
# In the data directory: every process of a node links a new database file into place holding an exclusive flock
# on it, so the count of files it checks against the limit stays true until its own file is there.
CREATION_LOCK = ".create.lock"
NODES = "nodes"
# The system table of deletion markers (`shared.dropped`): id a database name, version the database's deletion floor.
DROPPED = "dropped"

BUSY_TIMEOUT = 10.0
# Databases closed at once by `Store.close`. Closing a file's last connection checkpoints its WAL into the file and
# syncs both, some milliseconds a file on a real disk; the file system commits concurrent syncs together (300 files
# on a VM's disk: 3.7 s one after another, 0.13 s 16 at once; 64 at once no faster).
CLOSE_THREADS = 16
# IN-list lengths of the batched lookup: a chunk is padded up to the next size, so the statement cache
# holds four statements instead of one per batch length.
_IN_SIZES = (1, 8, 64, 512)
# Pruning deletes in chunks, each its own transaction, so a first prune of a long log does not hold the write
# lock for longer than the other processes' busy timeout.
_PRUNE_CHUNK = 20_000
# The page cache of a connection to an idle database (`Database.trim`). Below 3 pages SQLite does not allocate the
# first 20 at once (SQLITE_DEFAULT_PCACHE_INITSZ).
LEAN_CACHE_PAGES = 2
# What anti-entropy reads per hold of a connection (`children`, `summaries`): ids and checksums by the chunk, values
# fewer at a time (one may be a quarter of max_frame_bytes). Between holds a thread answering a peer lets the event
# loop's own reads of the file in.
SCAN_CHUNK = 512
VERIFY_CHUNK = 32
# A record's history (`Database.history`) is found by reading the audit log newest first, by ranges of its sequence,
# each under its own hold of the connection: no index on the log costs every write, and one request reads at most
# HISTORY_SCAN entries of it (the answer then says where to go on from).
HISTORY_CHUNK = 8192
HISTORY_SCAN = 262_144

SCHEMA_VERSION = 5
# Before version 4 rows carried no checksums: such a file's rows are checksummed from what they hold (`_add_digests`).
CHECKSUMS_SINCE = 4

_SCHEMA = (
    # A rowid table on purpose: WITHOUT ROWID keeps whole rows in the key b-tree, which with values of a
    # kilobyte or more halves the fan-out and measured twice as slow to write and twice as large on disk.
    # bucket and checksum may be NULL only in a row written by another tool: such a row is damaged.
    """CREATE TABLE IF NOT EXISTS records (
        tbl TEXT NOT NULL, id TEXT NOT NULL, value BLOB NOT NULL, version INTEGER NOT NULL,
        origin TEXT NOT NULL, tombstone INTEGER NOT NULL, bucket INTEGER, checksum INTEGER,
        PRIMARY KEY (tbl, id))""",
    # A sender serves one origin's records after a version, in version order.
    "CREATE INDEX IF NOT EXISTS records_by_origin ON records (origin, version)",
    """CREATE TABLE IF NOT EXISTS audit (
        seq INTEGER PRIMARY KEY AUTOINCREMENT, tbl TEXT NOT NULL, id TEXT NOT NULL,
        value BLOB NOT NULL, version INTEGER NOT NULL, origin TEXT NOT NULL,
        tombstone INTEGER NOT NULL, committed_at REAL NOT NULL, local INTEGER NOT NULL DEFAULT 0)""",
    # Nothing reads the audit log by origin any more (senders serve the records table); the index only cost writes.
    "DROP INDEX IF EXISTS audit_by_origin",
    # complete: every version of the origin up to it is held (or superseded); top: the highest version held.
    """CREATE TABLE IF NOT EXISTS origins (
        origin TEXT PRIMARY KEY, complete INTEGER NOT NULL DEFAULT 0, top INTEGER NOT NULL DEFAULT 0)
        WITHOUT ROWID""",
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value) WITHOUT ROWID",
    # How far the tombstone purge has looked, by origin (it goes forward only).
    """CREATE TABLE IF NOT EXISTS purged (origin TEXT PRIMARY KEY, scanned INTEGER NOT NULL) WITHOUT ROWID""",
)

# The columns an earlier schema lacks, added in place by `_initialize`. An audit entry from before version 5 reads
# as applied: nothing tells it was written here, so it proves nothing of what this node wrote (`shared.own_writes`).
_ADDED_COLUMNS = ("bucket INTEGER", "checksum INTEGER")
_ADDED_AUDIT_COLUMNS = ("local INTEGER NOT NULL DEFAULT 0",)

# The digest machinery, created after the columns exist. The node adds each row it writes to its bucket's digest
# itself, once per bucket and transaction (`_add_to_digests`: cheaper than a trigger per row); triggers take out
# what a row held when it is updated or deleted, by anyone. A row without a bucket counts in bucket -1, outside
# the tree; without a checksum, as 0. Rows added behind the node's back are not counted until the scrub recounts
# the digests (`check_digests`), which it does at the end of every pass.
_X_OLD = "coalesce(old.checksum, 0)"
_REMOVE_ROW = f"""UPDATE digests SET count = count - 1, live = live - (old.tombstone = 0),
        xor = (xor | {_X_OLD}) - (xor & {_X_OLD}) WHERE tbl = old.tbl AND bucket = coalesce(old.bucket, -1);"""
_ADD_TO_DIGEST = (
    "INSERT INTO digests (tbl, bucket, count, live, xor) VALUES (?, ?, ?, ?, ?) ON CONFLICT (tbl, bucket)"
    " DO UPDATE SET count = count + excluded.count, live = live + excluded.live,"
    " xor = (xor | excluded.xor) - (xor & excluded.xor)"
)
_DIGESTS = (
    # Ids written in sequence share buckets (see shared.digests), so this index grows at a few places per batch.
    "CREATE INDEX IF NOT EXISTS records_by_bucket ON records (tbl, bucket)",
    """CREATE TABLE IF NOT EXISTS digests (
        tbl TEXT NOT NULL, bucket INTEGER NOT NULL, count INTEGER NOT NULL, live INTEGER NOT NULL,
        xor INTEGER NOT NULL, PRIMARY KEY (tbl, bucket)) WITHOUT ROWID""",
    "DROP TRIGGER IF EXISTS records_digest_insert",
    f"CREATE TRIGGER IF NOT EXISTS records_digest_delete AFTER DELETE ON records BEGIN {_REMOVE_ROW} END",
    "CREATE TRIGGER IF NOT EXISTS records_digest_update AFTER UPDATE OF tbl, tombstone, bucket, checksum"
    f" ON records BEGIN {_REMOVE_ROW} END",
)
_TRIGGERS = ("records_digest_delete", "records_digest_update")

_COLUMNS = "tbl, id, value, version, origin, tombstone"
# What verification reads. A value written by another tool may be TEXT, invalid UTF-8 included: read as bytes,
# it fails its checksum instead of failing the read.
_CHECKED = "tbl, id, CAST(value AS BLOB), version, origin, tombstone, checksum"
_UPSERT = (
    f"INSERT INTO records ({_COLUMNS}, bucket, checksum) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (tbl, id) DO UPDATE SET value = excluded.value, version = excluded.version,"
    " origin = excluded.origin, tombstone = excluded.tombstone, bucket = excluded.bucket,"
    " checksum = excluded.checksum"
)
_APPEND = f"INSERT INTO audit ({_COLUMNS}, committed_at, local) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
_LOOKUP = {
    size: f"SELECT id, version, origin, checksum FROM records WHERE tbl = ? AND id IN ({', '.join('?' * size)})"
    for size in _IN_SIZES
}
_RAISE_TOP = (
    "INSERT INTO origins (origin, top) VALUES (?, ?) ON CONFLICT (origin) DO UPDATE SET top = max(top, excluded.top)"
)
_RAISE_COMPLETE = (
    "INSERT INTO origins (origin, complete) VALUES (?, ?) ON CONFLICT (origin) DO UPDATE "
    "SET complete = max(complete, excluded.complete)"
)


class BadName(ValueError):
    """A database, table or node name outside `[A-Za-z0-9_-]{1,64}`."""


class BadRecord(ValueError):
    """A record that cannot be stored: an empty id, or a version outside 1..2**63-1."""


class DamagedRecord(Exception):
    """A stored record no longer matches its checksum: it is not served, and a peer's copy replaces it."""

    def __init__(self, database: str, table: str, record_id: str, newly: bool) -> None:
        super().__init__(
            f"record {table}/{record_id} of database {database!r} failed its checksum on this node;"
            " it is not served until anti-entropy repairs it from a peer"
        )
        self.database = database
        self.table = table
        self.id = record_id
        self.newly = newly  # this call found it (count it once), rather than one before


class ScanLimit(Exception):
    """An anti-entropy read met more rows than its caller allows: the nodes asked for hold too many at once."""


class UnknownDatabase(LookupError):
    """The database has no file and was not asked to be created."""

    def __init__(self, name: str) -> None:
        super().__init__(f"unknown database {name!r}")
        self.name = name


class TooManyDatabases(Exception):
    """Creating the database would make the node hold more than `data.max_databases` (the system database is not
    counted)."""

    def __init__(self, name: str, held: int, limit: int) -> None:
        super().__init__(
            f"cannot create database {name!r}: this node holds {held} databases, the limit"
            f" (data.max_databases = {limit})"
        )
        self.name = name
        self.held = held
        self.limit = limit


class DatabaseRemoving(UnknownDatabase):
    """The database is being removed from this node (deleted cluster-wide, see `Store.block`): it cannot be opened
    or created until the removal is over."""

    def __init__(self, name: str) -> None:
        LookupError.__init__(self, f"database {name!r} is being removed on this node; try again")
        self.name = name


class RefusedFile(UnknownDatabase):
    """The database's file is one the store will not open (`refusal`): to every caller it is a database this node
    does not have, and the message names the file and why."""

    def __init__(self, name: str, path: Path, reason: str) -> None:
        LookupError.__init__(self, reason)
        self.name = name
        self.path = path


def refusal(path: Path) -> str | None:
    """Why the store will not open the database file at `path`, or None. A symbolic link in its place, or in place of
    one of its SIDECARS, is refused whatever it points at (a file outside the data directory, another database, one
    not there yet): following it would read and write a file the node does not own, chosen by whoever made the
    link. Looked at with lstat: nothing is followed, opened or changed."""
    for suffix in ("", *SIDECARS):
        candidate = Path(f"{path}{suffix}")
        try:
            if not stat.S_ISLNK(os.lstat(candidate).st_mode):
                continue
            target = os.readlink(candidate)
        except OSError:
            continue  # absent: SQLite makes a missing sidecar itself, and a missing file is no database
        what = f"database file {path} is" if not suffix else f"database file {path}: its {candidate.name} is"
        return (
            f"{what} a symbolic link (to {target[:300]}); refused: the node opens only regular files in its data"
            f" directory and has changed nothing (put the file itself in place of the link)"
        )
    return None


def check_name(name: str, kind: str = "name") -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise BadName(f"bad {kind} name {name!r}: use 1 to 64 of A-Z a-z 0-9 _ -")
    return name


class Current(msgspec.Struct, frozen=True):
    """What the records table holds of one record: its version, origin, whether it is a tombstone, and whether the
    row fails its checksum (damaged: it is not served, and anti-entropy replaces it)."""

    version: int
    origin: str
    tombstone: bool
    damaged: bool


class Applied(msgspec.Struct, frozen=True):
    """One audit entry of a record: a version this file committed, written here (`local`) or applied from a peer,
    and when (wall clock, seconds since the epoch)."""

    seq: int
    version: int
    origin: str
    tombstone: bool
    local: bool
    committed_at: float


class History(msgspec.Struct, frozen=True):
    """A record's state and its audit entries newest first (`Database.history`).

    `before`: when set, older entries may lie below this sequence (pass it as `before` to read on); `reason` says
    why the answer stopped there: "limit" (more entries than asked for) or "scan" (HISTORY_SCAN entries of the log
    read). `oldest`: the commit time of the oldest entry the log still holds, and `pruned` whether entries older
    than it were removed (retention or a database deletion): a record's history before then is gone here."""

    current: Current | None
    entries: list[Applied]
    before: int | None
    reason: str
    oldest: float | None
    pruned: bool


class Origin(msgspec.Struct, frozen=True):
    """What a file holds of one origin: every version up to `complete`, and nothing above `top`."""

    complete: int = 0
    top: int = 0


def _entry(row: tuple) -> Entry:
    tbl, record_id, value, version, origin, tombstone = row[:6]
    return Entry(tbl, record_id, value, version, origin, bool(tombstone))


def _row(tbl: str, record_id: str, value: bytes, version: int, origin: str, tombstone: int) -> tuple:
    """A records row with its bucket and checksum, as `_UPSERT` takes it (and, with the commit time, `_APPEND`)."""
    return (
        tbl,
        record_id,
        # Bound as a bytearray, the same BLOB: CPython's sqlite3 binds int, float, str and bytearray as they are, but
        # looks every other type up in its adapter registry first, bytes included. That lookup cost about 0.35 µs per
        # value, twice per row (records and audit): 8% of a local write's or an apply's CPU; the copy costs a tenth.
        bytearray(value) if value.__class__ is bytes else value,
        version,
        origin,
        tombstone,
        *_place(tbl, record_id, version, origin, tombstone, value),
    )


def _intact(row: tuple) -> bool:
    """Does a row read with `_CHECKED` columns match its stored checksum?"""
    tbl, record_id, value, version, origin, tombstone, stored = row
    if stored is None or stored == DAMAGED:
        return False
    return stored == digests.checksum(tbl, record_id, version, origin, tombstone, value)


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


def _meta(conn: sqlite3.Connection, key: str) -> object:
    row = conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
    return row[0] if row is not None else None


def _settled(conn: sqlite3.Connection, node: str) -> str | None:
    """The epoch of a file that already has this version's schema and belongs to `node`, else None."""
    if conn.execute("PRAGMA user_version").fetchone()[0] != SCHEMA_VERSION:
        return None
    names = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'")}
    if not names.issuperset(_TRIGGERS):
        return None  # someone dropped a trigger: recreate it, and rebuild the digests it would have kept
    epoch = _meta(conn, "epoch")
    if epoch is None or _meta(conn, "owner") != node or own_writes.restored(conn):
        return None
    return str(epoch)


def _initialize(
    conn: sqlite3.Connection,
    node: str,
    clock_floor_us: int = 0,
    history: str = own_writes.LOST,
    born_us: int = 0,
    wall_us: int = 0,
) -> str:
    """Give the file the schema, identity and owner it lacks; returns the epoch.

    A file without an epoch is new (or empty): nothing in it is this node's own history. `history` says what the
    node knows of its earlier writes to the database (`shared.own_writes`, see `Store.database`): none (a new
    name), not known, or lost (a file that starts `recovering`, its clock ahead).
    A file of an earlier version (an epoch but no owner) is taken as intact; its origins start at 0, so peers
    re-send what it holds once and fill any gap. A file another node owned (copied in, or restored from that
    node's backup) is adopted: its owner's writes are complete up to its newest one in the file unless it was
    itself recovering, and ours start recovering.

    A recovering file's clock starts at `clock_floor_us`, the wall clock plus max_clock_skew: every version
    this node wrote before it lost the file was at most that far ahead, so the writes it makes now are above
    anything a peer holds of it, and peers that count the node complete up to an old version still take them.
    A new name has nothing before it: its clock is the wall clock. A file `replicator restore` put in place is judged
    once, by `own_writes.restore`, its floor at least the wall clock `wall_us` whatever the lead.
    """
    epoch = _settled(conn, node)
    if epoch is not None:
        return epoch
    conn.execute("BEGIN IMMEDIATE")
    try:
        fresh = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'").fetchone() is None
        fresh = fresh or _meta(conn, "epoch") is None
        for statement in _SCHEMA:
            conn.execute(statement)
        audit_columns = {row[1] for row in conn.execute("PRAGMA table_info(audit)")}
        for column in _ADDED_AUDIT_COLUMNS:
            if column.split()[0] not in audit_columns:
                conn.execute(f"ALTER TABLE audit ADD COLUMN {column}")
        _add_digests(conn)
        owner = _meta(conn, "owner")
        conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('epoch', ?)", (secrets.token_hex(16),))
        conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('hlc', 0)")
        if owner is None:
            conn.execute(
                "INSERT OR IGNORE INTO origins (origin, top) SELECT origin, max(version) FROM records GROUP BY origin"
            )
            if fresh:
                own_writes.begin(conn, history=history, clock_floor=clock_floor_us, born=born_us)
            else:
                own_writes.begin(conn, history=own_writes.NEW, clock_floor=0)
        elif owner != node:
            if not _meta(conn, "recovering"):
                row = conn.execute("SELECT top FROM origins WHERE origin = ?", (owner,)).fetchone()
                conn.execute(_RAISE_COMPLETE, (owner, int(row[0]) if row is not None else 0))
            own_writes.begin(conn, history=own_writes.LOST, clock_floor=clock_floor_us)
        elif own_writes.restored(conn):
            own_writes.restore(conn, node, clock_floor=max(clock_floor_us, wall_us))
        conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('owner', ?)", (node,))
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        epoch = str(_meta(conn, "epoch"))
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return epoch


def _add_digests(conn: sqlite3.Connection) -> None:
    """Give a file the checksum columns, the digests and their triggers it lacks (inside `_initialize`).

    A file of an earlier schema gets its rows checksummed from the content they hold now: that content is all
    there is to trust. When a trigger is missing (a new file, an earlier schema, or one dropped behind the
    node's back), the digests are rebuilt from the rows, since changes made without it did not move them.
    """
    columns = {row[1] for row in conn.execute("PRAGMA table_info(records)")}
    # Before version 4 there were no checksums, or (in a development build) ones of another hash.
    legacy = "checksum" not in columns or conn.execute("PRAGMA user_version").fetchone()[0] < CHECKSUMS_SINCE
    for column in _ADDED_COLUMNS:
        if column.split()[0] not in columns:
            conn.execute(f"ALTER TABLE records ADD COLUMN {column}")
    present = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'")}
    if legacy:
        for trigger in present:
            if trigger.startswith("records_digest_"):
                conn.execute(f"DROP TRIGGER {trigger}")
        present = set()
        rows = conn.execute(
            "SELECT rowid, tbl, id, CAST(value AS BLOB), version, origin, tombstone FROM records"
        ).fetchall()
        conn.executemany(
            "UPDATE records SET bucket = ?, checksum = ? WHERE rowid = ?",
            [(*_row(*row)[6:], rowid) for rowid, *row in rows],
        )
    for statement in _DIGESTS:
        conn.execute(statement)
    if not present.issuperset(_TRIGGERS) or "records_digest_insert" in present:
        _rebuild_digests(conn)


def _add_to_digests(conn: sqlite3.Connection, rows: Iterable[tuple]) -> None:
    """Add rows just written (laid out as `_row` makes them) to their buckets' digests, one statement per bucket.
    The update trigger has already taken out what a replaced row held."""
    cells: dict[tuple[str, int], list[int]] = {}
    for row in rows:
        key = (row[0], row[6])
        cell = cells.get(key)
        if cell is None:
            cells[key] = [1, row[5] == 0, row[7]]
        else:
            cell[0] += 1
            cell[1] += row[5] == 0
            cell[2] ^= row[7]
    conn.executemany(_ADD_TO_DIGEST, [(tbl, bucket, *cell) for (tbl, bucket), cell in cells.items()])


def _count_digests(conn: sqlite3.Connection, table: str | None = None) -> dict[tuple[str, int], list[int]]:
    """Every bucket digest recounted from the rows, as {(table, bucket): [count, live, xor]}."""
    where, args = ("WHERE tbl = ?", (table,)) if table is not None else ("", ())
    counted: dict[tuple[str, int], list[int]] = {}
    for tbl, bucket, tombstone, stored in conn.execute(
        f"SELECT tbl, coalesce(bucket, -1), tombstone, coalesce(checksum, 0) FROM records {where}", args
    ):
        cell = counted.get((tbl, bucket))
        if cell is None:
            cell = counted[(tbl, bucket)] = [0, 0, 0]
        cell[0] += 1
        cell[1] += tombstone == 0
        cell[2] ^= stored
    return counted


def _rebuild_digests(conn: sqlite3.Connection) -> None:
    conn.execute("DELETE FROM digests")
    conn.executemany(
        "INSERT INTO digests (tbl, bucket, count, live, xor) VALUES (?, ?, ?, ?, ?)",
        [(tbl, bucket, *cell) for (tbl, bucket), cell in _count_digests(conn).items()],
    )


def _clock_floor(clock: hlc.WallClock, lead: float) -> int:
    """The clock value a recovering file starts from: the next write gets the wall clock plus `lead`."""
    return clock() // 1000 + int(lead * 1_000_000) - 1 if lead > 0 else 0


def _build_file(
    path: Path,
    node: str,
    clock_floor_us: int,
    dropped: DeletionFloors = NO_DELETION,
    history: str = own_writes.LOST,
    born_us: int = 0,
    room: Callable[[Path], AbstractContextManager[None]] | None = None,
) -> None:
    """Make a new database file aside, in WAL mode with its schema and epoch, then link it into place.

    Processes that create the same database at once each build their own file and only the first link
    wins, so no process ever opens a half-made file or races another to switch it to WAL mode. A database that
    was deleted cluster-wide is born with its deletion floor (`Database.drop_through`): no process ever sees it
    without, so nothing the deletion covers can land in it. `room(path)` is held around the link: it refuses a
    file past the node's limit (`Store._room`).
    """
    spare = path.with_name(f".{path.name}.{secrets.token_hex(8)}.new")
    conn = sqlite3.connect(spare, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = WAL").fetchone()
        _initialize(conn, node, clock_floor_us, history, born_us)
        if dropped:
            conn.execute("BEGIN IMMEDIATE")
            held = deletion.raise_floors(conn, node, dropped)
            # Nothing to purge in a new file.
            deletion.set_purged(conn, held)
            conn.execute("COMMIT")
    finally:
        # Closing the only connection checkpoints the WAL into the file and removes it.
        conn.close()
    try:
        with room(path) if room is not None else nullcontext():
            os.link(spare, path)
    except FileExistsError:
        pass
    finally:
        for suffix in ("", "-wal", "-shm"):
            Path(f"{spare}{suffix}").unlink(missing_ok=True)


def mark_restored(path: Path, taken_at: float) -> None:
    """Mark a database file copied out of a backup, not yet in place, so that the node opens it as restored
    (`shared.own_writes.restore`); `taken_at` is the backup's time. Also puts it in WAL mode: the processes of the
    node that open it first must not race to switch it (`_build_file`)."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = WAL").fetchone()
        conn.execute("BEGIN IMMEDIATE")
        own_writes.mark_restored(conn, taken_at)
        conn.execute("COMMIT")
    finally:
        conn.close()  # the only connection: the WAL is checkpointed into the file and removed


def _clear_statements(conn: sqlite3.Connection) -> None:
    """Drop the statements the connection keeps prepared (`cached_statements`, 128 by default): several KiB each,
    kept until the connection closes. The sqlite3 module offers no call for it; its cache is the functools LRU the
    connection holds, which the garbage collector's view of the connection shows. Where it does not (another
    Python), nothing is dropped."""
    for held in gc.get_referents(conn):
        if isinstance(held, _LRU_CACHE):
            held.cache_clear()


# Idle databases closed per trim round at most (`Store._release_idle`). Closing one checkpoints its WAL into the
# file and syncs it (and the next write to it syncs a new WAL and the directory), a few milliseconds on a disk, and
# the round runs on the process's loop: closing 500 databases that went idle together held a loop 0.4 to 1.9 s.
# 16 per round of 5 s bound the pause to tens of milliseconds, and 1,000 idle databases close within five minutes.
RELEASE_PER_ROUND = 16

_LRU_CACHE = type(functools.lru_cache(maxsize=1)(lambda: None))
# What holds a database nobody uses, as `sys.getrefcount` counts it in `Store._close_unheld`: the Store's dict, that
# method's local and getrefcount's own argument.
_UNHELD_REFERENCES = 3


def _forget_closed_cursors(conn: sqlite3.Connection) -> None:
    """Drop the connection's references to its cursors that are gone. Every `execute` makes a cursor, and the
    connection keeps a weak reference to each in a list it prunes only every 200 cursors: up to 16 KiB of dead
    references, kept as long as the connection lives (an idle database polled for changes runs through them again
    and again). The list is the connection's own, seen by the garbage collector like the statement cache; where it
    is not (another Python), nothing is dropped."""
    for held in gc.get_referents(conn):
        if type(held) is list and held and all(type(ref) is weakref.ref for ref in held):
            held[:] = [ref for ref in held if ref() is not None]


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
        clock_lead: float = 0.0,
        dropped: DeletionFloors = NO_DELETION,
        history: str = own_writes.LOST,
        room: Callable[[Path], AbstractContextManager[None]] | None = None,
    ) -> None:
        """`dropped`: the deletion floors a file created here is born with (see `drop_through`). `history`: what
        this node knows of its earlier writes to it (`shared.own_writes`: new, unknown or lost). `room`: held while
        a new file is linked into place (`Store._room`)."""
        self.name = name
        self.path = path
        self._node = node
        self._clock = clock
        self._lock = threading.RLock()
        # data_version() combines SQLite's count of other connections' commits with our own commit count.
        self._changes = 0
        # Records this process found damaged (each counted once, when it marked it), for the failures metric.
        self.checksum_failures = 0
        # `trim`: the commit count it last saw, whether the connection is lean, the cache size to give back.
        self._changes_trimmed = 0
        self._lean = False
        self._full_cache: int | None = None
        self._seen_data_version = 0
        # Called with the database's name after every commit that changed the file (see `Store.on_commit`).
        self.on_commit: Callable[[str], None] | None = None
        if create and not path.exists():
            _build_file(path, node, _clock_floor(clock, clock_lead), dropped, history, clock() // 1000, room)
        try:
            # absolute(), not resolve(): the name itself is opened, never what a link in its place points at.
            self._conn = sqlite3.connect(
                f"{path.absolute().as_uri()}?mode=rw",
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
            self.epoch: str = _initialize(self._conn, node, _clock_floor(clock, clock_lead), wall_us=clock() // 1000)
            self._seen_data_version = self._conn.execute("PRAGMA data_version").fetchone()[0]
        except BaseException:
            self._conn.close()
            raise

    @property
    def node(self) -> str:
        """The node this file belongs to: the origin of its local writes."""
        return self._node

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    @property
    def lean(self) -> bool:
        """Idle: nobody committed to it for a trim round (`trim`)."""
        return self._lean

    def release(self, *, lean_only: bool = True) -> bool:
        """Close the connection if the database is lean (or `lean_only` is False), not in use and has no damaged
        records left to count (`Store._release_idle`, `Store.release`, which make sure no one holds this object);
        True when it closed. Never waits."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if (lean_only and not self._lean) or self.checksum_failures or self._conn.in_transaction:
                return False
            self._conn.close()
            return True
        finally:
            self._lock.release()

    def trim(self) -> bool:
        """Called every few seconds (`Store.trim`): a database nobody committed to since the last call becomes lean,
        one that was committed to again gets its full cache back. True when it became lean now. Never waits for a
        caller using the connection: it is left for the next call.

        Every process keeps one connection per database it has touched, and an idle database's connection kept
        about 100 KiB in each process: SQLite's first 20 cache pages (allocated at once, on the first page read,
        even by `PRAGMA data_version`) and the statements it had prepared. Lean, it keeps at most LEAN_CACHE_PAGES
        pages, which SQLite then allocates one by one, and no statement it is not preparing again. Reads run as
        fast on the lean cache (the pages come from the OS's file cache); writes take about twice as long, which is
        why a database committed to goes back to its full cache on the next call. Every call, busy or idle, drops
        the references the connection keeps to cursors that are gone (`_forget_closed_cursors`)."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            active, self._changes_trimmed = self._changes != self._changes_trimmed, self._changes
            conn = self._conn
            _forget_closed_cursors(conn)
            if self._full_cache is None:
                self._full_cache = conn.execute("PRAGMA cache_size").fetchone()[0]
            if active or self._lean:
                if active and self._lean:
                    conn.execute(f"PRAGMA cache_size = {self._full_cache}")
                    self._lean = False
                return False
            conn.execute(f"PRAGMA cache_size = {LEAN_CACHE_PAGES}")
            conn.execute("PRAGMA shrink_memory")
            _clear_statements(conn)
            self._lean = True
            return True
        except sqlite3.Error:
            return False  # closed under us (removed or forgotten since it was listed)
        finally:
            self._lock.release()

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
                self._committed()

    def _committed(self) -> None:
        """Tell the process's listener (the senders waiting on this file) that a commit changed it."""
        notify = self.on_commit
        if notify is None:
            return
        try:
            notify(self.name)
        except Exception as exc:  # the commit stands: a lost notification is caught by the slow poll
            log.warning("commit_notify_failed", database=self.name, error=repr(exc), sample_by=())

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
            first = hlc.tick(self._clock_value(conn), self._clock, len(items))
            rows = [
                _row(table, record_id, value, first + index, self._node, 0)
                for index, (record_id, value) in enumerate(items)
            ]
            self._append(conn, rows)
            last = first + len(items) - 1
            self._set_clock(conn, last)
        return list(range(first, last + 1))

    def put_versioned(self, table: str, id: str, make_value: Callable[[int], bytes]) -> int:
        """Upsert one record written on this node whose value depends on the version it is written at (a registry
        row signs its own version, so a copy replayed at another version is refused); returns the version."""
        check_name(table, "table")
        if not isinstance(id, str) or not id:
            raise BadRecord(f"record in {table!r}: the id must be a non-empty string, not {id!r}")
        with self._write() as conn:
            version = hlc.tick(self._clock_value(conn), self._clock)
            self._append(conn, [_row(table, id, make_value(version), version, self._node, 0)])
            self._set_clock(conn, version)
        return version

    def may_have_written(self, table: str, claims: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """The (id, version) pairs among `claims` that this node may have written under its own origin; the others it
        provably never wrote (`shared.own_writes`)."""
        check_name(table, "table")
        if not claims:
            return []
        with self._read() as conn:
            return own_writes.may_have_written(conn, self._node, table, claims)

    def wrote(self, table: str, claims: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """The (id, version) pairs among `claims` that the audit log shows this node wrote itself."""
        check_name(table, "table")
        if not claims:
            return []
        with self._read() as conn:
            found = own_writes.written(conn, self._node, table, [record_id for record_id, _ in claims])
        return [claim for claim in claims if claim in found]

    def reassert(self, table: str, claims: list[tuple[str, int]]) -> int:
        """Write again, as this node's own and above the claimed versions, what this file holds of records a peer
        holds under this node's origin at versions this node never wrote: the live value, or a tombstone where the
        file holds none. The rewrite supersedes the forged copies wherever they went. A record this file holds
        damaged is left alone (a healthy copy may be ours). Returns how many were written."""
        check_name(table, "table")
        if not claims:
            return 0
        with self._write() as conn:
            rows: list[tuple] = []
            for record_id, _ in claims:
                held = conn.execute(f"SELECT {_CHECKED} FROM records WHERE tbl = ? AND id = ?", (table, record_id))
                row = held.fetchone()
                if row is not None and not _intact(row):
                    continue
                live = row is not None and not row[5]
                rows.append((record_id, row[2] if live else b"", 0 if live else 1))
            if not rows:
                return 0
            top = max(version for _, version in claims)
            first = hlc.tick(max(self._clock_value(conn), top), self._clock, len(rows))
            self._append(
                conn,
                [
                    _row(table, record_id, value, first + index, self._node, tombstone)
                    for index, (record_id, value, tombstone) in enumerate(rows)
                ],
            )
            self._set_clock(conn, first + len(rows) - 1)
        return len(rows)

    def delete(self, table: str, id: str) -> int | None:
        """Tombstone a record; returns the tombstone's version, or None when there is no live record."""
        check_name(table, "table")
        with self._write() as conn:
            held = conn.execute("SELECT tombstone FROM records WHERE tbl = ? AND id = ?", (table, id))
            row = held.fetchone()
            if row is None or row[0]:
                return None
            version = hlc.tick(self._clock_value(conn), self._clock)
            self._append(conn, [_row(table, id, b"", version, self._node, 1)])
            self._set_clock(conn, version)
        return version

    def _append(self, conn: sqlite3.Connection, rows: list[tuple], local: int = own_writes.LOCAL) -> None:
        """Write winning rows to the records (the last one per record, when a batch holds several) and their
        digests, and append every one to the audit log, as this node's own writes (`local`) or as applied."""
        final = {(row[0], row[1]): row for row in rows}
        latest = list(final.values()) if len(final) < len(rows) else rows
        conn.executemany(_UPSERT, latest)
        _add_to_digests(conn, latest)
        now = self._now()
        conn.executemany(_APPEND, [(*row[:6], now, local) for row in rows])
        tops: dict[str, int] = {}
        for row in rows:
            origin, version = row[4], row[3]
            if version > tops.get(origin, 0):
                tops[origin] = version
        conn.executemany(_RAISE_TOP, tops.items())

    # -- reads -----------------------------------------------------------------------------------------

    def get(self, table: str, id: str) -> Entry | None:
        """The live record, or None when it is absent or a tombstone; DamagedRecord when it fails its checksum."""
        with self._lock:
            row = self._conn.execute(
                f"SELECT {_CHECKED} FROM records WHERE tbl = ? AND id = ? AND tombstone = 0", (table, id)
            ).fetchone()
        if row is None:
            return None
        if not _intact(row):
            raise self._damaged([row])[0]
        return _entry(row)

    def scan(self, table: str, after: str | None, limit: int, *, skip_damaged: bool = False) -> list[Entry]:
        """Live records of a table in id order after `after` (from the start when None or empty). A damaged
        record raises DamagedRecord, or is left out with `skip_damaged`."""
        with self._lock:
            rows = self._conn.execute(
                f"SELECT {_CHECKED} FROM records WHERE tbl = ? AND id > ? AND tombstone = 0 ORDER BY id LIMIT ?",
                (table, after or "", limit),
            ).fetchall()
        damaged = [row for row in rows if not _intact(row)]
        if not damaged:
            return [_entry(row) for row in rows]
        found = self._damaged(damaged)
        if not skip_damaged:
            raise found[0]
        bad = {row[1] for row in damaged}
        return [_entry(row) for row in rows if row[1] not in bad]

    def history(
        self,
        table: str,
        id: str,
        limit: int,
        *,
        before: int | None = None,
        scan: int = HISTORY_SCAN,
        chunk: int = HISTORY_CHUNK,
    ) -> History:
        """The record's current state and at most `limit` of its audit entries, newest first, below sequence
        `before` (from the newest when None). At most `scan` entries of the log are read, `chunk` at a time under
        separate holds of the connection; a caller on an event loop runs it in a thread."""
        with self._read() as conn:
            row = conn.execute(f"SELECT {_CHECKED} FROM records WHERE tbl = ? AND id = ?", (table, id)).fetchone()
            head = self._head(conn)
            low, oldest = conn.execute(
                "SELECT seq, committed_at FROM audit WHERE seq = (SELECT min(seq) FROM audit)"
            ).fetchone() or (head + 1, None)
        current = None if row is None else Current(row[3], row[4], bool(row[5]), not _intact(row))
        entries: list[Applied] = []
        cursor = head + 1 if before is None else min(before, head + 1)
        read = 0
        stopped: int | None = None
        reason = ""
        while cursor > low:
            if read >= scan:
                stopped, reason = cursor, "scan"
                break
            start = max(low, cursor - min(chunk, scan - read))
            with self._lock:
                found = self._conn.execute(
                    "SELECT seq, version, origin, tombstone, local, committed_at FROM audit"
                    " WHERE seq >= ? AND seq < ? AND tbl = ? AND id = ? ORDER BY seq DESC",
                    (start, cursor, table, id),
                ).fetchall()
            read += cursor - start
            cursor = start
            entries.extend(
                Applied(seq, version, origin, bool(tombstone), local == own_writes.LOCAL, float(at))
                for seq, version, origin, tombstone, local, at in found
            )
            if len(entries) > limit:
                del entries[limit:]
                stopped, reason = entries[-1].seq, "limit"
                break
        return History(current, entries, stopped, reason, oldest, low > 1)

    def _damaged(self, rows: list[tuple]) -> list[DamagedRecord]:
        """Mark rows read with `_CHECKED` columns as damaged (their bucket digest moves, so the next anti-entropy
        round sees the difference) and describe them. Marking is best effort: a read must not fail on it."""
        newly = [False] * len(rows)
        try:
            with self._write() as conn:
                marked: list[tuple] = []
                for index, row in enumerate(rows):
                    tbl, record_id, tombstone, stored = row[0], row[1], row[5], row[6]
                    if stored == DAMAGED:
                        continue
                    bucket = digests.bucket_of(record_id)
                    changed = conn.execute(
                        "UPDATE records SET checksum = ?, bucket = ? WHERE tbl = ? AND id = ? AND checksum IS ?",
                        (DAMAGED, bucket, tbl, record_id, stored),
                    ).rowcount
                    newly[index] = changed == 1
                    if changed:
                        marked.append((tbl, record_id, None, None, None, tombstone, bucket, DAMAGED))
                _add_to_digests(conn, marked)
        except sqlite3.Error:
            pass
        found = [DamagedRecord(self.name, row[0], row[1], flag) for row, flag in zip(rows, newly, strict=True)]
        for damage in found:
            if damage.newly:
                self.checksum_failures += 1
                log.warning(
                    "checksum_failed",
                    database=self.name,
                    table=damage.table,
                    id=str(damage.id)[:200],
                    sample_by=("database",),
                )
        return found

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
        """The lowest audit sequence still held (last_seq() + 1 when the log is empty)."""
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

    def origins(self) -> dict[str, Origin]:
        """What this file holds of each origin it has heard of, its owner's own origin included."""
        with self._read() as conn:
            rows = conn.execute("SELECT origin, complete, top FROM origins").fetchall()
            own = own_writes.read(conn, self._node)
        held = {origin: Origin(complete=complete, top=top) for origin, complete, top in rows}
        if self._node in held:
            # Not the clock, which other origins' versions move: a peer holding more than our newest write shows our
            # file went back in time.
            held[self._node] = Origin(complete=own.complete, top=own.top)
        return held

    def progress(self) -> dict[str, int]:
        """Where a new subscription resumes each origin: its complete version here (0s left out)."""
        return {origin: held.complete for origin, held in self.origins().items() if held.complete > 0}

    def origin_entries(self, origin: str, after: int, limit: int, upto: int | None = None) -> list[Entry]:
        """The records (tombstones included) whose version `origin` wrote above `after` (and at most `upto`),
        in version order, up to the first damaged one (see `serve_origin`)."""
        return self.serve_origin(origin, after, limit, upto)[0]

    def serve_origin(
        self, origin: str, after: int, limit: int, upto: int | None = None
    ) -> tuple[list[Entry], DamagedRecord | None]:
        """`origin_entries`, and the damaged record it stopped at, if any. A sender must not move a subscriber's
        position past a record it could not send, so the entries end just before it."""
        with self._lock:
            rows = self._conn.execute(
                f"SELECT {_CHECKED} FROM records WHERE origin = ? AND version > ? AND version <= ?"
                " ORDER BY version LIMIT ?",
                (origin, after, hlc.MAX_VERSION if upto is None else upto, limit),
            ).fetchall()
        entries: list[Entry] = []
        for row in rows:
            if not _intact(row):
                return entries, self._damaged([row])[0]
            entries.append(_entry(row))
        return entries, None

    def count_origin(self, origin: str, after: int, upto: int | None = None, cap: int = 5_000_000) -> int:
        """How many records (tombstones included) `origin` wrote above `after` (and at most `upto`), counting at
        most `cap` of them: an index range count, for a copy's progress figures."""
        with self._lock:
            row = self._conn.execute(
                "SELECT count(*) FROM (SELECT 1 FROM records WHERE origin = ? AND version > ? AND version <= ?"
                " LIMIT ?)",
                (origin, after, hlc.MAX_VERSION if upto is None else upto, cap),
            ).fetchone()
        return int(row[0])

    def holds_mark(self, name: str) -> bool | None:
        """On the system database: has this node held database `name` before (see `Store.held`)? None while this
        file is recovering: what the node held is part of what it lost. None too for a name it has no mark of once
        peers showed the node lived before this file (`own_writes.lived_before`: a wiped data directory, a restored
        one): the marks are local, and went with the earlier life (sim seed 88772: a wiped node took a database it
        had held for a new one, and counted its own writes complete over those of its earlier life)."""
        with self._read() as conn:
            if _meta(conn, "recovering"):
                return None
            if _meta(conn, f"held/{name}") is not None:
                return True
            return None if own_writes.lived_before(conn) else False

    def set_held(self, names: list[str], held: bool) -> None:
        """On the system database: mark (or unmark) databases as held by this node. Local to this file: never
        replicated, never in the digests."""
        with self._write() as conn:
            if held:
                conn.executemany(
                    "INSERT OR IGNORE INTO meta (key, value) VALUES (?, 1)", [(f"held/{n}",) for n in names]
                )
            else:
                conn.executemany("DELETE FROM meta WHERE key = ?", [(f"held/{n}",) for n in names])

    def own_history(self) -> own_writes.OwnHistory:
        """What this file knows of its owner's own writes (`shared.own_writes`)."""
        with self._read() as conn:
            return own_writes.read(conn, self._node)

    @property
    def own_floor(self) -> int:
        """The clock value this file began its own history at: every write of this node in the file is above
        it, everything it wrote before (into a file it lost) is at most it."""
        return self.own_history().floor

    @property
    def recovering(self) -> bool:
        """True while this file may lack some of its owner's own writes (see the module docstring)."""
        return self.own_history().recovering

    def regress(self, claimed: int, *, by_deletion: bool = False, peer: str | None = None) -> bool:
        """A peer holds this node's own writes complete up to `claimed`, above anything this file accounts for: the
        file went back in time (restored from an older backup of this node) or lost them. It starts recovering with
        its floor there: the clock moves past `claimed`, so new writes are above what peers hold, and the
        subscriptions ask for the own writes up to it. True when the floor rose (the subscriptions must ask again).

        The writes this file made since it began and that lie at or below `claimed` (its clock started below the
        versions its node wrote before: a clock that stepped back, a file taken for new) are written again above
        it, as they are (`shared.own_writes.restamp`): at their old versions peers counting this node complete past
        them would never be sent them, and a deletion of the database from before could cover them.

        `by_deletion`: `claimed` is a deletion's floor for this node's origin (`drop_through` asks first); it counts
        only above this file's birth, since a file made after a deletion is born below its floors' reach. Writes
        again that a peer's claim left pending (below) and that the floor covers are made at once, whether or not
        the floor rises: the drop would take them at their old versions before the recovery ends (sim seed 34927).

        `peer`: the peer whose claim it is. An unknown file writes again only once every peer has served the own
        writes back (`finish_recovery`, `own_writes.defer_rewrite`): one may hold newer versions of them, its node's
        or another's."""
        # Every subscription asks; almost always the answer is no, and a read answers it without taking the write
        # lock. The write transaction asks again, since another process may have moved first.
        history = self.own_history()
        if by_deletion:
            return self._regress_by_deletion(history, claimed)
        if not history.behind(claimed):
            return False
        with self._write() as conn:
            if claimed <= deletion.floors(conn).floor_of(self._node):
                return False  # what the peer holds of ours was deleted with the database: nothing to take back
            before = own_writes.read(conn, self._node)
            if not own_writes.regress(conn, self._node, claimed):
                return False
            if claimed > self._clock_value(conn):
                self._set_clock(conn, claimed)
            if before.earlier_life(claimed):
                own_writes.defer_rewrite(conn, peer, claimed)
            # Else the peer got what it holds of ours from this file: nothing to write again.
            return True

    def _regress_by_deletion(self, history: own_writes.OwnHistory, floor: int) -> bool:
        """`regress` for a deletion's floor for this node's origin, before `drop_through` applies it. The drop takes
        whatever the floor covers at its old version, so the writes this file made since it began that lie at or
        below the floor and are to be written again above an earlier life's versions are written again now, not
        when the recovery ends: all of them when the floor reaches past the file (`behind_deletion`), else those a
        peer's claim left pending (`own_writes.defer_rewrite`). A claim showing the earlier life can arrive first
        and raise the floor to the deletion's own (the claiming peer's position is the newest version of the
        earlier life, which the deletion covers): the floor then does not rise, yet the pending writes again lie
        under it (sim seed 34927: a wiped node's writes made after the deletion, below its earlier life's
        versions, were dropped on every node)."""
        if not (history.behind_deletion(floor) or history.unknown):
            return False
        with self._write() as conn:
            before = own_writes.read(conn, self._node)
            if before.behind_deletion(floor) and own_writes.regress(conn, self._node, floor):
                if floor > self._clock_value(conn):
                    self._set_clock(conn, floor)
                self._restamp(conn, own_writes.this_life(conn, self._node, before, floor), floor)
                return True
            pending = own_writes.pending_rewrite(conn)
            if pending:
                self._restamp(conn, own_writes.this_life(conn, self._node, before, min(floor, pending)), floor)
            return False

    def _earlier_life(self, conn: sqlite3.Connection, mine: list[Entry], peer: str | None) -> None:
        """Versions of this node's own origin that a peer sent, in an unknown file: any this file did not
        write itself is from the node's earlier life, and its own writes since its birth that lie below it would be
        below what peers count this node complete for, never to be sent them: they are written again above it once
        every peer has served (`finish_recovery`: one may send newer versions of them yet, its node's or another's).
        One newer than a record's version written again, though, is the node's own later write that the file lacks
        (`own_writes.overridden`): it is written again itself, above the one that beat it."""
        history = own_writes.read(conn, self._node)
        if not history.unknown:
            return
        claims = [(entry.table, entry.id, entry.version) for entry in mine]
        later = set(own_writes.overridden(conn, self._node, claims))
        if later:
            newer = sorted((e for e in mine if (e.table, e.id, e.version) in later), key=lambda e: e.version)
            self._restamp(conn, [(e.table, e.id, e.value, int(e.tombstone), e.version) for e in newer], 0)
        by_table: dict[str, list[tuple[str, int]]] = {}
        for table, record_id, version in claims:
            by_table.setdefault(table, []).append((record_id, version))
        earlier = 0
        for table, claims in by_table.items():
            wrote = own_writes.written(conn, self._node, table, [record_id for record_id, _ in claims])
            earlier = max([earlier, *(version for record_id, version in claims if (record_id, version) not in wrote)])
        if earlier:
            own_writes.defer_rewrite(conn, peer, earlier)

    def _restamp(self, conn: sqlite3.Connection, rows: list[tuple[str, str, bytes, int, int]], claimed: int) -> int:
        """Write `rows` (table, id, value, tombstone, the version it had) again as this node's own, above `claimed`
        and the clock, each marked (`own_writes.note_rewritten`) until the recovery ends."""
        if not rows:
            return 0
        first = hlc.tick(max(self._clock_value(conn), claimed), self._clock, len(rows))
        self._append(
            conn,
            [
                _row(table, record_id, value, first + index, self._node, tombstone)
                for index, (table, record_id, value, tombstone, _) in enumerate(rows)
            ],
        )
        own_writes.note_rewritten(
            conn, [(table, record_id, old, first + index) for index, (table, record_id, _, _, old) in enumerate(rows)]
        )
        self._set_clock(conn, first + len(rows) - 1)
        log.warning("own_writes_restamped", database=self.name, records=len(rows), above=claimed)
        return len(rows)

    def count_live(self) -> int:
        """The number of live records the file holds (a table scan of the records)."""
        with self._lock:
            return int(self._conn.execute("SELECT count(*) FROM records WHERE tombstone = 0").fetchone()[0])

    def finish_recovery(self) -> int:
        """The peers have served this node's own writes back: the own origin is complete up to its newest write
        again. Returns the number of live records the file holds."""
        with self._write() as conn:
            history = own_writes.read(conn, self._node)
            claimed = own_writes.take_rewrite(conn)  # every peer has served: whatever is still pending is due
            if claimed:
                self._restamp(conn, own_writes.this_life(conn, self._node, history, claimed), claimed)
            own_writes.finish(conn)
            return int(conn.execute("SELECT count(*) FROM records WHERE tombstone = 0").fetchone()[0])

    # -- applying (subscriber side) --------------------------------------------------------------------

    def apply_batch(
        self,
        entries: list[Entry],
        marks: dict[str, int] | None = None,
        *,
        repair: bool = False,
        peer: str | None = None,
    ) -> int:
        """Apply a peer's records last-writer-wins and raise the origins' complete versions to the sender's
        marks, in one transaction. Returns how many records won.

        A mark is the sender's promise that the receiver, once it holds this batch, holds every version the
        origin wrote up to the mark; the sender keeps it by serving an origin in version order from where the
        subscription said the receiver was complete.

        `repair`: the entries come from an anti-entropy round that judged each one (`Round._takes`): one replaces
        a damaged row here even when it looks older. `peer`: the session's peer, whose versions of this node's own
        origin an unknown file heeds (`_earlier_life`).
        """
        _check_entries(entries)
        marks = marks or {}
        for origin, mark in marks.items():
            check_name(origin, "origin")
            if not 0 <= mark <= hlc.MAX_VERSION:
                raise BadRecord(f"mark {mark} for origin {origin!r} is out of range")
        with self._write() as conn:
            won = self._apply(conn, entries, repair)
            conn.executemany(_RAISE_COMPLETE, marks.items())
            mine = [entry for entry in entries if entry.origin == self._node]
            if mine:
                self._earlier_life(conn, mine, peer)
            # A peer holding versions of ours above our clock (a file restored from an old backup) moves the
            # clock past them, so our next writes are above what that peer counts complete.
            top = max(marks.values(), default=0)
            if top > self._clock_value(conn):
                self._set_clock(conn, top)
        return won

    def _apply(self, conn: sqlite3.Connection, entries: list[Entry], repair: bool = False) -> int:
        if not entries:
            return 0
        floors = deletion.floors(conn)
        if floors:
            # What a deletion of the database covers is gone on every node and never comes back: a peer that has
            # not applied the deletion yet still serves it, and it does not win here.
            entries = [entry for entry in entries if not floors.covers(entry.origin, entry.version)]
            if not entries:
                return 0
        held = self._lookup(conn, entries)
        rows: list[tuple] = []
        # In batch order, each entry against the state the earlier ones left, so a batch carrying several
        # versions of one record ends exactly as if its entries were applied one by one. The winner is the
        # higher (version, origin), and between two contents of one version the higher checksum, so nodes that
        # somehow hold different contents under one version still settle on the same one. A damaged row (see
        # the module docstring) holds nothing worth keeping: a healthy copy of its version or a newer one replaces
        # it. An older-looking one does not: this node's positions may promise the damaged version (its own
        # newest write, say), and a stream from a lagging peer would put the older one back under that promise.
        # Anti-entropy decides those (`repair`), from a peer that has seen everything this node has.
        for entry in entries:
            key = (entry.table, entry.id)
            value = b"" if entry.tombstone else entry.value
            row = _row(entry.table, entry.id, value, entry.version, entry.origin, int(entry.tombstone))
            candidate = (entry.version, entry.origin, row[7])
            current = held.get(key)
            if current is not None and current[2] is not None:
                if current[2] == DAMAGED:
                    if candidate[:2] < current[:2] and not repair:
                        continue
                elif candidate <= current:
                    continue
            held[key] = candidate
            rows.append(row)
        if rows:
            self._append(conn, rows, own_writes.APPLIED)
        top = max(entry.version for entry in entries)
        last = self._clock_value(conn)
        if top > last:
            self._set_clock(conn, hlc.receive(last, top))
        return len(rows)

    @staticmethod
    def _lookup(conn: sqlite3.Connection, entries: list[Entry]) -> dict[tuple[str, str], tuple[int, str, int | None]]:
        """The (version, origin, checksum) held for every record the entries touch, a few IN queries per table."""
        by_table: dict[str, set[str]] = {}
        for entry in entries:
            by_table.setdefault(entry.table, set()).add(entry.id)
        held: dict[tuple[str, str], tuple[int, str, int | None]] = {}
        largest = _IN_SIZES[-1]
        for table, id_set in by_table.items():
            ids = sorted(id_set)
            for start in range(0, len(ids), largest):
                chunk = ids[start : start + largest]
                size = next(size for size in _IN_SIZES if size >= len(chunk))
                chunk.extend(chunk[-1:] * (size - len(chunk)))
                for record_id, version, origin, stored in conn.execute(_LOOKUP[size], (table, *chunk)):
                    held[(table, record_id)] = (version, origin, stored)
        return held

    # -- retention -------------------------------------------------------------------------------------

    def prune_audit(self, retention_seconds: float, now: float) -> int:
        """Delete the audit entries older than the retention window; returns how many were deleted. `now` is
        wall-clock seconds since the epoch, the scale of the store's clock that stamped the entries.

        The audit log is history, not the replication stream: senders serve the records table by origin, so
        pruning never decides what a peer receives, and no holder needs a pin here.
        """
        with self._read() as conn:
            young = conn.execute(
                "SELECT seq FROM audit WHERE committed_at >= ? ORDER BY seq LIMIT 1",
                (now - retention_seconds,),
            ).fetchone()
            # Everything before the first young entry is old; with no young entry, the whole log is.
            floor = young[0] - 1 if young is not None else self._head(conn)
            low = conn.execute("SELECT min(seq) FROM audit").fetchone()[0]
        deleted = 0
        while low is not None and low <= floor:
            high = min(floor, low + _PRUNE_CHUNK - 1)
            with self._write() as conn:
                deleted += conn.execute("DELETE FROM audit WHERE seq <= ?", (high,)).rowcount
            low = high + 1
        return deleted

    # -- deletion of the whole database (DELETE /databases/{name}) -------------------------------------------

    @property
    def dropped_floor(self) -> DeletionFloors:
        """What cluster-wide deletions of the database cover: nothing they cover is applied."""
        with self._lock:
            return deletion.floors(self._conn)

    @property
    def dropped_purged(self) -> DeletionFloors:
        """The deletion floors this file has been purged through: it holds nothing they cover."""
        with self._lock:
            return deletion.purged(self._conn)

    @property
    def clock_version(self) -> int:
        """The file's hybrid logical clock: no version it holds or wrote is above it."""
        with self._lock:
            return self._clock_value(self._conn)

    def put_above(self, table: str, id: str, value: bytes, minimum: int) -> int:
        """Upsert one record written on this node at a version above `minimum` as well as above the clock (a
        deletion marker, whose version must cover what other files of the node hold); returns the version."""
        check_name(table, "table")
        if not isinstance(id, str) or not id:
            raise BadRecord(f"record in {table!r}: the id must be a non-empty string, not {id!r}")
        with self._write() as conn:
            version = max(hlc.tick(self._clock_value(conn), self._clock), minimum + 1)
            if version > hlc.MAX_VERSION:
                raise BadRecord(f"record {table!r}/{id!r}: version {version} is out of range")
            self._append(conn, [_row(table, id, value, version, self._node, 0)])
            self._set_clock(conn, version)
        return version

    def drop_through(self, floors: DeletionFloors, chunk: int = _PRUNE_CHUNK) -> int:
        """The database was deleted cluster-wide: every record and audit entry the floors cover goes, for good.
        Returns how many records (tombstones included) went.

        One transaction stores the floors first: from then on `apply_batch` ignores what they cover, and the clock
        stands past this node's own floor, so every later local write is above it. The records and the audit log
        are then walked in chunks, each its own transaction as in pruning, so a large database does not hold the
        write lock past the other processes' busy timeout; since nothing the floors cover can be written any more,
        one walk finds all of it. The file notes the floors as purged only at the end of the walk: a walk cut short
        (a crash) is made again. The bucket digests follow each deletion (trigger), so they equal those of a file
        that only ever held the survivors. Before the walk, a record whose current version the floors cover goes
        back to the newest version of it the audit log holds that they do not cover, if any (`_restore_uncovered`):
        a write the deletion never saw, replaced here by a covered one before the floors arrived, survives.
        """
        for origin, floor in floors.origins.items():
            check_name(origin, "origin")
            if not 0 <= floor <= hlc.MAX_VERSION:
                raise BadRecord(f"deletion floor {floor} of origin {origin!r} is out of range")
        if not 0 <= floors.every <= hlc.MAX_VERSION:
            raise BadRecord(f"deletion floor {floors.every} is out of range")
        with self._write() as conn:
            floors = deletion.raise_floors(conn, self._node, floors)
        self._restore_uncovered(floors, chunk)
        removed = 0
        after = 0
        while True:
            with self._write() as conn:
                rows = conn.execute(
                    "SELECT rowid, version, origin FROM records WHERE rowid > ? ORDER BY rowid LIMIT ?", (after, chunk)
                ).fetchall()
                dead = [(rowid,) for rowid, version, origin in rows if floors.covers(origin, version)]
                conn.executemany("DELETE FROM records WHERE rowid = ?", dead)
            removed += len(dead)
            if len(rows) < chunk:
                break
            after = rows[-1][0]
        after = 0
        while True:
            with self._write() as conn:
                rows = conn.execute(
                    "SELECT seq, version, origin FROM audit WHERE seq > ? ORDER BY seq LIMIT ?", (after, chunk)
                ).fetchall()
                dead = [(seq,) for seq, version, origin in rows if floors.covers(origin, version)]
                conn.executemany("DELETE FROM audit WHERE seq = ?", dead)
            if len(rows) < chunk:
                break
            after = rows[-1][0]
        with self._write() as conn:
            deletion.set_purged(conn, deletion.purged(conn).merge(floors))
        return removed

    def _restore_uncovered(self, floors: DeletionFloors, chunk: int) -> None:
        """Before `drop_through` removes what the floors cover: a record whose current version they cover but whose
        audit log holds a version they do not (one the covered version replaced here before the floors arrived: a
        write made after the deletion, at a lower version than the covered one, say) goes back to the newest such
        version instead of going, as on a node that took the floors first and that version after. The audit log is
        walked in chunks (read only); the rows are put back in one transaction, each only if still covered then."""
        found: dict[tuple[str, str], tuple] = {}
        after = 0
        while True:
            with self._read() as conn:
                rows = conn.execute(
                    "SELECT a.seq, a.tbl, a.id, CAST(a.value AS BLOB), a.version, a.origin, a.tombstone,"
                    " r.version, r.origin"
                    " FROM audit AS a JOIN records AS r ON r.tbl = a.tbl AND r.id = a.id"
                    " WHERE a.seq > ? ORDER BY a.seq LIMIT ?",
                    (after, chunk),
                ).fetchall()
            for _, tbl, record_id, value, version, origin, tombstone, held, held_by in rows:
                if floors.covers(origin, version) or not floors.covers(held_by, held):
                    continue
                row = _row(tbl, record_id, bytes(value), version, origin, tombstone)
                best = found.get((tbl, record_id))
                if best is None or (version, origin, row[7]) > (best[3], best[4], best[7]):
                    found[(tbl, record_id)] = row
            if len(rows) < chunk:
                break
            after = rows[-1][0]
        if not found:
            return
        with self._write() as conn:
            still = []
            for (tbl, record_id), row in found.items():
                held = conn.execute(
                    "SELECT version, origin FROM records WHERE tbl = ? AND id = ?", (tbl, record_id)
                ).fetchone()
                if held is not None and floors.covers(held[1], held[0]):
                    still.append(row)
            conn.executemany(_UPSERT, still)
            _add_to_digests(conn, still)

    def is_empty(self) -> bool:
        """True when the file holds no record at all, tombstones included."""
        with self._lock:
            return self._conn.execute("SELECT 1 FROM records LIMIT 1").fetchone() is None

    # -- tombstones ------------------------------------------------------------------------------------------

    def purge_tombstones(self, floors: dict[str, int], horizon: int, chunk: int = 5000) -> int:
        """Remove the tombstones every holder has and that are old enough; returns how many went.

        `floors[o]`: every holder of the database (this node included) holds origin o complete up to it, so it
        holds each of o's tombstones up to there, or something newer of the record. `horizon`: the newest version
        old enough to go (the wall clock minus tombstone_retention). Each origin is walked forward once, from
        where the last purge stopped; a tombstone that arrives later with a version below that stays (harmless).
        """
        removed = 0
        for origin, floor in sorted(floors.items()):
            upto = min(floor, horizon)
            with self._read() as conn:
                row = conn.execute("SELECT scanned FROM purged WHERE origin = ?", (origin,)).fetchone()
            scanned = int(row[0]) if row is not None else 0
            while upto > scanned:
                with self._write() as conn:
                    rows = conn.execute(
                        "SELECT rowid, version, tombstone FROM records WHERE origin = ? AND version > ?"
                        " AND version <= ? ORDER BY version LIMIT ?",
                        (origin, scanned, upto, chunk),
                    ).fetchall()
                    reached = rows[-1][1] if len(rows) == chunk else upto
                    dead = [(rowid,) for rowid, _, tombstone in rows if tombstone]
                    conn.executemany("DELETE FROM records WHERE rowid = ?", dead)
                    conn.execute("INSERT OR REPLACE INTO purged (origin, scanned) VALUES (?, ?)", (origin, reached))
                removed += len(dead)
                scanned = reached
        return removed

    # -- digests and anti-entropy --------------------------------------------------------------------------

    def digest(self) -> dict[str, dict[str, int | str]]:
        """Per table: the number of live records and a sha256 over its bucket digests, tombstones included.

        The bucket digests cover every row's id, version, origin, tombstone flag and content checksum, so two
        nodes with equal digests hold the same data; reading them costs 4,096 rows per table, not a table scan.
        """
        result: dict[str, dict[str, int | str]] = {}
        with self._read() as conn:
            rows = conn.execute(
                "SELECT tbl, bucket, count, live, xor FROM digests WHERE count > 0 ORDER BY tbl, bucket"
            ).fetchall()
        by_table: dict[str, list[tuple]] = {}
        for row in rows:
            by_table.setdefault(row[0], []).append(row[1:])
        for table, buckets in by_table.items():
            hashed = hashlib.sha256(msgspec.msgpack.encode([(b, c, x) for b, c, _, x in buckets]))
            result[table] = {"count": sum(live for _, _, live, _ in buckets), "digest": hashed.hexdigest()}
        return result

    def bucket_digests(self, table: str) -> dict[int, digests.Digest]:
        """The stored (count, xor) of every non-empty bucket of a table (bucket -1: rows not placed yet)."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT bucket, count, xor FROM digests WHERE tbl = ? AND count > 0", (table,)
            ).fetchall()
        return {bucket: (count, xor) for bucket, count, xor in rows}

    def recount_digests(self, table: str) -> dict[int, digests.Digest]:
        """`bucket_digests` recomputed from the rows, a table scan: what the stored digests must equal."""
        with self._read() as conn:
            counted = _count_digests(conn, table)
        return {bucket: (count, xor) for (_, bucket), (count, _, xor) in counted.items() if count}

    def roots(self) -> dict[str, digests.Digest]:
        """Each table's root digest: its placed buckets combined."""
        with self._lock:
            rows = self._conn.execute("SELECT tbl, count, xor FROM digests WHERE bucket >= 0 AND count > 0")
            result: dict[str, list[int]] = {}
            for table, count, xor in rows:
                cell = result.setdefault(table, [0, 0])
                cell[0] += count
                cell[1] ^= xor
        return {table: (count, xor) for table, (count, xor) in result.items()}

    def rows_under(self, table: str, level: int, prefixes: list[int]) -> int:
        """How many rows the bucket digests count where a query of these nodes reads: under each node of a level
        up to the stored buckets, the whole bucket of each one below (counted once per bucket). What a `children`
        or `summaries` call of the nodes will read, known before reading it (rows written behind the node's back
        are counted only once the scrub recounts their bucket; the scans enforce their limits themselves)."""
        with self._lock:
            conn = self._conn
            if level <= digests.STORED_LEVEL:
                return sum(
                    conn.execute(
                        "SELECT coalesce(sum(count), 0) FROM digests WHERE tbl = ? AND bucket >= ? AND bucket < ?",
                        (table, *digests.bucket_range(level, prefix)),
                    ).fetchone()[0]
                    for prefix in prefixes
                )
            return sum(
                conn.execute(
                    "SELECT coalesce(sum(count), 0) FROM digests WHERE tbl = ? AND bucket = ?", (table, bucket)
                ).fetchone()[0]
                for bucket in {digests.bucket_above(level, prefix) for prefix in prefixes}
            )

    def _bucket_chunks(self, table: str, low: int, high: int, columns: str, chunk: int) -> Iterator[list[tuple]]:
        """The rows of buckets [low, high) of a table as lists of at most `chunk` rows, each list read under its own
        hold of the connection: a thread answering a peer lets the event loop's own reads of the file in between
        (the rows of one answer need not come from one snapshot; each is a state the row had). The first column
        of `columns` must be the rowid."""
        bucket: int | None = low
        after = 0
        while bucket is not None:
            with self._read() as conn:
                rows = conn.execute(
                    f"SELECT {columns} FROM records WHERE tbl = ? AND bucket = ? AND rowid > ? ORDER BY rowid LIMIT ?",
                    (table, bucket, after, chunk),
                ).fetchall()
                if len(rows) < chunk:
                    after = 0
                    bucket = conn.execute(
                        "SELECT min(bucket) FROM records WHERE tbl = ? AND bucket > ? AND bucket < ?",
                        (table, bucket, high),
                    ).fetchone()[0]
                else:
                    after = rows[-1][0]
            if rows:
                yield rows

    def children(
        self, table: str, level: int, prefixes: list[int], scan_limit: int | None = None
    ) -> list[list[digests.Digest]]:
        """For each node (level, prefix) of a table's tree, the digests of its FANOUT children. Below the stored
        buckets they are computed from the rows of each bucket that holds a node, read once per bucket; past
        `scan_limit` rows read, `ScanLimit`."""
        if not 0 <= level < digests.MAX_LEVEL:
            raise ValueError(f"level {level} has no children")
        if level < digests.STORED_LEVEL:
            with self._read() as conn:
                rows = conn.execute(
                    "SELECT bucket, count, xor FROM digests WHERE tbl = ? AND bucket >= 0 AND count > 0", (table,)
                )
                buckets = {bucket: (count, xor) for bucket, count, xor in rows}
            return [digests.children_from_buckets(buckets, level, prefix) for prefix in prefixes]
        by_bucket: dict[int, set[int]] = {}
        for prefix in prefixes:
            by_bucket.setdefault(digests.bucket_above(level, prefix), set()).add(prefix)
        found: dict[int, list[digests.Digest]] = {}
        scanned = 0
        for bucket, nodes in by_bucket.items():
            chunks = self._bucket_chunks(
                table, bucket, bucket + 1, "rowid, id, bucket, coalesce(checksum, 0)", SCAN_CHUNK
            )
            cells = {node: [[0, 0] for _ in range(digests.FANOUT)] for node in nodes}
            for chunk in chunks:
                scanned += len(chunk)
                if scan_limit is not None and scanned > scan_limit:
                    raise ScanLimit(f"more than {scan_limit} rows to read under these nodes")
                digests.add_children((row[1:] for row in chunk), level, cells)
            found.update((node, [(c, x) for c, x in children]) for node, children in cells.items())
        return [found[prefix] for prefix in prefixes]

    def summaries(
        self,
        table: str,
        level: int,
        prefixes: list[int],
        limit: int | None = None,
        scan_limit: int | None = None,
    ) -> list[tuple[str, int, str, bool, int | None]]:
        """The rows under the nodes (level, prefix) of a table's tree as (id, version, origin, tombstone,
        checksum), each verified first: a damaged row is marked and reported with checksum None. More than `limit`
        rows, or (below the stored buckets) more than `scan_limit` rows of their buckets read: `ScanLimit`. Values
        are read and verified VERIFY_CHUNK rows at a time, only those of the rows returned. Each id comes once (a row
        written again between two chunks may be read twice: the later read stands)."""
        result: dict[str, tuple[str, int, str, bool, int | None]] = {}
        damaged: list[tuple] = []

        def verify(chunk: list[tuple]) -> None:
            for row in chunk:
                checked = row[1:8]
                stored = checked[6]
                if not _intact(checked):
                    damaged.append((*checked[:2], None, *checked[3:]))  # the value is not needed to mark it
                    stored = None
                result[checked[1]] = (checked[1], checked[3], checked[4], bool(checked[5]), stored)
                if limit is not None and len(result) > limit:
                    raise ScanLimit(f"more than {limit} rows under these nodes")

        if level <= digests.STORED_LEVEL:
            for prefix in prefixes:
                low, high = digests.bucket_range(level, prefix)
                for chunk in self._bucket_chunks(table, low, high, f"rowid, {_CHECKED}", VERIFY_CHUNK):
                    verify(chunk)
        else:
            by_bucket: dict[int, set[int]] = {}
            for prefix in prefixes:
                by_bucket.setdefault(digests.bucket_above(level, prefix), set()).add(prefix)
            scanned = 0
            for bucket, nodes in by_bucket.items():
                matching: list[int] = []
                for chunk in self._bucket_chunks(table, bucket, bucket + 1, "rowid, id", SCAN_CHUNK):
                    scanned += len(chunk)
                    if scan_limit is not None and scanned > scan_limit:
                        raise ScanLimit(f"more than {scan_limit} rows to read under these nodes")
                    matching.extend(
                        rowid for rowid, record_id in chunk if digests.path(bucket, record_id, level) in nodes
                    )
                    if limit is not None and len(result) + len(matching) > limit:
                        raise ScanLimit(f"more than {limit} rows under these nodes")
                for start in range(0, len(matching), VERIFY_CHUNK):
                    rowids = matching[start : start + VERIFY_CHUNK]
                    marks = ", ".join("?" * len(rowids))
                    with self._read() as conn:
                        rows = conn.execute(
                            f"SELECT rowid, {_CHECKED}, bucket FROM records WHERE rowid IN ({marks})", rowids
                        ).fetchall()
                    # A row replaced or moved since the scan read its id is left out, as if read before.
                    verify(
                        [
                            row[:8]
                            for row in rows
                            if row[1] == table and row[8] == bucket and digests.path(bucket, row[2], level) in nodes
                        ]
                    )
        if damaged:
            self._damaged(damaged)
        return list(result.values())

    def fetch(self, table: str, ids: list[str]) -> tuple[list[Entry], list[str]]:
        """The records (tombstones included) of `ids` that are held and intact, and the ids found damaged."""
        entries, damaged, _ = self.fetch_within(table, ids, None)
        return entries, damaged

    def fetch_within(self, table: str, ids: list[str], budget: int | None) -> tuple[list[Entry], list[str], list[str]]:
        """`fetch` within a budget of bytes (ids and values): the records it serves stop before the one that would
        take them past it, the first excepted, and the ids not looked at come back third, in order, for a next
        call. Each record is read under its own hold of the connection."""
        entries: list[Entry] = []
        damaged: list[tuple] = []
        size = 0
        left: list[str] = []
        for index, record_id in enumerate(ids):
            with self._lock:
                row = self._conn.execute(
                    f"SELECT {_CHECKED} FROM records WHERE tbl = ? AND id = ?", (table, record_id)
                ).fetchone()
            if row is None:
                continue
            if not _intact(row):
                damaged.append((*row[:2], None, *row[3:]))
                continue
            cost = len(row[1]) + len(row[2])
            if budget is not None and entries and size + cost > budget:
                left = ids[index:]
                break
            size += cost
            entries.append(_entry(row))
        if damaged:
            self._damaged(damaged)
        return entries, [row[1] for row in damaged], left

    def purged(self) -> dict[str, int]:
        """How far each origin's tombstones have been purged here (`purge_tombstones`): every holder had them."""
        with self._lock:
            rows = self._conn.execute("SELECT origin, scanned FROM purged").fetchall()
        return {origin: int(scanned) for origin, scanned in rows if scanned > 0}

    def drop_superseded(self, table: str, rows: list[tuple[str, int, str]]) -> int:
        """Remove the rows of `rows` (id, version, origin) that this file still holds at exactly that version and
        origin: a peer showed they were superseded by a deletion it has since purged (`workers.antientropy`). A
        row that moved on since (a newer version arrived) stays. No audit entry, as in a purge; returns how many
        went."""
        with self._write() as conn:
            return sum(
                conn.execute(
                    "DELETE FROM records WHERE tbl = ? AND id = ? AND version = ? AND origin = ?",
                    (table, record_id, version, origin),
                ).rowcount
                for record_id, version, origin in rows
            )

    def scrub(self, after: int, limit: int) -> tuple[int | None, list[DamagedRecord]]:
        """Verify up to `limit` rows in rowid order after `after`: their checksums, and their buckets. Returns the
        last rowid checked (None at the end of the table) and the records found damaged."""
        with self._lock:
            rows = self._conn.execute(
                f"SELECT rowid, {_CHECKED}, bucket FROM records WHERE rowid > ? ORDER BY rowid LIMIT ?",
                (after, limit),
            ).fetchall()
        bad = [row[1:8] for row in rows if not _intact(row[1:8]) or row[8] != digests.bucket_of(row[2])]
        found = self._damaged(bad) if bad else []
        return (rows[-1][0] if len(rows) == limit else None), found

    def check_digests(self) -> int:
        """Recount every bucket digest from the rows and store what differs (the digests were edited, or a
        trigger was dropped and changes went uncounted). Returns how many buckets were wrong. A table scan, under
        a read snapshot; the write lock is taken only when something is wrong."""
        with self._read() as conn:
            if not _wrong_digests(conn):
                return 0
        with self._write() as conn:
            wrong = _wrong_digests(conn)
            conn.executemany(
                "INSERT OR REPLACE INTO digests (tbl, bucket, count, live, xor) VALUES (?, ?, ?, ?, ?)",
                [(tbl, bucket, *cell) for (tbl, bucket), cell in wrong.items()],
            )
        return len(wrong)


def _wrong_digests(conn: sqlite3.Connection) -> dict[tuple[str, int], list[int]]:
    """The buckets whose stored digest is not what the rows add up to, with what they add up to."""
    counted = _count_digests(conn)
    stored = {
        (tbl, bucket): [count, live, xor]
        for tbl, bucket, count, live, xor in conn.execute("SELECT tbl, bucket, count, live, xor FROM digests")
    }
    empty = [0, 0, 0]
    return {
        key: counted.get(key, empty)
        for key in counted.keys() | stored.keys()
        if counted.get(key, empty) != stored.get(key, empty)
    }


class Store:
    """The databases of one node under `data_dir`, as this process opens them (one connection each)."""

    def __init__(
        self,
        data_dir: str | Path,
        node_name: str,
        clock: hlc.WallClock = time.time_ns,
        *,
        synchronous: str = "NORMAL",
        clock_lead: float = 0.0,
        holdings: bool = False,
        max_databases: int | None = None,
    ) -> None:
        """`clock_lead`: how far ahead of the wall clock a recovering file's clock starts (max_clock_skew).
        `holdings`: the system database remembers which databases this node has held (`held`), so that a new file
        of a name never held starts with no history to recover; without it every new file is taken as lost.
        `max_databases`: no file is created past this many databases in the directory (the system database not
        counted), whichever process of the node asks (TooManyDatabases); None for no limit."""
        self.data_dir = Path(data_dir)
        self.max_databases = max_databases
        self._holdings = holdings
        self.node = check_name(node_name, "node")
        self._clock = clock
        self._synchronous = synchronous
        self._clock_lead = clock_lead
        self._databases: dict[str, Database] = {}
        self._blocked: set[str] = set()  # databases being removed: not opened until unblocked
        # Files refused (`refusal`) and logged as such by this Store: one warning per file and process, not one per
        # request; a file that is fine again leaves the set, and is logged again if it is refused again.
        self._refused: set[Path] = set()
        self._lock = threading.Lock()
        # Called with a database's name after each commit of this process that changed it, from the thread that
        # committed (`shared.notify`, `workers.changes`).
        self.on_commit: Callable[[str], None] | None = None

    def path(self, name: str) -> Path:
        return self.data_dir / f"{check_name(name, 'database')}{SUFFIX}"

    def database(self, name: str, create: bool = False) -> Database:
        """The database `name`, opened once per Store; UnknownDatabase if it has no file, unless `create`;
        DatabaseRemoving while it is blocked; RefusedFile, created or not, when its file is refused (`refusal`). A
        database created here after a deletion is born with its floor, and one this node never held (see `held`) with
        no history to recover."""
        path = self.path(name)
        floor = NO_DELETION
        history = own_writes.LOST
        creating = create and name not in self._databases and not path.exists()
        if creating and name == SYSTEM:
            # Nothing to ask: it is the file that would know. With `holdings` its history is unknown until peers
            # have served it (`shared.own_writes`).
            history = own_writes.UNKNOWN if self._holdings else own_writes.LOST
        elif creating:
            # Outside the lock: both open the system database.
            floor = self.dropped_floor(name)
            held = self.held(name)
            history = own_writes.LOST if held else own_writes.UNKNOWN if held is None else own_writes.NEW
        with self._lock:
            if name in self._blocked:
                raise DatabaseRemoving(name)
            db = self._databases.get(name)
            if db is not None:
                return db
            self._guard_file(name, path)
            if not create and not path.exists():
                raise UnknownDatabase(name)
            if create:
                self.data_dir.mkdir(parents=True, exist_ok=True)
            db = Database(
                path,
                name,
                self.node,
                self._clock,
                create=create,
                synchronous=self._synchronous,
                clock_lead=self._clock_lead,
                dropped=floor,
                history=history,
                room=self._room if name != SYSTEM and self.max_databases is not None else None,
            )
            db.on_commit = self._committed
            self._databases[name] = db
        if creating and name != SYSTEM:
            self.note_held([name])
        return db

    @contextmanager
    def _room(self, path: Path) -> Iterator[None]:
        """Hold the data directory's creation lock while a new database file is linked into place, and refuse the
        file when the directory holds `max_databases` already. The processes of a node are separate (a worker's
        client create, another worker's subscription) and share the directory: each checks and links under the
        same exclusive flock, so no two of them both take the last place."""
        fd = os.open(self.data_dir / CREATION_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            limit = self.max_databases
            if limit is not None and not path.exists():
                held = sum(1 for name in self.names() if name != SYSTEM)
                if held >= limit:
                    raise TooManyDatabases(path.name[: -len(SUFFIX)], held, limit)
            yield
        finally:
            os.close(fd)  # releases the flock

    # -- what this node has held (meta `held/<name>` of the system database, never replicated) ------------------

    def held(self, name: str) -> bool | None:
        """Has this node held `name` before: is a new file of it a lost one? True without `holdings` (every new file
        is taken as lost) and for the system database; else what the system database remembers: a database is
        marked when a file of it is made or found here, and unmarked only when a cluster-wide deletion removes it
        (`remove`). None while the system database is itself recovering: not known (a new file's history is then
        unknown, `shared.own_writes`)."""
        if not self._holdings or name == SYSTEM:
            return True
        try:
            system = self.database(SYSTEM)
        except UnknownDatabase:
            return None
        return system.holds_mark(name)

    def note_held(self, names: Iterable[str]) -> None:
        """Mark databases as held by this node (`held`)."""
        if not self._holdings:
            return
        wanted = [name for name in names if name != SYSTEM]
        if wanted:
            self.database(SYSTEM, create=True).set_held(wanted, True)

    def _committed(self, name: str) -> None:
        if self.on_commit is not None:
            self.on_commit(name)

    def take_checksum_failures(self) -> dict[str, int]:
        """Damaged records found since the last call, by database (the open ones)."""
        with self._lock:
            databases = list(self._databases.values())
        taken: dict[str, int] = {}
        for db in databases:
            count = db.checksum_failures
            if count:
                db.checksum_failures -= count
                taken[db.name] = count
        return taken

    def names(self) -> list[str]:
        """The databases on disk, whether this process has opened them or not; a refused file (`refusal`) is none."""
        if not self.data_dir.is_dir():
            return []
        with os.scandir(self.data_dir) as listing:
            links = {entry.name: entry.is_symlink() for entry in listing}
        found = []
        for file, link in links.items():
            stem = file[: -len(SUFFIX)]
            if not file.endswith(SUFFIX) or not NAME_RE.match(stem):
                continue
            if link or any(links.get(file + suffix) for suffix in SIDECARS):
                try:
                    self._guard_file(stem, self.data_dir / file)
                except RefusedFile:
                    continue
            found.append(stem)
        return sorted(found)

    def _guard_file(self, name: str, path: Path) -> None:
        """RefusedFile when the store will not open `path` (`refusal`), logged the first time this Store refuses it."""
        reason = refusal(path)
        if reason is None:
            self._refused.discard(path)
            return
        if path not in self._refused:
            self._refused.add(path)
            log.warning("database_file_refused", database=name, path=str(path), reason=reason)
        raise RefusedFile(name, path, reason)

    def close(self) -> None:
        """Close every open database, CLOSE_THREADS at once, each close still checkpointing and syncing what was
        committed: one after another, a thousand databases take longer than a worker's shutdown deadline."""
        with self._lock:
            databases = list(self._databases.values())
            self._databases.clear()
        if len(databases) <= 1:
            for db in databases:
                db.close()
            return
        with ThreadPoolExecutor(min(CLOSE_THREADS, len(databases)), thread_name_prefix="store-close") as pool:
            # Every close is submitted and runs even when one fails; the first failure is raised once all are done.
            closes = [pool.submit(db.close) for db in databases]
        for close in closes:
            close.result()

    def trim(self) -> int:
        """Make every open database nobody committed to since the last call lean (`Database.trim`), and close the
        ones that were lean already and that nothing but this Store holds (`_release_idle`); how many became lean
        or were closed now. Never waits: while another thread opens a database (which may wait for the file's
        lock), nothing is trimmed."""
        if not self._lock.acquire(blocking=False):
            return 0
        try:
            databases = list(self._databases.values())
        finally:
            self._lock.release()
        idle = [db.name for db in databases if db.lean]
        trimmed = sum(db.trim() for db in databases)
        del databases
        return trimmed + self._release_idle(idle)

    def opened(self) -> set[str]:
        """The databases this process has open now."""
        with self._lock:
            return set(self._databases)

    def release(self, names: Iterable[str]) -> int:
        """Close the databases of `names` that no object of this process holds but this Store, lean or not (one in
        use, held, with damaged records not counted yet, or the system database, stays); how many closed. For a
        pass that opened them only to read them once (`coordinator.retention`), from a thread: a close that is a
        file's last checkpoints it. The next `database(name)` opens the file again."""
        closed = 0
        for name in names:
            with self._lock:
                closed += self._close_unheld(name, lean_only=False)
        return closed

    def _close_unheld(self, name: str, *, lean_only: bool) -> bool:
        """Under the Store's lock: close `name` if it is open, not the system database, held by no object of this
        process but this Store, and `Database.release` agrees; True when it closed."""
        db = self._databases.get(name)
        # No caller has it, and none can get it without this Store's lock.
        if name == SYSTEM or db is None or sys.getrefcount(db) > _UNHELD_REFERENCES:
            return False
        if not db.release(lean_only=lean_only):
            return False
        del self._databases[name]
        return True

    def _release_idle(self, names: list[str]) -> int:
        """Close the databases of `names` (lean before this round) that are still lean and that no object of this
        process holds but this Store: a process keeps a connection to every database it touched, about 45 KiB
        each once lean (its schema, pages and WAL index), and the coordinator touches every database for its
        periodic passes only. The next `database(name)` opens the file again, as after `forget`. One in use, held
        (a session's, a sender's feed), with damaged records not counted yet, or the system database, stays. At most
        RELEASE_PER_ROUND are closed per call: the others stay lean for the next."""
        if not self._lock.acquire(blocking=False):
            return 0
        closed = 0
        try:
            for name in names:
                if closed >= RELEASE_PER_ROUND:
                    break  # the rest next round
                closed += self._close_unheld(name, lean_only=True)
        finally:
            self._lock.release()
        return closed

    # -- deleted databases ---------------------------------------------------------------------------------------

    def dropped_floor(self, name: str) -> DeletionFloors:
        """What the cluster-wide deletions of `name` cover (its markers in the system table `dropped`, see
        `shared.dropped`); nothing if it was never deleted. A damaged marker reads as none until anti-entropy
        repairs it."""
        if name == SYSTEM:
            return NO_DELETION
        try:
            system = self.database(SYSTEM)
        except UnknownDatabase:
            return NO_DELETION
        # The markers are `shared.dropped`'s, which builds on this module: imported here, not at the top.
        from replicator.shared import dropped

        return dropped.floors(system).get(name, NO_DELETION)

    def block(self, name: str) -> None:
        """Refuse to open or create `name` in this process (DatabaseRemoving) until `unblock`: its file is being
        removed. A handle already open stays usable until `forget`."""
        if check_name(name, "database") == SYSTEM:
            raise ValueError("the system database cannot be removed")
        with self._lock:
            self._blocked.add(name)

    def unblock(self, name: str) -> None:
        with self._lock:
            self._blocked.discard(name)

    def forget(self, name: str) -> None:
        """Close this process's handle of `name`, if it has one; the next `database(name)` opens the file again."""
        with self._lock:
            db = self._databases.pop(name, None)
        if db is not None:
            db.close()

    def remove(self, name: str) -> bool:
        """Delete the file of a blocked database, with its -wal and -shm, if it holds no record at all; True when
        it is gone. The caller makes sure no other process has it open (every one blocked it and closed it):
        a process still holding the file would keep writing to the unlinked copy, or leave a stale WAL beside a new
        file of the same name. RefusedFile for a refused file (`refusal`): nothing is removed."""
        path = self.path(name)
        with self._lock:
            if name not in self._blocked:
                raise RuntimeError(f"database {name!r} must be blocked before it is removed")
        self.forget(name)
        self._guard_file(name, path)  # a link is refused, not removed, nor what it points at
        if not path.exists():
            return True
        # The check closes the file's last connection, which checkpoints the WAL into it and deletes it.
        conn = sqlite3.connect(f"{path.absolute().as_uri()}?mode=rw", uri=True, timeout=BUSY_TIMEOUT)
        try:
            empty = conn.execute("SELECT 1 FROM records LIMIT 1").fetchone() is None
        finally:
            conn.close()
        if not empty:
            return False
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        # Its blob files went with its records (content-addressed, so nothing else refers to them).
        shutil.rmtree(path.with_name(f"{name}{blobs.SUFFIX}"), ignore_errors=True)
        if self._holdings:
            # Deleted cluster-wide and gone from here: whatever this node wrote to it is covered by the deletion, so a
            # file of the name made later has no history to recover.
            self.database(SYSTEM, create=True).set_held([name], False)
        return True

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the node registry: `system.nodes` (signed rows: `shared.membership`) ------------------------------------


class NodeRow(msgspec.Struct, kw_only=True):
    """One node of the cluster as the registry holds it; the record id is the node name."""

    name: str
    url: str
    databases: list[str] = msgspec.field(default_factory=lambda: ["*"])
    replicates: bool = False
    leader: bool = False
    holds: list[str] = []  # the database names the node holds
