"""What the simulation's clients were told, and what must hold of it.

    acknowledged   every write and delete a node answered, with its version and when
    lost           writes a fault took before any other node held them (the only copy's file lost, restored from
                   an older backup, damaged): nothing can bring those back, and they are not asked for
    deletions      every database deletion, with the floors it wrote and when

Checks (a violation is a string naming the node, the record and what is wrong):

    positions      at any time, a node's complete version of an origin promises every acknowledged write of it at or
                   below: the node holds the record at that version or newer, or a deletion of it it was promised
                   (then purged), or a deletion of the database covers it, or a newer version of the record from
                   another origin supersedes it, whose own origin's position here has not reached it yet (the
                   promise waits on that origin's stream), or it is a wiped node's write below its earlier life's
                   versions, to be written again above them when its file's recovery ends (invariant 13)
    deletions      a database deletion covers only writes acknowledged before it was asked for (invariant 20)
    final          after healing, every node holds the newest acknowledged operation of every record that no fault
                   took, unless a deletion of the database covers it: a write at its version (or newer), a delete
                   as absence (or something newer); a version above it that no client was told of (written again)
                   holds its value (a delete: a tombstone); nothing a deletion covers is left (invariants 17, 19, 20)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from replicator.shared.deletion import DeletionFloors
from tests.sim.cluster import Cluster, SimNode

Key = tuple[str, str, str]  # database, table, id


@dataclass
class Op:
    node: str
    version: int
    value: bytes | None  # None: a delete
    at: float  # virtual time of the acknowledgement
    lost: bool = False


@dataclass
class Deletion:
    database: str
    node: str
    floors: DeletionFloors
    at: float
    marker: int = 0  # the version of the marker it wrote in the node's system database
    lost: bool = False  # its marker went with the node's system database before any other node had it


@dataclass
class Ledger:
    ops: dict[Key, list[Op]] = field(default_factory=dict)
    deletions: list[Deletion] = field(default_factory=list)

    def acknowledged(self, key: Key, op: Op) -> None:
        self.ops.setdefault(key, []).append(op)

    def lose_markers(self, cluster: Cluster, node: SimNode, restored: bool = False, files_stay: bool = False) -> int:
        """`node`'s system database is going: the deletions whose markers no other node holds go with it (its own,
        or another node's that only it had kept, the deleter's copy gone before).
        `restored`: it was replaced by a backup, already in place: a marker the backup holds is not gone.
        `files_stay`: only the system database goes, the node's other files stay."""
        keepers = [other for other in cluster if restored or files_stay or other is not node]
        going = self.kept_only_by(cluster, node, restored=restored, files_stay=files_stay)
        for deletion in going:
            deletion.lost = True
            self._forgotten(keepers, deletion)
        return len(going)

    def kept_only_by(
        self, cluster: Cluster, node: SimNode, restored: bool = False, files_stay: bool = False
    ) -> list[Deletion]:
        """The deletions that would go with `node`'s system database (`lose_markers`, which takes them): no other
        node holds the marker, and no file that stays took the floors."""
        others = [other.rows("system") for other in cluster if restored or other is not node]
        keepers = [other for other in cluster if restored or files_stay or other is not node]
        going = []
        for deletion in self.deletions:
            if deletion.lost:
                continue
            key = ("dropped", f"{deletion.database}@{deletion.node}")
            if any(rows.get(key, (0, "", False))[0] >= deletion.marker for rows in others):
                continue
            # A file of the database that took the deletion's floors (one created since, born with them) keeps
            # them, and applies them still.
            if any(deletion.floors.within(other.file_floors(deletion.database)) for other in keepers):
                continue
            going.append(deletion)
        return going

    def _forgotten(self, keepers: list[SimNode], deletion: Deletion) -> None:
        """A deletion forgotten before any other node had it: what it had removed on its own node and no node holds
        any more went with it, as the deletion asked (writes acknowledged before it that it covers). `keepers`: the
        nodes whose files stay."""
        held = [other.rows(deletion.database) for other in keepers if other.dir.exists()]
        for (name, table, record_id), ops in self.ops.items():
            if name != deletion.database:
                continue
            for op in ops:
                if op.lost or op.at > deletion.at or not deletion.floors.covers(op.node, op.version):
                    continue
                if not any(_holds(rows.get((table, record_id)), op) for rows in held):
                    op.lost = True

    def deleted_before(self, database: str, op: Op) -> bool:
        """Does a deletion asked for after `op` was acknowledged cover it? (One asked for before it that covers it
        anyway, a clock gone back, say, does not count: what was written after a deletion survives it, written
        again above it if need be: `shared.own_writes`.)"""
        return any(
            deletion.database == database
            and not deletion.lost
            and deletion.at >= op.at
            and deletion.floors.covers(op.node, op.version)
            for deletion in self.deletions
        )

    def covering(self, database: str) -> DeletionFloors:
        covered = DeletionFloors()
        for deletion in self.deletions:
            if deletion.database == database and not deletion.lost:
                covered = covered.merge(deletion.floors)
        return covered

    def lose_unreplicated(self, cluster: Cluster, node: SimNode, database: str, since: float = -1.0) -> int:
        """`node`'s copy of `database` is going (a lost file, a restore from a backup taken at `since`). An operation
        is lost with it when no other node holds its record at its version or newer, and no newer operation on the
        record survives (the newest surviving one is what the record must end as): its own writes acknowledged
        after `since`, and any other node's whose only trace was here (held, or under a newer version that went
        too)."""
        others = [other for other in cluster if other is not node and other.dir.exists()]
        held = [(other.rows(database), other.complete(database)) for other in others]
        lost = 0
        for (name, table, record_id), ops in self.ops.items():
            if name != database:
                continue
            for op in sorted(ops, key=lambda op: (op.version, op.node), reverse=True):
                if op.lost:
                    continue
                if any(
                    _holds(rows.get((table, record_id)), op)
                    or (op.value is None and (table, record_id) not in rows and complete.get(op.node, 0) >= op.version)
                    for rows, complete in held
                ):
                    break  # it survives (a delete whose tombstone was purged too), and what it superseded with it
                if op.node == node.name and op.at <= since:
                    break  # in the backup that replaces the file
                op.lost = True
                lost += 1
        return lost

    def restored(self, cluster: Cluster, node: SimNode) -> int:
        """`node`'s data directory was replaced by a backup: what the backup holds is in the cluster again, an
        operation counted lost since (its file lost after the backup was taken, say) among it, and a deletion whose
        marker (or floors, in a file born with them) went with a wipe after the backup was taken: it applies again.
        """
        system = node.rows("system")
        for deletion in self.deletions:
            key = ("dropped", f"{deletion.database}@{deletion.node}")
            if deletion.lost and (
                system.get(key, (0, "", False))[0] >= deletion.marker
                or deletion.floors.within(node.file_floors(deletion.database))
            ):
                deletion.lost = False
        found = 0
        for database in {name for name, _, _ in self.ops}:
            rows = node.rows(database)
            for (name, table, record_id), ops in self.ops.items():
                if name != database:
                    continue
                for op in ops:
                    if op.lost and _holds(rows.get((table, record_id)), op):
                        op.lost = False
                        found += 1
        return found

    # -- checks ------------------------------------------------------------------------------------------------

    def positions(self, cluster: Cluster, only: tuple[SimNode, str] | None = None) -> list[str]:
        """The positions check, on every node and database (or `only` one node's database)."""
        problems = []
        if only is not None:
            targets = [only] if only[0].up and only[0].store.path(only[1]).exists() else []  # type: ignore[union-attr]
        else:
            targets = [(node, database) for node in cluster.up() for database in node.files()]
        for node, database in targets:
            assert node.store is not None
            db = node.store.database(database)
            complete = {origin: held.complete for origin, held in db.origins().items()}
            # What a deletion covers no longer exists, wherever the marker has reached by now.
            floors = db.dropped_floor.merge(self.covering(database))
            rows = node.rows(database)
            pending: dict[str, tuple[int, dict[tuple[str, str], tuple[int, str, bool]]]] = {}
            for (name, table, record_id), ops in self.ops.items():
                if name != database:
                    continue
                row = rows.get((table, record_id))
                for op in ops:
                    origin = op.node
                    if op.lost or op.version > complete.get(origin, 0) or floors.covers(origin, op.version):
                        continue
                    if _rewrite_pending(cluster, database, table, record_id, op, pending):
                        continue  # below an earlier life's versions, to be written again above them (the checker)
                    if _holds(row, op) or (row is None and (op.value is None or _purged_delete(ops, op, complete))):
                        continue  # held, superseded, or deleted (a delete's tombstone purged is still a delete)
                    if _superseded_elsewhere(ops, op, complete) or _superseded_then_deleted(ops, op, floors):
                        continue
                    if _superseded_then_lost(ops, op):
                        continue  # the mark covered it through a newer version since lost: anti-entropy's to repair
                    problems.append(
                        f"{node.name}/{database}: complete for {origin} at {complete[origin]} but"
                        f" {table}/{record_id}@{op.version} is {'absent' if row is None else row}"
                    )
        return problems

    def deletions_cover_only_the_past(self, cluster: Cluster) -> list[str]:
        """An operation acknowledged after a deletion that the deletion's floors cover must have been written again
        above them (or superseded): it is not gone."""
        problems = []
        for deletion in self.deletions:
            if deletion.lost:
                continue
            for (name, table, record_id), ops in self.ops.items():
                if name != deletion.database:
                    continue
                for op in ops:
                    if deletion.floors.covers(op.node, op.version) and op.at > deletion.at and not op.lost:
                        rows = [node.rows(name).get((table, record_id)) for node in cluster]
                        if all(_holds(row, op) or (row is None and _deleted_since(ops, op)) for row in rows):
                            # Written again above the floors or superseded, on every node; or deleted since by a
                            # delete of its own that the floors took with its tombstone: absent is what it left.
                            continue
                        problems.append(
                            f"the deletion of {name} by {deletion.node} at {deletion.at} covers"
                            f" {table}/{record_id}@{op.version}, acknowledged later at {op.at}"
                        )
        return problems

    def final(self, cluster: Cluster) -> list[str]:
        problems = []
        for node in cluster:
            for (database, table, record_id), ops in sorted(self.ops.items()):
                covered = self.covering(database)
                rows = node.rows(database)
                row = rows.get((table, record_id))
                if row is not None and covered.covers(row[1], row[0]):
                    problems.append(f"{node.name}/{database}: {table}/{record_id}@{row[0]} survived its deletion")
                    continue
                live = [op for op in ops if not op.lost]
                if not live:
                    continue
                newest = max(live, key=lambda op: (op.version, op.node))
                if self.deleted_before(database, newest):
                    # Removed with the database. An older version of another origin that the deleting node had not
                    # seen is concurrent with the deletion and may survive it, or not, where the newer one had
                    # replaced it: either way the same on every node (the digests say).
                    continue
                if newest.value is None:
                    if row is not None and (row[0], row[1]) <= (newest.version, newest.node):
                        problems.append(
                            f"{node.name}/{database}: {table}/{record_id} deleted at {newest.version} by"
                            f" {newest.node} but holds {'a tombstone' if row[2] else 'a record'} at {row[0]}"
                            + ("" if row[2] else " (the delete was undone)")
                        )
                    if row is not None and row[2] and (row[0], row[1]) == (newest.version, newest.node):
                        problems.pop()  # the tombstone itself, not purged yet: still deleted
                elif row is None or (row[0], row[1]) < (newest.version, newest.node):
                    problems.append(
                        f"{node.name}/{database}: {table}/{record_id} written at {newest.version} by {newest.node}"
                        f" is {'missing' if row is None else f'older: {row}'}"
                    )
                if row is not None and (row[0], row[1]) > (newest.version, newest.node):
                    # Two operations at one version: a wiped node whose clock met its earlier life's, say.
                    tied = [op for op in live if (op.version, op.node) == (newest.version, newest.node)]
                    problem = _written_above(node, database, table, record_id, row, ops, tied)
                    if problem is not None:
                        problems.append(problem)
        return problems


