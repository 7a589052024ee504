"""One seeded run of the data plane: clients write, delete and read while a nemesis combines faults; then every fault
heals and the checker asks that nothing acknowledged was lost, no delete undone, and every node ends with the same
digests within a bounded number of rounds (`tests.sim.checker`).

    python -m tests.sim --seed 1234            replay one seed, with its trace
    python -m tests.sim --seeds 1000           seeds 0..999; the failing ones are printed with the command above
    python -m tests.sim --scenario lost-own    one of the scripted scenarios (`tests.sim.scenarios`)

The nemesis: nodes stop and start (all their sessions end), a stopped node loses a file or its whole data directory
or is restored from an older backup of itself, links go down and up (one direction at a time too), rows are
damaged behind the store's back, clocks move within max_clock_skew, databases are deleted cluster-wide, retention
prunes and purges; since nemesis 2 (`NEMESIS`), a node's CA bundle lacks a peer's CA for a while (the peer's registry
rows do not verify there), a node signs its registry row again, and a session goes silent while it stays up (the
sender serves nothing: the renewal a worker never did), which only the stall check can end; since nemesis 3, a
backup is also put back as `replicator restore` does (each file marked restored). Everything is drawn from
`random.Random(seed)`: the same seed and nemesis is the same run.
"""

from __future__ import annotations

import functools
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from replicator.shared import dropped, membership
from replicator.shared.deletion import DeletionFloors
from replicator.shared.logs import log
from replicator.shared.store import SYSTEM, DamagedRecord, Database, DatabaseRemoving, UnknownDatabase, mark_restored
from replicator.workers.dropped import DroppedDatabase
from replicator.workers.session import ahead_of
from tests.sim.checker import Deletion, Ledger, Op
from tests.sim.cluster import Cluster, Pair, SessionEnded, Settings, SimNode, encode

HEAL_ROUNDS = 12  # rounds after healing within which every node must hold the same data
# The nemesis a run draws from. 1: as the simulation was first built (the seeds it found replay their bug with it);
# 2: adds registry rows refused by a half-rotated CA bundle, registry rows signed again, and silent sessions, with
# the stall check that ends them; 3: adds backups put back as `replicator restore` does (marked restored).
NEMESIS = 3
PUMP_LIMIT = 400  # batches per session per healing round


def _root() -> Path:
    """Where the runs' files go: memory-backed when the machine has /dev/shm."""
    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix="replicator-sim-", dir=shm if shm.is_dir() else None))


@dataclass
class Outcome:
    seed: int | str
    violations: list[str]
    steps: int
    writes: int
    faults: int
    trace: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


