"""A cluster of nodes in one process, on a virtual clock, over an in-memory transport.

Each `SimNode` runs the node's real data-plane code on real SQLite files: the store (`shared.store`, its own-writes
rules in `shared.own_writes`), the sender's plan (`workers.sender.OriginPlan`), the subscriber's apply, its
stand-in for a deleted database (`workers.dropped`), anti-entropy rounds (`workers.antientropy.Round`, over a
transport that answers from the peer's file), routing (`coordinator.routing.Router`, its timers on the virtual
clock), recovery (`coordinator.recovery.Recoveries`), retention (`coordinator.retention`) and deletion
(`shared.dropped`, `Database.drop_through`), the subscriber's refusal of registry rows that do not verify
(`workers.session.refuse_registry_rows`) and the stall check (`workers.session.ahead_of` against the sender's
`OriginPlan.heads`, `coordinator.replication_map.PairState.stalled`). What the sim writes itself is what the
network, the processes and the coordinator's bookkeeping do around them: which sessions exist, what a Subscribe and
a Schema carry, when a batch is sent and when it arrives.

A session (subscriber -> peer, database) follows the protocol: on connect the subscriber sends its progress, the
origins it does not want from the peer and how far it wants its own writes back; the sender checks the claim on
its own origin, answers with what it holds of the subscriber's origin and what it has purged; then batches go into
an in-flight queue (at most WINDOW) and arrive later, each applied with its marks in one transaction; a cut drops
whatever is in flight. Every choice is made by the simulation's seeded random source, so a seed replays exactly.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import shutil
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from replicator.coordinator import retention
from replicator.coordinator.recovery import Recoveries
from replicator.coordinator.replication_map import PairState
from replicator.coordinator.routing import Router
from replicator.shared import deletion, dropped, membership, messages, own_writes
from replicator.shared.deletion import NO_DELETION, DeletionFloors
from replicator.shared.store import SYSTEM, Database, DatabaseRemoving, Store, UnknownDatabase
from replicator.shared.wire import Entry
from replicator.workers import antientropy
from replicator.workers.dropped import DroppedDatabase, open_for_subscription
from replicator.workers.sender import OriginPlan
from replicator.workers.session import ahead_of, refuse_registry_rows

EPOCH = 1_800_000_000.0  # the virtual clock's zero, on the wall clock
WINDOW = 4  # batches in flight per session
US = 1_000_000


@dataclass
class Settings:
    max_clock_skew: float = 60.0
    tombstone_retention: float = 40.0
    audit_retention: float = 30.0
    failover_after: float = 10.0
    stall_threshold: float = 20.0
    batch_size: int = 6


# -- the virtual clock ------------------------------------------------------------------------------------------------


class Handle:
    def __init__(self, when: float, callback: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.when = when
        self.callback = callback
        self.args = args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class SimLoop:
    """Enough of an event loop for the node's timers: `time()` and `call_later()`, run by `advance()`."""

    def __init__(self) -> None:
        self._now = 0.0
        self._timers: list[tuple[float, int, Handle]] = []
        self._order = itertools.count()

    def time(self) -> float:
        return self._now

    def call_later(self, delay: float, callback: Callable[..., Any], *args: Any) -> Handle:
        return self.call_at(self._now + max(0.0, delay), callback, *args)

    def call_at(self, when: float, callback: Callable[..., Any], *args: Any) -> Handle:
        handle = Handle(max(when, self._now), callback, args)
        heapq.heappush(self._timers, (handle.when, next(self._order), handle))
        return handle

    def advance(self, seconds: float) -> None:
        target = self._now + seconds
        while self._timers and self._timers[0][0] <= target:
            when, _, handle = heapq.heappop(self._timers)
            self._now = max(self._now, when)
            if not handle.cancelled:
                handle.callback(*handle.args)
        self._now = target

    def pending(self) -> int:
        return sum(1 for _, _, handle in self._timers if not handle.cancelled)