def _written_above(
    node: SimNode,
    database: str,
    table: str,
    record_id: str,
    row: tuple[int, str, bool],
    ops: list[Op],
    newest: list[Op],
) -> str | None:
    """A row above the record's newest acknowledged operation (`newest`: those at its version) that no client was
    told of: written again by a node (`own_writes.this_life`, `Database.reassert`). It must say what the newest
    operation said, or it replaced it with an older value (an acknowledged write lost, or a delete undone, at a
    higher version)."""
    if any((op.version, op.node) == (row[0], row[1]) for op in ops):
        return None
    held = None if row[2] else node.value(database, table, record_id)
    if any(op.value == held for op in newest):
        return None
    # A wiped node whose clock went back writes below its earlier life's versions; its file writes the later write
    # again above them (`this_life`), so the write acknowledged last of that origin is the one that stays.
    later = [op for op in ops if not op.lost and op.node == row[1] and op.at > max(o.at for o in newest)]
    if later and max(later, key=lambda op: op.at).value == held:
        return None
    op = newest[-1]
    where = f"{node.name}/{database}: {table}/{record_id}"
    if op.value is None:
        return f"{where} deleted at {op.version} by {op.node} but written again live at {row[0]} (undone)"
    return (
        f"{where} written at {op.version} by {op.node}, replaced at {row[0]} by {row[1]} with"
        f" {'a tombstone' if held is None else 'another value'} (the write lost)"
    )