class Simulation:
    def __init__(
        self,
        seed: int,
        *,
        steps: int = 240,
        nodes: int | None = None,
        shape: str | None = None,
        databases: list[str] | None = None,
        settings: Settings | None = None,
        nemesis: int = NEMESIS,
    ) -> None:
        self.seed = seed
        self.nemesis = nemesis
        self.rng = random.Random(seed)
        rng = self.rng
        count = nodes or rng.randint(3, 5)
        names = [chr(ord("a") + i) for i in range(count)]
        drawn = rng.choices(["mesh", "line", "star"], weights=[6, 2, 2])[0]
        self.shape = shape or drawn
        self.root = _root()
        self.cluster = Cluster(self.root, names, topology(self.shape, names), settings or Settings())
        drawn_databases = ["d0"] if rng.random() < 0.5 else ["d0", "d1"]
        self.databases = databases or drawn_databases
        self.ids = [f"r{i}" for i in range(rng.randint(6, 16))]
        self.steps = steps
        self.ledger = Ledger()
        self.step = 0
        self.faults = 0
        # node -> (copy of its data directory, step it was taken, the node's wall clock then)
        self.backups: dict[str, tuple[Path, int, float]] = {}
        # Rows the nemesis damaged: (node, database, table, id, version, origin), until the node holds another row.
        self.damaged: set[tuple[str, str, str, str, int, str]] = set()
        self.violations: list[str] = []

    # -- the run -------------------------------------------------------------------------------------------------

    def run(self, script: Callable[[Simulation], None] | None = None) -> Outcome:
        """The run: random steps (or `script`, a scenario driving the same primitives), then healing and the
        checks."""
        # The nodes' own log lines (a checksum failure found by a scrub, say) are the trace's business, not stderr's.
        threshold = log.threshold
        log.configure(level="error")
        try:
            return self._run(script)
        finally:
            log.threshold = threshold

    def _run(self, script: Callable[[Simulation], None] | None) -> Outcome:
        cluster = self.cluster
        cluster.trace(f"seed {self.seed}: {len(cluster.nodes)} nodes, {self.shape}, databases {self.databases}")
        try:
            for node in cluster:
                self._boot(node)
            if script is not None:
                script(self)
            else:
                for _ in range(self.steps):
                    self.step += 1
                    self._act()
                    if self.step % 20 == 0:
                        self._check_positions()
            self._heal()
            self._check_positions()
            self.violations += [f"after {HEAL_ROUNDS} rounds: {problem}" for problem in self._behind()]
            self.violations += self.ledger.deletions_cover_only_the_past(cluster)
            self.violations += self.ledger.final(cluster)
            self._check_digests()
        finally:
            cluster.close()
            for copy, _, _ in self.backups.values():
                shutil.rmtree(copy, ignore_errors=True)
        writes = sum(len(ops) for ops in self.ledger.ops.values())
        return Outcome(self.seed, self.violations, self.step, writes, self.faults, cluster.log)

    # -- what a scripted scenario drives ------------------------------------------------------------------------

    def put(self, name: str, database: str, record_id: str, value: object) -> int:
        self.step += 1
        node = self.cluster.nodes[name]
        data = encode(value)
        version = node.database(database, create=True).put("t", record_id, data)
        self._acknowledged(node, database, record_id, version, data)
        return version

    def delete(self, name: str, database: str, record_id: str) -> int | None:
        self.step += 1
        node = self.cluster.nodes[name]
        version = node.database(database, create=True).delete("t", record_id)
        if version is not None:
            self._acknowledged(node, database, record_id, version, None)
        return version

    def settle(self, rounds: int = 3) -> None:
        """The streams run until every session is caught up (no anti-entropy, no retention, no faults)."""
        for _ in range(rounds):
            for node in self.cluster.up():
                self._connect_all(node)
            self._pump()
            for node in self.cluster.up():
                node.check_recoveries()
        self._check_positions()

    def stop(self, name: str) -> None:
        self.step += 1
        self.cluster.nodes[name].stop()
        self.cluster.trace(f"{name} stopped")

    def start(self, name: str) -> None:
        self.step += 1
        self._boot(self.cluster.nodes[name])
        self.cluster.trace(f"{name} started")

    def _boot(self, node: SimNode) -> None:
        node.start()
        if self.nemesis >= 2:
            self._register(node)

    def _register(self, node: SimNode, introduce: str | None = None) -> None:
        """The node signs its registry row (at boot, or with a renewed certificate), or an introduction of another
        node: a write every node must end up holding."""
        assert node.store is not None
        table, record_id = (membership.NODES, node.name) if introduce is None else (membership.INTRODUCTIONS, introduce)
        value = encode({"url": f"wss://{introduce or node.name}", "by": node.name, "step": self.step})
        try:
            version = node.store.database(SYSTEM).put(table, record_id, value)
        except DamagedRecord:
            return
        self.ledger.acknowledged((SYSTEM, table, record_id), Op(node.name, version, value, self.step))

    def wipe(self, name: str) -> None:
        node = self.cluster.nodes[name]
        assert not node.up
        for path in node.dir.glob("*.sqlite"):
            self.ledger.lose_unreplicated(self.cluster, node, path.name[: -len(".sqlite")])
        self.ledger.lose_markers(self.cluster, node)
        shutil.rmtree(node.dir)
        self.cluster.trace(f"{name} wiped")

    def lose(self, name: str, database: str) -> None:
        """A stopped node's file of `database` is gone (its other files stay)."""
        node = self.cluster.nodes[name]
        assert not node.up
        lost = self.ledger.lose_unreplicated(self.cluster, node, database)
        if database == SYSTEM and self.ledger.lose_markers(self.cluster, node, files_stay=True):
            self.cluster.trace(f"{name} lost a deletion only it still held")
        for suffix in ("", "-wal", "-shm"):
            Path(f"{node.dir / database}.sqlite{suffix}").unlink(missing_ok=True)
        self.cluster.trace(f"{name} lost {database} ({lost} writes only it held)")

    def cut(self, dialler: str, target: str) -> None:
        self.cluster.cut.add((dialler, target))
        for pair in list(self.cluster.nodes[dialler].pairs.values()):
            if pair.peer == target:
                self.cluster.disconnect(pair)
        self.cluster.trace(f"cut {dialler}->{target}")

    def heal_link(self, dialler: str, target: str) -> None:
        self.cluster.cut.discard((dialler, target))
        self.cluster.trace(f"healed {dialler}->{target}")

    def delete_database(self, name: str, database: str) -> None:
        self.step += 1
        node = self.cluster.nodes[name]
        assert node.store is not None
        floors = dropped.seen(node.store.database(database).origins())
        marker = dropped.write(node.store.database(SYSTEM), database, requested_by=name, at=node.wall(), floors=floors)
        covered = node.store.dropped_floor(database)
        self.ledger.deletions.append(Deletion(database, name, covered, self.step, marker))
        self.cluster.trace(f"{name} deleted {database}: {floors}")

    def rounds(self) -> None:
        """An anti-entropy round over every connected pair, both ways."""
        for node in self.cluster.up():
            for pair in list(node.pairs.values()):
                if pair.connected:
                    self.cluster.round(node, pair)

    def _act(self) -> None:
        rng = self.rng
        roll = rng.random()
        if roll < 0.35:
            self._client()
        elif roll < 0.45:
            self._connect(rng.choice(self.cluster.up() or [None]))
        elif roll < 0.60:
            self._send()
        elif roll < 0.76:
            self._deliver()
        elif roll < 0.80:
            self._round()
        elif roll < 0.83:
            self._retention(rng.choice(self.cluster.up() or [None]))
        elif roll < 0.86:
            self._drops(rng.choice(self.cluster.up() or [None]))
        elif roll < 0.88:
            self._scrub()
        elif roll < 0.94:
            self.cluster.loop.advance(rng.uniform(0.05, 4.0))
        else:
            self._fault()

    # -- clients -------------------------------------------------------------------------------------------------

    def _client(self) -> None:
        rng = self.rng
        up = self.cluster.up()
        if not up:
            return
        node = rng.choice(up)
        database = rng.choice(self.databases)
        record_id = rng.choice(self.ids)
        try:
            db = node.database(database, create=True)
            if rng.random() < 0.75:
                value = encode({"by": node.name, "step": self.step})
                version = db.put("t", record_id, value)
                self._acknowledged(node, database, record_id, version, value)
            else:
                version_or_none = db.delete("t", record_id)
                if version_or_none is not None:
                    self._acknowledged(node, database, record_id, version_or_none, None)
        except (DamagedRecord, DatabaseRemoving):
            return  # answered 503: nothing acknowledged

    def _acknowledged(self, node: SimNode, database: str, record_id: str, version: int, value: bytes | None) -> None:
        self.ledger.acknowledged((database, "t", record_id), Op(node.name, version, value, self.step))

    # -- sessions ------------------------------------------------------------------------------------------------

    def _connect(self, node: SimNode | None) -> None:
        if node is None:
            return
        cluster = self.cluster
        cluster.sync_pairs(node)
        for key in sorted(node.renew):
            pair = node.pairs.get(key)
            if pair is not None:
                cluster.disconnect(pair)
            node.renew.discard(key)
        for pair in list(node.pairs.values()):
            if pair.session is None and self.rng.random() < 0.8:
                cluster.connect(node, pair)
        node.check_recoveries()
        if self.nemesis >= 2:
            node.check_stalls()

    def _send(self) -> None:
        sessions = self.cluster.sessions()
        if sessions:
            self.rng.choice(sessions).send()

    def _deliver(self) -> None:
        sessions = [session for session in self.cluster.sessions() if session.in_flight]
        if sessions:
            self._deliver_one(self.rng.choice(sessions))

    def _deliver_one(self, session: object) -> None:
        from tests.sim.cluster import Session

        assert isinstance(session, Session)
        try:
            session.deliver()
        except SessionEnded as exc:
            self.cluster.end(session, str(exc))
            return
        target = session.target
        if isinstance(target, DroppedDatabase) and target.created:
            session.subscriber.holds.add(session.database)
        # No position is ever ahead of the data it promises: checked where a position moves, as it moves.
        only = (session.subscriber, session.database)
        self.violations += [f"step {self.step}: {problem}" for problem in self.ledger.positions(self.cluster, only)]

    def _round(self) -> None:
        pairs = [(node, pair) for node in self.cluster.up() for pair in node.pairs.values() if pair.connected]
        if pairs:
            node, pair = self.rng.choice(pairs)
            self.cluster.round(node, pair)

    def _retention(self, node: SimNode | None) -> None:
        if node is not None:
            node.tombstone_purge()

    def _drops(self, node: SimNode | None) -> None:
        if node is not None:
            for name in node.apply_drops():
                self.cluster.trace(f"{node.name} removed {name}")

    def _scrub(self) -> None:
        up = self.cluster.up()
        if up:
            node = self.rng.choice(up)
            for name in node.files():
                self.cluster.scrub(node, name)

    # -- the nemesis ---------------------------------------------------------------------------------------------

    def _fault(self) -> None:
        rng = self.rng
        cluster = self.cluster
        kinds: list[tuple[str, Callable[[], bool]]] = [
            ("stop", self._stop),
            ("start", self._start),
            ("restart", self._restart),
            ("wipe", self._wipe),
            ("lose a file", self._lose_file),
            ("cut", self._cut),
            ("heal", self._heal_link),
            ("damage", self._damage),
            ("clock", self._clock),
            ("delete database", self._delete_database),
            ("backup", self._backup),
            ("restore", self._restore),
        ]
        weights = [5, 6, 3, 2, 2, 5, 5, 3, 2, 2, 2, 2]
        if self.nemesis >= 2:
            kinds += [
                ("distrust", self._distrust),
                ("trust", self._trust),
                ("register", self._reregister),
                ("silence", self._silence),
            ]
            weights += [2, 2, 2, 2]
        if self.nemesis >= 3:
            kinds.append(("restore marked", functools.partial(self._restore, marked=True)))  # `replicator restore`
            weights.append(2)
        name, fault = rng.choices(kinds, weights=weights)[0]
        if fault():
            self.faults += 1
            cluster.trace(f"fault: {name}")

    def _stop(self) -> bool:
        up = self.cluster.up()
        if len(up) <= 1:
            return False
        node = self.rng.choice(up)
        node.stop()
        self.cluster.trace(f"{node.name} stopped")
        return True

    def _start(self) -> bool:
        down = [node for node in self.cluster if not node.up]
        if not down:
            return False
        node = self.rng.choice(down)
        node.start()
        self.cluster.trace(f"{node.name} started")
        return True

    def _restart(self) -> bool:
        up = self.cluster.up()
        if not up:
            return False
        node = self.rng.choice(up)
        node.stop()
        node.start()
        self.cluster.trace(f"{node.name} restarted")
        return True

    def _only_healthy_copy(self, node: SimNode, files_stay: bool = False) -> bool:
        """Does `node` hold the only healthy copy of a row the nemesis damaged elsewhere, or the only copy of a newer
        version that superseded it (were that one lost, the damaged version would be the record's newest again)?
        Then losing its files would leave a damage no repair can undo (the data API answers 503 for that record
        until it is written again), which the nemesis does not combine. A deletion whose marker only `node` keeps
        goes with its system database (`files_stay`: its other files stay), and what it doomed is the record's
        newest again: no cover (seed 96207: the only healthy copy of a damaged tombstone went with the wipe that
        took the deletion covering it)."""
        going = self.ledger.kept_only_by(self.cluster, node, files_stay=files_stay)
        return any(covers == [node] for covers in self._covers(going=going).values())

    def _covers(
        self, extra: DeletionFloors | None = None, database: str | None = None, going: list[Deletion] | None = None
    ) -> dict[tuple, list[SimNode]]:
        """For every row the nemesis damaged that no deletion covers, the nodes that hold a healthy copy of it or a
        newer version of its record that no deletion covers either: a covered newer version goes with its database
        and gives way to the damaged one (`drop_through` restores the newest uncovered version, seed 51361).
        `extra`: the floors of a deletion of `database` not asked for yet; `going`: deletions that a fault being
        considered would take (they cover nothing)."""
        found: dict[tuple, list[SimNode]] = {}
        for damaged in sorted(self.damaged):
            holder, name, table, record_id, version, origin = damaged
            held = self.cluster.nodes[holder].rows(name).get((table, record_id))
            if held is None or held[:2] != (version, origin):
                self.damaged.discard(damaged)
                continue  # replaced since
            extra_here = extra if name == database else None
            if self._doomed(name, origin, version, extra_here, going):
                continue  # it goes with its database
            found[damaged] = [
                other
                for other in self.cluster
                if other.name != holder
                and (row := other.rows(name).get((table, record_id), (0, "", False)))[:2] >= (version, origin)
                and (other.name, name, table, record_id, *row[:2]) not in self.damaged
                and not self._doomed(name, row[1], row[0], extra_here, going)
            ]
        return found

    def _doomed(
        self,
        database: str,
        origin: str,
        version: int,
        extra: DeletionFloors | None = None,
        going: list[Deletion] | None = None,
    ) -> bool:
        """Does a deletion of `database` whose marker lives (and is not `going`) cover (origin, version)?"""
        floors = [
            each.floors
            for each in self.ledger.deletions
            if each.database == database and not each.lost and not any(each is gone for gone in going or ())
        ]
        return any(floor.covers(origin, version) for floor in [*floors, *([extra] if extra is not None else [])])

    def _wipe(self) -> bool:
        down = [
            node for node in self.cluster if not node.up and node.dir.exists() and not self._only_healthy_copy(node)
        ]
        if not down:
            return False
        node = self.rng.choice(down)
        for path in node.dir.glob("*.sqlite"):
            lost = self.ledger.lose_unreplicated(self.cluster, node, path.name[: -len(".sqlite")])
            self.cluster.trace(f"{node.name} wiped: {path.name} ({lost} writes only it held)")
        if self.ledger.lose_markers(self.cluster, node):
            self.cluster.trace(f"{node.name} wiped: a deletion only it still held is gone with it")
        shutil.rmtree(node.dir)
        return True

    def _lose_file(self) -> bool:
        down = [
            node
            for node in self.cluster
            if not node.up and any(node.dir.glob("*.sqlite")) and not self._only_healthy_copy(node, files_stay=True)
        ]
        if not down:
            return False
        node = self.rng.choice(down)
        path = self.rng.choice(sorted(node.dir.glob("*.sqlite")))
        self.lose(node.name, path.name[: -len(".sqlite")])
        return True

    def _cut(self) -> bool:
        links = [(a, b) for a, peers in self.cluster.topology.items() for b in peers]
        link = self.rng.choice(links)
        both = self.rng.random() < 0.5
        cut = [link, (link[1], link[0])] if both else [link]
        for dialler, target in cut:
            self.cluster.cut.add((dialler, target))
            node = self.cluster.nodes[dialler]
            for pair in list(node.pairs.values()):
                if pair.peer == target:
                    self.cluster.disconnect(pair)
        self.cluster.trace(f"cut {' and '.join(f'{a}->{b}' for a, b in cut)}")
        return True

    def _heal_link(self) -> bool:
        if not self.cluster.cut:
            return False
        link = self.rng.choice(sorted(self.cluster.cut))
        self.cluster.cut.discard(link)
        self.cluster.trace(f"healed {link[0]}->{link[1]}")
        return True

    def _damage(self) -> bool:
        """Damage a row behind the store's back, one that another node holds at the same version (a row whose only
        copy is damaged is a loss no repair can undo; the data API answers 503 for it until it is written again)."""
        up = self.cluster.up()
        if not up:
            return False
        node = self.rng.choice(up)
        database = self.rng.choice(self.databases)
        rows = node.rows(database)
        candidates = [
            key
            for key, row in sorted(rows.items())
            if (node.name, database, *key, row[0], row[1]) not in self.damaged
            and any(
                other is not node
                and other.rows(database).get(key) == row
                and (other.name, database, *key, row[0], row[1]) not in self.damaged
                for other in self.cluster
            )
        ]
        if not candidates:
            return False
        table, record_id = self.rng.choice(candidates)
        version, origin, _ = rows[(table, record_id)]
        self.damaged.add((node.name, database, table, record_id, version, origin))
        assert node.store is not None
        db = node.store.database(database)
        with db._lock:
            db._conn.execute("UPDATE records SET value = X'00' WHERE tbl = ? AND id = ?", (table, record_id))
        self.cluster.trace(f"{node.name}/{database}: damaged {table}/{record_id}")
        return True

    def _clock(self) -> bool:
        node = self.rng.choice(list(self.cluster))
        # Every pair of nodes stays within max_clock_skew of each other: each within half of it of true time.
        bound = self.cluster.settings.max_clock_skew * 0.45
        node.skew = self.rng.uniform(-bound, bound)
        self.cluster.trace(f"{node.name}'s clock now {node.skew:+.1f} s")
        return True

    def _delete_database(self) -> bool:
        up = [node for node in self.cluster.up() if any(name != SYSTEM for name in node.files())]
        if not up:
            return False
        node = self.rng.choice(up)
        name = self.rng.choice([name for name in node.files() if name != SYSTEM])
        assert node.store is not None
        try:
            held = node.store.database(name).origins()
        except (UnknownDatabase, DatabaseRemoving):
            return False
        floors = dropped.seen(held)
        if any(not covers for covers in self._covers(DeletionFloors(origins=floors), name).values()):
            return False  # it would take the last cover of a damaged row (see `_only_healthy_copy`)
        marker = dropped.write(node.store.database(SYSTEM), name, requested_by=node.name, at=node.wall(), floors=floors)
        covered = node.store.dropped_floor(name)
        self.ledger.deletions.append(Deletion(name, node.name, covered, self.step, marker))
        self.cluster.trace(f"{node.name} deleted {name}: {floors}")
        return True

    def _distrust(self) -> bool:
        """A node's CA bundle loses (or has not gained yet) a peer's CA: that peer's registry rows do not verify
        there."""
        node = self.rng.choice(list(self.cluster))
        others = sorted(set(self.cluster.nodes) - {node.name} - node.trust.distrusted)
        if not others:
            return False
        origin = self.rng.choice(others)
        node.trust.distrusted.add(origin)
        self.cluster.trace(f"{node.name} distrusts {origin}'s CA")
        return True

    def _trust(self) -> bool:
        nodes = [node for node in self.cluster if node.trust.distrusted]
        if not nodes:
            return False
        node = self.rng.choice(nodes)
        origin = self.rng.choice(sorted(node.trust.distrusted))
        node.trust.distrusted.discard(origin)
        self.cluster.trace(f"{node.name} trusts {origin}'s CA again")
        return True

    def _reregister(self) -> bool:
        up = self.cluster.up()
        if not up:
            return False
        node = self.rng.choice(up)
        if self.rng.random() < 0.5:
            self._register(node)
            self.cluster.trace(f"{node.name} signed its registry row again")
        else:
            other = self.rng.choice(sorted(self.cluster.nodes))
            self._register(node, introduce=other)
            self.cluster.trace(f"{node.name} introduced {other}")
        return True

    def _silence(self) -> bool:
        sessions = [session for session in self.cluster.sessions() if not session.silent]
        if not sessions:
            return False
        session = self.rng.choice(sessions)
        session.silent = True
        self.cluster.trace(f"session {session.subscriber.name}<-{session.sender.name}/{session.database} silent")
        return True

    def _backup(self) -> bool:
        down = [node for node in self.cluster if not node.up and node.dir.exists() and node.name not in self.backups]
        if not down:
            return False
        node = self.rng.choice(down)
        copy = self.root.parent / f"{self.root.name}-backup-{node.name}"
        shutil.copytree(node.dir, copy)
        self.backups[node.name] = (copy, self.step, node.wall())
        self.cluster.trace(f"{node.name} backed up")
        return True

    def _restore(self, marked: bool = False) -> bool:
        """A stopped node's data directory replaced by its backup: copied back as it was, or `marked` as `replicator
        restore` marks every file it puts in place (`store.mark_restored`), which the node then opens as restored
        (`shared.own_writes.restore`)."""
        down = [
            node
            for node in self.cluster
            if not node.up and node.name in self.backups and not self._only_healthy_copy(node)
        ]
        if not down:
            return False
        node = self.rng.choice(down)
        copy, taken, taken_at = self.backups.pop(node.name)
        for path in node.dir.glob("*.sqlite") if node.dir.exists() else []:
            self.ledger.lose_unreplicated(self.cluster, node, path.name[: -len(".sqlite")], since=taken)
        shutil.rmtree(node.dir, ignore_errors=True)
        shutil.move(copy, node.dir)
        if marked:
            for path in sorted(node.dir.glob("*.sqlite")):
                mark_restored(path, taken_at)
        self.ledger.lose_markers(self.cluster, node, restored=True)
        self.ledger.restored(self.cluster, node)
        self.cluster.trace(f"{node.name} restored from its backup of step {taken}{', marked' if marked else ''}")
        return True

    # -- healing and the checks -----------------------------------------------------------------------------------

    def _heal(self) -> None:
        cluster = self.cluster
        cluster.trace("heal: every node up, every link up")
        cluster.cut.clear()
        for node in cluster:
            node.trust.distrusted.clear()  # every CA bundle holds every CA now
            if not node.up:
                self._boot(node)
        settings = cluster.settings
        # Past the retention: what every holder has may be purged now.
        cluster.loop.advance(settings.tombstone_retention + settings.failover_after + 1)
        for attempt in range(HEAL_ROUNDS):
            for node in cluster:
                self._connect_all(node)
            self._pump()
            for node in cluster:
                for name in node.apply_drops():
                    cluster.trace(f"{node.name} removed {name}")
            for node in cluster:
                self._connect_all(node)
            self._pump()
            for node in cluster:
                for name in node.files():
                    cluster.scrub(node, name)
                for pair in list(node.pairs.values()):
                    if pair.connected:
                        cluster.round(node, pair)
            for node in cluster:
                node.tombstone_purge()
                node.check_recoveries()
            cluster.loop.advance(settings.failover_after + 1)
            if attempt >= 2 and not self._differences() and not self._behind():
                cluster.trace(f"healed: equal after {attempt + 1} rounds")
                return

    def _connect_all(self, node: SimNode) -> None:
        cluster = self.cluster
        cluster.sync_pairs(node)
        for key in sorted(node.renew):
            pair = node.pairs.get(key)
            if pair is not None:
                cluster.disconnect(pair)
        node.renew.clear()
        for pair in list(node.pairs.values()):
            cluster.connect(node, pair)
        if self.nemesis >= 2:
            node.check_stalls()

    def _pump(self) -> None:
        """Every session sends and delivers until it is caught up (or PUMP_LIMIT batches)."""
        for session in self.cluster.sessions():
            for _ in range(PUMP_LIMIT):
                sent = session.send()
                if session.in_flight:
                    self._deliver_one(session)
                    pair = session.subscriber.pairs.get((session.sender.name, session.database))
                    if pair is None or pair.session is not session:
                        break
                elif not sent:
                    break
            node = session.subscriber
            pair = node.pairs.get((session.sender.name, session.database))
            if pair is not None and pair.session is session:
                session.report_holds()
            for key in sorted(node.renew):
                pair = node.pairs.get(key)
                if pair is not None:
                    self.cluster.disconnect(pair)
                    self.cluster.connect(node, pair)
                node.renew.discard(key)

    def _differences(self) -> list[str]:
        cluster = self.cluster
        names = sorted({name for node in cluster for name in node.files()})
        found = []
        for name in names:
            digests = {}
            for node in cluster:
                assert node.store is not None
                digests[node.name] = node.store.database(name).digest() if name in node.files() else None
            if len({repr(digest) for digest in digests.values()}) > 1:
                found.append(f"{name} differs: " + ", ".join(f"{n}={_short(d)}" for n, d in sorted(digests.items())))
        return found

    def _behind(self) -> list[str]:
        """The sessions whose sender could mark the subscriber beyond what it holds complete: after healing and
        pumping, a pair still behind is a stream that stopped (invariant 21)."""
        found = []
        for session in self.cluster.sessions():
            try:
                heads = session.plan.heads(session.source)
            except (UnknownDatabase, DatabaseRemoving):
                continue
            behind = ahead_of(heads, session.target.progress())
            if behind:
                found.append(
                    f"{session.subscriber.name}<-{session.sender.name}/{session.database} is connected and behind on"
                    f" {behind} (the sender holds {[heads[origin] for origin in sorted(behind)]})"
                )
        return found

    def _check_digests(self) -> None:
        self.violations += [f"after {HEAL_ROUNDS} rounds: {difference}" for difference in self._differences()]

    def _check_positions(self) -> None:
        self.violations += [f"step {self.step}: {problem}" for problem in self.ledger.positions(self.cluster)]


def _short(digest: object) -> str:
    if digest is None:
        return "absent"
    assert isinstance(digest, dict)
    return "/".join(f"{table}:{cell['count']}:{str(cell['digest'])[:8]}" for table, cell in sorted(digest.items()))


def topology(shape: str, names: list[str]) -> dict[str, list[str]]:
    """Who dials whom (both ways along every link)."""
    if shape == "mesh":
        return {name: [other for other in names if other != name] for name in names}
    if shape == "line":
        return {name: [names[j] for j in (i - 1, i + 1) if 0 <= j < len(names)] for i, name in enumerate(names)}
    hub = names[0]
    return {name: ([other for other in names if other != hub] if name == hub else [hub]) for name in names}


def run_seed(seed: int, **options: object) -> Outcome:
    return Simulation(seed, **options).run()  # type: ignore[arg-type]


__all__ = ["Database", "Outcome", "Pair", "Simulation", "run_seed", "topology"]