def drive(coroutine: Any) -> Any:
    """Run a coroutine that awaits nothing but `asyncio.sleep(0)` (an anti-entropy round over the in-memory
    transport at rate 0) to its end, without an event loop: each bare yield is resumed at once."""
    try:
        while True:
            coroutine.send(None)
    except StopIteration as stop:
        return stop.value


# -- a node -----------------------------------------------------------------------------------------------------------


@dataclass
class Pair(PairState):
    """This node's subscription to `peer` for `database`: the coordinator's `PairState` (what recovery and the stall
    check read), and the session that carries it while connected."""

    peer: str = ""
    session: Session | None = None


class Trust:
    """What `membership.Verifier` decides of the registry rows a node is served: a row verifies unless its signer's
    CA is missing from this node's bundle (`distrusted`: a CA rotation half done)."""

    def __init__(self) -> None:
        self.distrusted: set[str] = set()

    def refusals(self, entries: Any) -> list[tuple[Any, str]]:
        return [
            (entry, f"signed under a CA of {entry.origin} this node's bundle lacks")
            for entry in entries
            if entry.table in membership.TABLES and not entry.tombstone and entry.origin in self.distrusted
        ]


class _Counters:
    def inc(self, *args: Any, **kwargs: Any) -> None:
        pass


class _WorkerContext:
    """What `workers.dropped` uses of a worker's context."""

    def __init__(self, node: SimNode) -> None:
        self._node = node
        self.verifier = node.trust
        self.counters = _Counters()

    @property
    def store(self) -> Store:
        assert self._node.store is not None
        return self._node.store

    def database(self, name: str, create: bool = False) -> Database:
        return self.store.database(name, create=create)