def _rewrite_pending(
    cluster: Cluster,
    database: str,
    table: str,
    record_id: str,
    op: Op,
    cache: dict[str, tuple[int, dict[tuple[str, str], tuple[int, str, bool]]]],
) -> bool:
    """Is `op` a write of an unknown file (a wiped node's) that lies at or below a claim showing its node's earlier
    life, still held there at its version, to be written again above the claim when the file's recovery ends
    (`shared.own_writes.defer_rewrite`)? A peer's position from that earlier life covers it meanwhile, and cannot
    hold it: the node wrote it below versions it had written before. The write again is what keeps the promise
    (checked again once it is made); until every peer has served, it would beat newer versions the node lacks."""
    if op.node not in cache:
        writer = cluster.nodes[op.node]
        claimed = writer.rewrite_pending(database)
        cache[op.node] = (claimed, writer.rows(database) if claimed else {})
    claimed, rows = cache[op.node]
    row = rows.get((table, record_id))
    return op.version <= claimed and row is not None and (row[0], row[1]) == (op.version, op.node)


def _holds(row: tuple[int, str, bool] | None, op: Op) -> bool:
    """Does a node's row reflect `op`: the same version of the record, or a newer one?"""
    return row is not None and (row[0], row[1]) >= (op.version, op.node)


