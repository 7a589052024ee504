"""What a node knows of its own writes in one database file: the one owner of invariant 19.

A file keeps the node's own history from its `floor` on: every version this node wrote into the file is above the
floor, and it holds every one of them (or something newer of the same record). At or below the floor lies what
the node may have written before the file began (a lost file, a file restored from an older backup, one copied
from another node): only peers can tell what that was, and while they have not all served it back the file is
`recovering`.

    new name     floor 0, not recovering: a database this node never held has no history to recover. It keeps
                 the clock it was born at (`born`): a peer holding own writes below it shows an earlier life
                 after all.
    unknown      the node cannot tell whether it held the database (its system database is new or recovering:
                 a node whose data was wiped, or a node that has never been in a cluster; or it has no mark of the
                 name and peers showed the node lived before its system database began, `LIVED_BEFORE`):
                 recovering from floor 0, its clock at the wall clock (no lead: most such files are new), born
                 there; it asks every peer for every write of its origin the peer holds, and counts its own writes
                 only as peers confirm them until each peer has served it. A peer's claim on its origin moves the
                 floor there.
    lost file    floor = the clock it starts at (the wall clock plus max_clock_skew, above every version the node
                 can have written before), recovering
    restored     a file `replicator restore` put in place (meta `restored`): a lost file that kept its data. Its own
                 origin counts complete as far as the backup held it (its top, unless the backup was recovering);
                 everything above comes back from peers, and nothing of its own at or below the floor is ever
                 taken for a write it never made (`may_have_written`: maybe), so no older value is reasserted
    regressed    a peer holds own writes complete above what the file accounts for, or below its birth: recovering,
                 the floor there; if the claim shows an earlier life (`OwnHistory.earlier_life`), what a new file
                 wrote since its birth below it is written again above it (`this_life`) once every peer has served
                 (the recovery ends), or no stream would carry it to the peers that count the node complete past it

Every judgement of "may this node have written this version?" is made here, from what the node knows it wrote
itself, never from history that pruning or applied rows change:

- at or below the floor: maybe (the earlier history is the peers' to tell, and they are believed);
- above the newest own version the file holds (its `top`) and above the floor: never;
- between: never if the audit log still covers that version with the node's own local writes (every local write
  from the oldest one kept on is there) and has no local entry for it; otherwise maybe.

Anti-entropy asks it of a peer's record under this node's origin, the sender asks whether a subscriber's claim
means this file went back in time, and a subscription asks which of its own writes to be served back (`asks`).
"""

from __future__ import annotations

import sqlite3

import msgspec

from replicator.shared.hlc import MAX_VERSION

# The audit log marks the rows this node wrote itself (`local` 1) apart from the rows it applied from peers, its
# own origin's among them: only local rows tell what the node wrote.
LOCAL = 1
APPLIED = 0


class OwnHistory(msgspec.Struct, frozen=True):
    """A file's knowledge of its owner's own writes, as read in one transaction."""

    floor: int  # every own write of this file's history is above it
    recovering: bool  # the own writes at or below the floor are not known to be held yet
    top: int  # the newest own version the file holds
    confirmed: int  # what peers have confirmed of the own origin (the stored complete)
    born: int = 0  # a new (or unknown) file's clock at its birth: its own writes since are at or above it (0: neither)

    @property
    def complete(self) -> int:
        """Up to where this file holds every own write: all of them once not recovering, else what peers confirmed."""
        return self.confirmed if self.recovering else max(self.confirmed, self.top)

    @property
    def held(self) -> int:
        """How far a peer must hold this origin complete to have seen every own version the file holds: its newest,
        recovering or not (every own write since the floor is here, whatever peers have confirmed so far), or what
        peers confirmed if that is higher. Not a promise to peers (`complete` is): what a damaged own row may have
        replaced, which an older copy from a peer short of it would put back (`workers.antientropy.Round._takes`)."""
        return max(self.confirmed, self.top)

    @property
    def unknown(self) -> bool:
        """A file the node could not tell it held before, that no peer has finished serving yet (see above)."""
        return self.recovering and self.born > 0

    @property
    def asks(self) -> int:
        """How far a subscription asks peers to serve this node's own writes back (0: none): a recovering file asks
        for everything up to its floor, an unknown one for everything there is, an intact one for nothing."""
        if self.unknown:
            return MAX_VERSION
        return self.floor if self.recovering else 0

    def behind(self, claimed: int) -> bool:
        """A peer holds this node's own writes complete up to `claimed`: does it hold more than the file accounts for
        (the file went back in time, or lost them)? Above the floor, that is a claim above the newest own write
        (or any, while recovering), or one below a new file's birth: the node wrote before this file began."""
        if claimed <= self.floor:
            return False
        # A position need not be a version the node wrote: a peer that refused a row holds its position just below
        # it (`workers.session.refuse_registry_rows`). The file's first write can be at its birth, so born - 1 is
        # a claim of this life; only one below that shows a write from before the file began.
        return self.recovering or claimed > self.top or claimed < self.born - 1

    def earlier_life(self, claimed: int) -> bool:
        """A peer holds this node's own writes complete up to `claimed`: does that show an earlier life of an unknown
        file whose versions reach past the writes it made since its birth (its clock started below them)? Only a
        claim above every own version the file holds does. Up to its top, the peer may have got all it holds of this
        origin from this file (every peer counts a new cluster's files complete as their streams serve them): its
        writes since birth would be written again for nothing, and above versions other nodes wrote since, which
        this file may not have yet. The versions of an earlier life that a peer serves back inside that range are
        found one by one (`Database._earlier_life`)."""
        return self.unknown and claimed > self.top

    def behind_deletion(self, floor: int) -> bool:
        """A deletion covers this node's own writes up to `floor`: does that reach past everything the file wrote
        and past its birth? Then the deleting node saw own writes this file never had (it went back in time, or its
        clock did), and the writes this file made since it began would fall under a deletion that never saw them."""
        return floor > max(self.floor, self.top, self.born)