class SimNode:
    def __init__(self, cluster: Cluster, name: str, directory: Path) -> None:
        self.cluster = cluster
        self.name = name
        self.dir = directory
        self.skew = 0.0  # seconds this node's wall clock is off the virtual one
        self.store: Store | None = None
        self.router: Router | None = None
        self.recoveries = Recoveries()
        self.peer_holds: dict[tuple[str, str], dict[str, int]] = {}
        self.pairs: dict[tuple[str, str], Pair] = {}
        self.holds: set[str] = set()  # what the registry says this node holds (kept while it is down)
        self.renew: set[tuple[str, str]] = set()  # pairs whose subscription changed: their session must be renewed
        self.trust = Trust()
        self.stall_kicks = 0
        self.ctx = _WorkerContext(self)

    # -- clock and life ------------------------------------------------------------------------------------------

    def wall(self) -> float:
        return EPOCH + self.cluster.loop.time() + self.skew

    def _clock_ns(self) -> int:
        return int(self.wall() * 1e9)

    @property
    def up(self) -> bool:
        return self.store is not None

    def start(self) -> None:
        """Boot as the coordinator does: open the store, note what it holds, start recoveries."""
        settings = self.cluster.settings
        self.dir.mkdir(parents=True, exist_ok=True)
        self.store = Store(
            self.dir,
            self.name,
            clock=self._clock_ns,
            synchronous="OFF",
            clock_lead=settings.max_clock_skew,
            holdings=True,
        )
        self.store.database(SYSTEM, create=True)
        self.store.note_held(self.store.names())
        self.router = Router(settings.failover_after, self._route_changed, loop=self.cluster.loop)  # type: ignore[arg-type]
        self.recoveries = Recoveries()
        self.peer_holds = {}
        self.pairs = {}
        self.renew = set()
        for name in self.store.names():
            self.note_database(name)
        self.holds = set(self.store.names())

    def stop(self) -> None:
        for pair in list(self.pairs.values()):
            self.cluster.disconnect(pair)
        for other in self.cluster.nodes.values():
            if other is not self:
                for pair in list(other.pairs.values()):
                    if pair.peer == self.name:
                        other.cluster.disconnect(pair)
        if self.router is not None:
            self.router.close()
            self.router = None
        if self.store is not None:
            self.store.close()
            self.store = None

    def files(self) -> list[str]:
        assert self.store is not None
        return self.store.names()

    def database(self, name: str, create: bool = False) -> Database:
        assert self.store is not None
        db = self.store.database(name, create=create)
        if name not in self.holds:
            self.holds.add(name)
            self.note_database(name)
        return db

    def note_database(self, name: str) -> None:
        assert self.store is not None
        try:
            recovering = self.store.database(name).recovering
        except UnknownDatabase:
            return
        if recovering and name not in self.recoveries:
            self.recoveries.begin(name, wall=self.wall(), now=self.cluster.loop.time())
            self._resubscribe(name)  # every origin from every peer while it recovers

    def _resubscribe(self, database: str) -> None:
        for peer, name in self.pairs:
            if name == database:
                self.renew.add((peer, name))

    # -- what the coordinator decides ------------------------------------------------------------------------------

    def exclude(self, database: str, peer: str) -> list[str]:
        """The origins this node's subscription to `peer` does not take (`Node._payload`): none while the database
        recovers, what the router says otherwise."""
        assert self.router is not None
        return [] if database in self.recoveries else self.router.exclude(database, peer)

    def _route_changed(self, database: str) -> None:
        for (peer, name), pair in self.pairs.items():
            session = pair.session
            if name == database and session is not None and sorted(self.exclude(name, peer)) != sorted(session.exclude):
                self.renew.add((peer, name))

    def regressed(self, database: str, floor: int) -> None:
        if self.recoveries.regressed(database, floor, wall=self.wall(), now=self.cluster.loop.time()):
            self._resubscribe(database)

    def check_recoveries(self) -> None:
        assert self.store is not None
        trusted = SYSTEM not in self.recoveries
        for database in self.recoveries.recovering():
            pairs = {pair.peer: pair for (peer, name), pair in self.pairs.items() if name == database}
            holders = [
                node.name
                for node in self.cluster.nodes.values()
                if node is not self and (database == SYSTEM or database in node.holds)
            ]
            asked = functools.partial(tuple, holders)
            if not self.recoveries.ready(database, pairs, holders=asked, registry_trusted=trusted):
                continue
            try:
                records = self.store.database(database).finish_recovery()
            except UnknownDatabase:
                continue
            self.recoveries.finish(database, records, wall=self.wall())
            self._resubscribe(database)  # its origins are routed again
            if database == SYSTEM:
                break  # the others are looked at again with the whole registry

    def check_stalls(self) -> None:
        """The coordinator's stall check (`Node._kick_stalled`): the subscriber compares the sender's heads with what
        it holds complete (as `wire.Heads` would tell it now) and a pair ahead whose positions have not moved for
        stall_threshold is renewed."""
        now = self.cluster.loop.time()
        for _, pair in sorted(self.pairs.items(), key=lambda item: item[0]):
            session = pair.session
            if session is None:
                continue
            try:
                heads = session.plan.heads(session.source)
            except (UnknownDatabase, DatabaseRemoving):
                continue
            ceiling = int((self.wall() + self.cluster.settings.max_clock_skew) * US)
            heads = {origin: head for origin, head in heads.items() if head <= ceiling}
            pair.note_ahead(ahead_of(heads, session.target.progress()), now)
            if pair.stalled(now, self.cluster.settings.stall_threshold):
                self.cluster.trace(f"stall kick {self.name}<-{pair.peer}/{pair.database}: ahead {pair.ahead}")
                pair.stall_kicked_at = now
                self.stall_kicks += 1
                self.cluster.disconnect(pair)
                self.cluster.connect(self, pair)

    def tombstone_purge(self) -> int:
        """The node's retention pass: prune the audit history, purge the tombstones every holder has."""
        assert self.store is not None
        settings = self.cluster.settings
        removed = 0
        for name in self.store.names():
            try:
                db = self.store.database(name)
            except UnknownDatabase:
                continue
            db.prune_audit(settings.audit_retention, self.wall())
            holders = [node.name for node in self.cluster.nodes.values() if node is not self and name in node.holds]
            floors = retention.tombstone_floors(
                db.origins(), [self.peer_holds.get((name, holder)) for holder in holders]
            )
            if floors is not None:
                horizon = retention.purge_horizon(self.wall(), settings.tombstone_retention)
                removed += db.purge_tombstones(floors, horizon)
        return removed

    def apply_drops(self) -> list[str]:
        """The node's pass over the deletion markers (`coordinator.drops`): purge what they cover, remove what is left
        empty. Returns the databases removed."""
        assert self.store is not None
        removed = []
        for name, floors in sorted(dropped.floors(self.store.database(SYSTEM)).items()):
            if not self.store.path(name).exists():
                continue
            db = self.store.database(name)
            if not floors.within(db.dropped_purged):
                own = floors.floor_of(self.name)
                if db.regress(own, by_deletion=True):
                    self.cluster.trace(f"{self.name}/{name} regressed to {own} (deletion floor)")
                    self.regressed(name, own)
                db.drop_through(floors)
            if dropped.left_empty(db, floors):
                for pair in [pair for pair in self.pairs.values() if pair.database == name]:
                    self.cluster.disconnect(pair)
                for other in self.cluster.nodes.values():
                    for pair in list(other.pairs.values()):
                        if pair.peer == self.name and pair.database == name:
                            self.cluster.disconnect(pair)
                self.store.block(name)
                if self.store.remove(name):
                    removed.append(name)
                    self.holds.discard(name)
                    self.recoveries.forget(name)
                    for key in [key for key in self.peer_holds if key[0] == name]:
                        del self.peer_holds[key]
                    for key in [key for key in self.pairs if key[1] == name]:
                        assert self.router is not None
                        self.router.forget(name, key[0])
                        del self.pairs[key]
                self.store.unblock(name)
        return removed

    def file_floors(self, database: str) -> DeletionFloors:
        """The deletion floors this node's file of `database` keeps (`shared.deletion`), read behind the store's
        back; none without a file."""
        path = self.dir / f"{database}.sqlite"
        if not path.exists() or database == SYSTEM:
            return NO_DELETION
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
            try:
                return deletion.floors(conn)
            except sqlite3.Error:
                return NO_DELETION

    def complete(self, database: str) -> dict[str, int]:
        """Per origin, the version the node's file of `database` holds complete (`Database.origins`), read behind the
        store's back when the node is down."""
        path = self.dir / f"{database}.sqlite"
        if not path.exists():
            return {}
        if self.store is not None:
            try:
                return {origin: held.complete for origin, held in self.store.database(database).origins().items()}
            except (UnknownDatabase, DatabaseRemoving):
                return {}
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
            try:
                held = dict(conn.execute("SELECT origin, complete FROM origins").fetchall())
                if self.name in held:
                    held[self.name] = own_writes.read(conn, self.name).complete
            except sqlite3.Error:
                return {}
        return held

    def rewrite_pending(self, database: str) -> int:
        """The highest claim whose writes again the node's unknown file of `database` has pending until its recovery
        ends (`shared.own_writes.defer_rewrite`; 0: none), read behind the store's back."""
        path = self.dir / f"{database}.sqlite"
        if not path.exists():
            return 0
        query = "SELECT max(CAST(value AS INTEGER)) FROM meta WHERE substr(key, 1, 8) = 'rewrite/'"
        if self.store is not None:
            try:
                db = self.store.database(database)
            except (UnknownDatabase, DatabaseRemoving):
                return 0
            with db._lock:
                found = db._conn.execute(query).fetchone()
        else:
            with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
                try:
                    found = conn.execute(query).fetchone()
                except sqlite3.Error:
                    return 0
        return int(found[0] or 0)

    def value(self, database: str, table: str, record_id: str) -> bytes | None:
        """A record's value as the node holds it (None: absent or a tombstone), read behind the store's back."""
        path = self.dir / f"{database}.sqlite"
        if not path.exists():
            return None
        query = "SELECT CAST(value AS BLOB), tombstone FROM records WHERE tbl = ? AND id = ?"
        if self.store is not None:
            db = self.store.database(database)
            with db._lock:
                found = db._conn.execute(query, (table, record_id)).fetchone()
        else:
            with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
                found = conn.execute(query, (table, record_id)).fetchone()
        return None if found is None or found[1] else bytes(found[0])

    def rows(self, database: str) -> dict[tuple[str, str], tuple[int, str, bool]]:
        """Every row of the database's file as it stands, read behind the store's back (on its connection, when the
        node is up)."""
        path = self.dir / f"{database}.sqlite"
        if not path.exists():
            return {}
        query = "SELECT tbl, id, version, origin, tombstone FROM records"
        if self.store is not None:
            try:
                db = self.store.database(database)
            except (UnknownDatabase, DatabaseRemoving):
                return {}
            with db._lock:
                found = db._conn.execute(query).fetchall()
        else:
            with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
                found = conn.execute(query).fetchall()
        return {
            (table, record_id): (version, origin, bool(tombstone))
            for table, record_id, version, origin, tombstone in found
        }