def _deleted_since(ops: list[Op], op: Op) -> bool:
    """Is `op` a delete, or was it followed by an acknowledged delete of the record (one not lost)?"""
    return any(
        later.value is None and not later.lost and (later.version, later.node) >= (op.version, op.node) for later in ops
    )


def _superseded_elsewhere(ops: list[Op], op: Op, complete: dict[str, int]) -> bool:
    """Was `op` superseded by a newer version of the record from another origin, one this node is not complete for
    yet? A sender serves an origin's records as it holds them: a version another origin's newer write replaced is
    not among them, and the mark it gives covers it through that newer version, which arrives with its own
    origin's stream. The promise then waits on that origin's position (and is checked there)."""
    return any(
        not later.lost
        and (later.version, later.node) > (op.version, op.node)
        and complete.get(later.node, 0) < later.version
        for later in ops
    )


def _superseded_then_lost(ops: list[Op], op: Op) -> bool:
    """Was `op` superseded by a newer version of the record whose only copies went (a file lost before it spread)?
    A relay's mark covered `op` through that version, as `_superseded_elsewhere` says; with it gone, the position
    stays past a version the node does not hold, and the record is anti-entropy's to repair (the final check and
    the digests say it was)."""
    return any(later.lost and (later.version, later.node) > (op.version, op.node) for later in ops)


def _superseded_then_deleted(ops: list[Op], op: Op, floors: DeletionFloors) -> bool:
    """Was `op` superseded by a newer version of the record that a deletion of the database then removed?"""
    return any(
        (later.version, later.node) > (op.version, op.node) and floors.covers(later.node, later.version)
        for later in ops
    )


def _purged_delete(ops: list[Op], op: Op, complete: dict[str, int]) -> bool:
    """A record the node does not hold: was it deleted after `op`, by a delete the node was promised (and purged)?"""
    return any(
        later.value is None
        and (later.version, later.node) > (op.version, op.node)
        and complete.get(later.node, 0) >= later.version
        for later in ops
    )