def _meta(conn: sqlite3.Connection, key: str) -> object:
    row = conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
    return row[0] if row is not None else None


def _set(conn: sqlite3.Connection, key: str, value: object) -> None:
    conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))


def read(conn: sqlite3.Connection, node: str) -> OwnHistory:
    row = conn.execute("SELECT complete, top FROM origins WHERE origin = ?", (node,)).fetchone()
    meta = dict(conn.execute("SELECT key, value FROM meta WHERE key IN ('floor', 'recovering', 'born')").fetchall())
    return OwnHistory(
        floor=int(meta.get("floor") or 0),
        recovering=bool(meta.get("recovering")),
        top=int(row[1]) if row is not None else 0,
        confirmed=int(row[0]) if row is not None else 0,
        born=int(meta.get("born") or 0),
    )


NEW = "new"
UNKNOWN = "unknown"
LOST = "lost"
# The meta key `replicator restore` sets in every file it puts in place (the backup's time, seconds since the epoch);
# the first process that opens the file judges it (`restore`) and removes the mark in the same transaction.
RESTORED = "restored"


def mark_restored(conn: sqlite3.Connection, taken_at: float) -> None:
    """Inside a write transaction, on a file copied out of a backup: the node opens it as restored (`restore`)."""
    _set(conn, RESTORED, taken_at)


def restored(conn: sqlite3.Connection) -> bool:
    return _meta(conn, RESTORED) is not None


# Meta `lived_before`: peers showed that the node wrote into this database before the file began (an unknown file's
# earlier life, a file known whole that went back in time), or the file was restored from a backup. Local to the
# file, never cleared. On the system database it says the marks of what the node has held do not reach back over
# its whole life (`Store.held`): a wiped node's system database recovers its rows from peers, not those marks.
LIVED_BEFORE = "lived_before"


def lived_before(conn: sqlite3.Connection) -> bool:
    return _meta(conn, LIVED_BEFORE) is not None


def restore(conn: sqlite3.Connection, node: str, *, clock_floor: int) -> None:
    """Inside the transaction that first opens a file marked by `mark_restored`: it starts as a lost file that kept
    its data (see the module docstring). The backup held every own write up to its top unless it was itself
    recovering (then only what peers had confirmed): the own origin counts complete that far and no further. The
    clock and the floor move to `clock_floor` (the wall clock plus max_clock_skew, above every version the node can
    have written before): every own write the node made after the backup is at or below the floor, so the
    subscriptions ask peers for it and anti-entropy takes a peer's newer own version for one the node may have
    written, never reasserting the backup's older one over it. An unknown file's birth and writes again are
    dropped: written again, the backup's old versions would beat the newer ones peers hold."""
    before = read(conn, node)
    if not before.recovering and before.top > before.confirmed:
        conn.execute("UPDATE origins SET complete = ? WHERE origin = ?", (before.top, node))
    conn.execute("DELETE FROM meta WHERE key IN ('born', ?)", (RESTORED,))
    for prefix in (_REWRITE, _REWRITTEN):
        conn.execute("DELETE FROM meta WHERE substr(key, 1, ?) = ?", (len(prefix), prefix))
    _set(conn, LIVED_BEFORE, 1)  # the node went on after the backup was taken
    begin(conn, history=LOST, clock_floor=clock_floor)