# -- sessions ---------------------------------------------------------------------------------------------------------


class SessionEnded(Exception):
    """The session ended: a refusal by either end (the reason is kept for the trace)."""


@dataclass
class Session:
    cluster: Cluster
    subscriber: SimNode
    sender: SimNode
    database: str
    exclude: list[str]
    own_upto: int
    plan: OriginPlan
    target: Database | DroppedDatabase
    source: Database
    # (entries, marks, caught up, the sender's file recovering): `wire.Batch`
    in_flight: list[tuple[list[Entry], dict[str, int], bool, bool]] = field(default_factory=list)
    told_caught_up: bool = False
    told_recovering: bool = False
    # The sender stopped serving while the session stays up (a renewal the worker never did: issue 20's hole 5).
    silent: bool = False
    refused_below: dict[str, int] = field(default_factory=dict)

    def send(self) -> bool:
        """The sender makes its next batch (or says it is caught up), if its window has room; True if it sent."""
        if len(self.in_flight) >= WINDOW or self.silent:
            return False
        limit = self.cluster.settings.batch_size
        recovering = self.source.recovering
        entries, marks, more = self.plan.next_batch(self.source, limit)
        if not entries and not marks:
            # Said again when the sender's file stops recovering (`Sender._serve`).
            if (self.told_caught_up and self.told_recovering == recovering) or self.plan.blocked:
                return False
            self.in_flight.append(([], {}, True, recovering))
            self.told_caught_up, self.told_recovering = True, recovering
            return True
        caught_up = not more and not self.plan.blocked
        self.in_flight.append((entries, marks, caught_up, recovering))
        self.told_caught_up, self.told_recovering = caught_up, recovering
        return True

    def report_holds(self) -> None:
        """The subscriber's `wire.Holds`: what it holds complete of every origin, its own and those it gets over
        other links included, for the sender's node to purge by (`Sender._take_holds`)."""
        holds = self.sender.peer_holds.setdefault((self.database, self.subscriber.name), {})
        for origin, version in self.target.progress().items():
            holds[origin] = max(holds.get(origin, 0), version)

    def deliver(self) -> None:
        """The oldest batch in flight arrives: checked as the subscriber checks it, applied with its marks, acked."""
        entries, marks, caught_up, recovering = self.in_flight.pop(0)
        sub = self.subscriber
        ceiling = int((sub.wall() + self.cluster.settings.max_clock_skew) * US)
        top = max([entry.version for entry in entries] + list(marks.values()) + [0])
        if top > ceiling:
            raise SessionEnded(f"clock skew: version {top} past {ceiling}")
        for entry in entries:
            if entry.origin == sub.name and entry.version > self.own_upto:
                raise SessionEnded(f"the sender served {entry.table}/{entry.id} under our origin")
            if entry.origin in self.exclude:
                raise SessionEnded(f"the sender served {entry.table}/{entry.id} of an excluded origin (a bug here)")
        if self.database == SYSTEM:
            entries, marks = refuse_registry_rows(
                self.subscriber.ctx,  # type: ignore[arg-type]
                self.sender.name,
                entries,
                marks,
                self.refused_below,
            )
        self.target.apply_batch(entries, marks, peer=self.sender.name)
        # The ack: the sender learns what the subscriber holds now.
        holds = self.sender.peer_holds.setdefault((self.database, sub.name), {})
        for origin, mark in marks.items():
            holds[origin] = max(holds.get(origin, 0), mark)
        pair = sub.pairs.get((self.sender.name, self.database))
        if pair is not None and pair.session is self:
            pair.caught_up = caught_up
            pair.peer_recovering = recovering
            if entries or marks:
                pair.last_progress_at = self.cluster.loop.time()
            assert sub.router is not None
            sub.router.report(self.database, self.sender.name, up=True, caught_up=caught_up)
            if caught_up and self.database in sub.recoveries:
                sub.recoveries.caught_up(self.database, self.sender.name, pair)
                sub.check_recoveries()