def begin(conn: sqlite3.Connection, *, history: str, clock_floor: int, born: int = 0) -> None:
    """Inside the transaction that initializes a file (see the module docstring): a new name starts with no history
    to recover, born at `born` (its wall clock; 0 for a file of an earlier version); an unknown one starts
    recovering from floor 0, born at `born`; a lost one starts recovering, its clock and floor at `clock_floor`
    (above anything the node can have written before)."""
    if history == LOST:
        conn.execute("UPDATE meta SET value = max(value, ?) WHERE key = 'hlc'", (clock_floor,))
        _set(conn, "floor", _meta(conn, "hlc"))
        _set(conn, "recovering", 1)
        return
    _set(conn, "recovering", 1 if history == UNKNOWN else 0)
    if born:
        _set(conn, "born", born)


def regress(conn: sqlite3.Connection, node: str, claimed: int) -> bool:
    """Inside a write transaction: a peer holds own writes complete up to `claimed`. If the file accounts for less,
    it starts recovering with its floor there (the subscriptions ask for the own writes up to it); True then."""
    history = read(conn, node)
    if not history.behind(claimed):
        return False
    if not history.unknown:
        # A file that knew its history whole went back in time: the node lived before it (an unknown file's
        # floor rises with every claim, its own writes since birth among them: `defer_rewrite` judges those).
        _set(conn, LIVED_BEFORE, 1)
    _set(conn, "recovering", 1)
    _set(conn, "floor", max(history.floor, claimed))
    return True


def this_life(
    conn: sqlite3.Connection, node: str, before: OwnHistory, claimed: int
) -> list[tuple[str, str, bytes, int, int]]:
    """The records an unknown file (see above) holds under its own origin that it wrote itself since its birth (a
    local write in the audit log, from `born` on) at or below `claimed`, as (table, id, value, tombstone, version):
    to be written again above it. A version of its own the file took from a peer is not one of them, and neither is a
    delete: written again, a delete would beat whatever was written since elsewhere, and at its version it is still
    found and spread by anti-entropy (it beats what it deleted). Only while the file's history is unknown are its
    writes since birth ones no peer can have seen replaced: in any other file (a new name, one restored from a
    backup, a lost one), versions at or below a peer's claim may be ones peers hold already, and newer writes of
    others may have replaced them there, so nothing is written again (a lost file's clock starts max_clock_skew
    ahead instead)."""
    if not before.unknown:
        return []
    rows = conn.execute(
        "SELECT r.tbl, r.id, r.value, r.tombstone, r.version FROM records AS r WHERE r.origin = ? AND r.version >= ?"
        " AND r.version <= ? AND r.tombstone = 0 AND EXISTS (SELECT 1 FROM audit AS a WHERE a.tbl = r.tbl"
        " AND a.id = r.id AND a.version = r.version AND a.origin = r.origin AND a.local = ?) ORDER BY r.version",
        (node, before.born, claimed, LOCAL),
    ).fetchall()
    return [
        (table, record_id, bytes(value), int(tombstone), int(version))
        for table, record_id, value, tombstone, version in rows
    ]


# An unknown file's writes again wait for the end of its recovery (meta `rewrite/<peer>`, the highest claim of each
# peer whose claim calls for them; `rewrite/` for an anti-entropy round's), and each record written again is marked
# until the recovery ends (`rewritten/<[table, id]>` = "<the version it was written again from> <the version it
# got>"). Both are local to the file, never replicated.
_REWRITE = "rewrite/"
_REWRITTEN = "rewritten/"


def defer_rewrite(conn: sqlite3.Connection, peer: str | None, claimed: int) -> None:
    """Inside a write transaction, in an unknown file: `peer` (None: an anti-entropy round) holds own writes complete
    up to `claimed`, and the file's writes since birth at or below it are to be written again (`this_life`) once
    every peer has served it (`take_rewrite`, when the recovery ends), not now. A peer may hold a newer version of one
    of them: the node's own later delete or update, which a file restored from a backup of an unknown file lacks, or
    another node's newer write or delete, which the claiming peer need not have (seed 56804 of nemesis 3: a delete
    by c that only c and d held, cut off from b, whose claim called a write again above it). Written again before
    it arrives, the old value would beat it on every node."""
    key = _REWRITE + (peer or "")
    _set(conn, key, max(int(_meta(conn, key) or 0), claimed))
    _set(conn, LIVED_BEFORE, 1)