# -- the cluster ------------------------------------------------------------------------------------------------------


class Cluster:
    def __init__(self, root: Path, names: list[str], topology: dict[str, list[str]], settings: Settings) -> None:
        self.root = root
        self.settings = settings
        self.loop = SimLoop()
        self.nodes = {name: SimNode(self, name, root / name) for name in names}
        self.topology = topology  # who dials whom
        self.cut: set[tuple[str, str]] = set()  # (dialler, target) links that carry nothing
        self.log: list[str] = []

    def __iter__(self) -> Iterator[SimNode]:
        return iter(self.nodes.values())

    def up(self) -> list[SimNode]:
        return [node for node in self.nodes.values() if node.up]

    def trace(self, line: str) -> None:
        self.log.append(f"{self.loop.time():9.3f} {line}")

    def close(self) -> None:
        for node in self.nodes.values():
            if node.store is not None:
                node.store.close()
                node.store = None
        shutil.rmtree(self.root, ignore_errors=True)

    # -- pairs and sessions ------------------------------------------------------------------------------------

    def wanted_pairs(self, node: SimNode) -> list[tuple[str, str]]:
        """The (peer, database) pairs `node` subscribes to: the databases each peer it dials holds, the system
        database always (the registry as it stands, kept for a node that is down)."""
        wanted = []
        for peer in self.topology[node.name]:
            for database in sorted(self.nodes[peer].holds | {SYSTEM}):
                wanted.append((peer, database))
        return wanted

    def sync_pairs(self, node: SimNode) -> None:
        """The registry pass: pairs for what the peers hold, dropped for what they no longer do."""
        assert node.router is not None
        wanted = set(self.wanted_pairs(node))
        for key in sorted(wanted - set(node.pairs)):
            peer, database = key
            payload = messages.Subscribe(key=peer, peer=peer, url=f"wss://{peer}", database=database)
            node.pairs[key] = Pair(database=database, payload=payload, created_at=self.loop.time(), peer=peer)
            node.router.track(database, peer)
        for key in sorted(set(node.pairs) - wanted):
            pair = node.pairs.pop(key)
            self.disconnect(pair, node)
            node.router.forget(key[1], key[0])

    def connect(self, node: SimNode, pair: Pair) -> bool:
        """Open the pair's session if it can be: both ends up, the link up, the peer holding the database."""
        peer = self.nodes[pair.peer]
        if pair.session is not None or not node.up or not peer.up or (node.name, peer.name) in self.cut:
            return False
        assert node.store is not None and peer.store is not None and node.router is not None
        if not peer.store.path(pair.database).exists() and pair.database != SYSTEM:
            return False  # a subscription never creates the database at the sender
        try:
            source = peer.store.database(pair.database)
            target = open_for_subscription(node.ctx, pair.database)  # type: ignore[arg-type]
        except (UnknownDatabase, DatabaseRemoving):
            return False
        if isinstance(target, Database):
            node.holds.add(pair.database)
            node.note_database(pair.database)
        progress = target.progress()
        exclude = node.exclude(pair.database, peer.name)
        own_upto = target.own_history().asks
        # A regression found below raises the node's floor: this session, asking for less, no longer serves the
        # recovery (`Connected.own_upto`), and it is renewed.
        node.renew.discard((peer.name, pair.database))
        settings = self.settings
        # The sender: the subscriber's claim on the sender's own origin, as `Sender._check_regression` checks it.
        claimed = progress.get(peer.name, 0)
        if 0 < claimed <= int((peer.wall() + settings.max_clock_skew) * US) and source.regress(claimed, peer=node.name):
            self.trace(f"{peer.name}/{pair.database} regressed to {claimed} (claim of {node.name})")
            peer.regressed(pair.database, claimed)
        plan = OriginPlan(dict(progress), frozenset(exclude), {node.name: own_upto})
        origins = source.origins()
        yours = origins[node.name].complete if node.name in origins else 0
        purged = {origin: scanned for origin, scanned in source.purged().items() if origin not in exclude}
        peer.peer_holds[(pair.database, node.name)] = {o: v for o, v in progress.items() if v > 0}
        # The subscriber reads the Schema (`PeerSession._check_schema`).
        ceiling = int((node.wall() + settings.max_clock_skew) * US)
        if 0 < yours <= ceiling and isinstance(target, Database) and target.regress(yours, peer=peer.name):
            self.trace(f"{node.name}/{pair.database} regressed to {yours} (Schema of {peer.name})")
            node.regressed(pair.database, yours)
        behind = [o for o, scanned in purged.items() if progress.get(o, 0) < scanned]
        session = Session(self, node, peer, pair.database, list(exclude), own_upto, plan, target, source)
        pair.session = session
        pair.connected = True
        pair.caught_up = False
        pair.connected_at = self.loop.time()
        pair.own_upto = own_upto
        pair.note_ahead({}, self.loop.time())  # a new session's first report: nothing seen ahead yet
        node.router.report(pair.database, peer.name, up=True)
        if behind and isinstance(target, Database) and not target.is_empty():
            self.trace(f"{node.name}/{pair.database} behind {peer.name}'s purge of {behind}: round now")
            self.round(node, pair)
        return True

    def disconnect(self, pair: Pair, node: SimNode | None = None) -> None:
        if pair.session is None:
            return
        subscriber = pair.session.subscriber
        pair.session = None
        pair.connected = False
        pair.caught_up = False
        if subscriber.router is not None:
            subscriber.router.report(pair.database, pair.peer, up=False)

    def sessions(self) -> list[Session]:
        return [pair.session for node in self.up() for pair in node.pairs.values() if pair.session is not None]

    def end(self, session: Session, reason: str) -> None:
        pair = session.subscriber.pairs.get((session.sender.name, session.database))
        self.trace(f"session {session.subscriber.name}<-{session.sender.name}/{session.database} ended: {reason}")
        if pair is not None and pair.session is session:
            self.disconnect(pair)

    # -- anti-entropy ---------------------------------------------------------------------------------------------

    def round(self, node: SimNode, pair: Pair) -> antientropy.RoundResult | None:
        """One anti-entropy round of `node`'s copy against the pair's peer (which must be reachable)."""
        peer = self.nodes[pair.peer]
        if not node.up or not peer.up or (node.name, peer.name) in self.cut:
            return None
        assert node.store is not None and peer.store is not None
        try:
            mine = node.store.database(pair.database)
            theirs = peer.store.database(pair.database)
        except (UnknownDatabase, DatabaseRemoving):
            return None
        ceiling = int((node.wall() + self.settings.max_clock_skew) * US)
        round_ = antientropy.Round(
            mine,
            antientropy.local_transport(theirs),
            rate=0.0,
            ceiling=lambda: ceiling,
            ca=None,
            verifier=node.trust,  # type: ignore[arg-type]
        )
        result = drive(round_.run())
        if result.repaired or result.foreign:
            self.trace(
                f"round {node.name}<-{peer.name}/{pair.database}: repaired {result.repaired},"
                f" foreign {result.foreign}, reasserted {result.reasserted}"
            )
        return result

    def scrub(self, node: SimNode, database: str) -> int:
        assert node.store is not None
        try:
            db = node.store.database(database)
        except UnknownDatabase:
            return 0
        after: int | None = 0
        found = 0
        while after is not None:
            after, damaged = db.scrub(after, 500)
            found += len(damaged)
        db.check_digests()
        return found


def encode(value: Any) -> bytes:
    return msgspec.msgpack.encode(value)


def own_history(db: Database) -> own_writes.OwnHistory:
    return db.own_history()