def pending_rewrite(conn: sqlite3.Connection) -> int:
    """The highest claim whose writes again wait for the end of the recovery (`defer_rewrite`; 0: none)."""
    claimed = conn.execute(
        "SELECT max(CAST(value AS INTEGER)) FROM meta WHERE substr(key, 1, ?) = ?", (len(_REWRITE), _REWRITE)
    ).fetchone()[0]
    return int(claimed or 0)


def take_rewrite(conn: sqlite3.Connection) -> int:
    """Inside a write transaction, as the recovery ends (every peer has served): the highest claim whose writes
    again are due (0: none), no longer pending."""
    claimed = pending_rewrite(conn)
    conn.execute("DELETE FROM meta WHERE substr(key, 1, ?) = ?", (len(_REWRITE), _REWRITE))
    return claimed


def _rewritten_key(table: str, record_id: str) -> str:
    return _REWRITTEN + msgspec.json.encode([table, record_id]).decode()


def note_rewritten(conn: sqlite3.Connection, rows: list[tuple[str, str, int, int]]) -> None:
    """Inside the write transaction that wrote `rows` again: (table, id, the version it had, the version it got)."""
    conn.executemany(
        "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
        [(_rewritten_key(table, record_id), f"{old} {new}") for table, record_id, old, new in rows],
    )


def overridden(conn: sqlite3.Connection, node: str, entries: list[tuple[str, str, int]]) -> list[tuple[str, str, int]]:
    """Of a peer's (table, id, version) under this node's own origin, those that a write again beat wrongly: a
    version between the one written again and the one it got, while that one still stands. The peer holds the
    node's own later write of the record from a life the file lacks (a deletion's floor called the write again at
    once, before that peer had served): it is the newer own write, and must win."""
    found = []
    for table, record_id, version in entries:
        mark = _meta(conn, _rewritten_key(table, record_id))
        if mark is None:
            continue
        old, new = (int(part) for part in str(mark).split())
        if not old < version < new:
            continue
        current = conn.execute("SELECT version, origin FROM records WHERE tbl = ? AND id = ?", (table, record_id))
        row = current.fetchone()
        if row is not None and (int(row[0]), row[1]) == (new, node):
            found.append((table, record_id, version))
    return found


def finish(conn: sqlite3.Connection) -> None:
    """Inside a write transaction: every peer has served the own writes back; the file holds its whole history (no
    write again is pending, and no peer holds a newer own write of one written again)."""
    _set(conn, "recovering", 0)
    conn.execute("DELETE FROM meta WHERE substr(key, 1, ?) = ?", (len(_REWRITTEN), _REWRITTEN))


def may_have_written(
    conn: sqlite3.Connection, node: str, table: str, claims: list[tuple[str, int]]
) -> list[tuple[str, int]]:
    """The (id, version) pairs among `claims` that this node may have written (see the module docstring); the
    others it provably never wrote. Reads the audit log, which has no index for it: only for the rare record under
    this node's origin that a peer holds newer than this file does."""
    if not claims:
        return []
    history = read(conn, node)
    if history.unknown:
        return list(claims)  # what the node wrote before this file is not known yet: anything may be its own
    ceiling = max(history.floor, history.top)
    oldest = conn.execute(
        "SELECT min(version) FROM audit WHERE origin = ? AND local = ? AND version > ?", (node, LOCAL, history.floor)
    ).fetchone()[0]
    wrote = written(conn, node, table, [record_id for record_id, version in claims if version > history.floor])

    def possible(record_id: str, version: int) -> bool:
        if version <= history.floor:
            return True  # the earlier history: only peers know it
        if version > ceiling:
            return False  # above every own version the file holds
        # Covered by the local writes the log still keeps, and not among them.
        return oldest is None or version < oldest or (record_id, version) in wrote

    return [(record_id, version) for record_id, version in claims if possible(record_id, version)]


def written(conn: sqlite3.Connection, node: str, table: str, ids: list[str]) -> set[tuple[str, int]]:
    """The (id, version) of every local write of `ids` the audit log still holds."""
    found: set[tuple[str, int]] = set()
    unique = sorted(set(ids))
    for start in range(0, len(unique), 500):
        chunk = unique[start : start + 500]
        marks = ",".join("?" * len(chunk))
        rows = conn.execute(
            f"SELECT id, version FROM audit WHERE origin = ? AND local = ? AND tbl = ? AND id IN ({marks})",
            (node, LOCAL, table, *chunk),
        )
        found.update((record_id, version) for record_id, version in rows)
    return found
