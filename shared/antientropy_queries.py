"""Anti-entropy's queries and their serving end, shared by the worker's round (`workers.antientropy`) and the admin
port's digest-tree requests (`coordinator.digest_tree`, `coordinator.diff`).

    Roots(database)                          -> RootsReply: every table's root digest
    Children(database, table, level, nodes)  -> ChildrenReply: the 16 child digests of each node
    Rows(database, table, level, nodes)      -> RowsReply: (id, version, origin, tombstone, checksum) under them
    Fetch(database, table, ids)              -> FetchReply: those records, intact ones only (and the ids left)
    State(database)                          -> StateReply: what the peer holds complete and has purged, by origin

Every query has a bounded cost, whoever sends it (issue 21): `check_query` refuses one that names what cannot exist
or asks for more than one answer may hold, `answer` one that would read more than its caps, and `Admission` gives a
few queries of a peer a turn at a time. `query_batches` cuts the nodes of one level into queries within those caps,
as an honest puller asks them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Annotated

import msgspec

from replicator.shared import digests, wire
from replicator.shared.config import NAME_RE
from replicator.shared.store import BadName, Database, ScanLimit, check_name
from replicator.shared.wire import Entry

SYSTEM = "system"
LEAF_ROWS = 16  # a node holding at most this many rows on each side is settled by exchanging its rows
MAX_NODES = 256  # tree nodes per Children or Rows request
# Nodes below the stored buckets are computed from the rows of the bucket that holds them: a query of them reads
# whole buckets, so fewer go in one, and the puller also keeps the rows of their buckets under SCAN_BATCH.
MAX_ROW_NODES = 32
MAX_IDS = 1024  # ids a peer may ask for in one Fetch
MAX_QUERY_BYTES = 1024 * 1024
MAX_ORIGINS = 1024  # origins a State answer may name (as many as a subscription may)

# What one answer may cost the serving end (issue 21: one Rows query of 256 copies of the root read 5 million rows
# and held a worker's loop 14 s; a Fetch of 1,024 copies of one id answered 205 MB). A query past a cap is refused
# (BadQuery, a 400 naming it), except a Fetch, which serves what fits and names the ids left for a next one.
MAX_ROWS = 2 * MAX_NODES * LEAF_ROWS  # rows in one Rows answer: twice what an honest puller asks, for live writes
MAX_SCAN_ROWS = 65_536  # rows of the buckets one query below the stored level reads (ids and checksums)
SCAN_BATCH = MAX_SCAN_ROWS // 2  # what the puller holds one such query to, by the bucket counts it has seen
FETCH_BYTES = 4 * 1024 * 1024  # ids and values one Fetch answer serves (its first record whatever its size)
# Queries answered at once, in threads: per peer, and per worker over all peers. A peer's further queries wait for
# a turn (at most WAITING_PER_PEER of them, each at most listen.request_timeout); others are refused with 503.
QUERIES_PER_PEER = 2
QUERIES_PER_WORKER = 4
WAITING_PER_PEER = 64

# What one round may take of the pulling end, whatever the peer answers (issue 21: a peer that said every child
# differs grew a worker by 1 GB in 150 s over 59,686 queries, and the round never ended). Past one, the round fails
# naming it (`RoundResult.limit`). An honest round within them repairs a divergence of about a million rows.
MAX_FRONTIER = 131_072  # tree nodes pending in one table: those not compared yet and those to settle
MAX_ROUND_QUERIES = 32_768
MAX_ROUND_BYTES = 4 * 1024**3  # queries and answers together


# -- the wire ------------------------------------------------------------------------------------------------


class Roots(msgspec.Struct, tag="roots", kw_only=True):
    database: str


class Children(msgspec.Struct, tag="children", kw_only=True):
    database: str
    table: str
    level: int
    nodes: list[int]


class Rows(msgspec.Struct, tag="rows", kw_only=True):
    database: str
    table: str
    level: int
    nodes: list[int]


class Fetch(msgspec.Struct, tag="fetch", kw_only=True):
    database: str
    table: str
    ids: list[str]


class State(msgspec.Struct, tag="state", kw_only=True):
    database: str


Query = Roots | Children | Rows | Fetch | State


# The replies' lengths are capped where they are decoded (msgspec checks a length before it decodes the items): a
# peer's answer cannot make the puller build more than the caps' worth of objects.
MAX_TABLES = 65_536  # tables one Roots answer may name


class RootsReply(msgspec.Struct, kw_only=True):
    tables: Annotated[dict[str, tuple[int, int]], msgspec.Meta(max_length=MAX_TABLES)]


class ChildrenReply(msgspec.Struct, kw_only=True):
    children: Annotated[
        list[Annotated[list[tuple[int, int]], msgspec.Meta(max_length=digests.FANOUT)]],
        msgspec.Meta(max_length=MAX_NODES),
    ]


class RowsReply(msgspec.Struct, kw_only=True):
    # (id, version, origin, tombstone, checksum); checksum None: damaged on the peer
    rows: Annotated[list[tuple[str, int, str, bool, int | None]], msgspec.Meta(max_length=MAX_ROWS)]


class FetchReply(msgspec.Struct, kw_only=True):
    entries: Annotated[list[Entry], msgspec.Meta(max_length=MAX_IDS)]
    damaged: Annotated[list[str], msgspec.Meta(max_length=MAX_IDS)] = []
    # Ids not looked at, past FETCH_BYTES: the puller asks for them again.
    left: Annotated[list[str], msgspec.Meta(max_length=MAX_IDS)] = []


class StateReply(msgspec.Struct, kw_only=True):
    # By origin: every version up to it is held (or superseded).
    complete: Annotated[dict[str, wire.Count], msgspec.Meta(max_length=MAX_ORIGINS)]
    # By origin: its tombstones up to it were purged (every holder had them).
    purged: Annotated[dict[str, wire.Count], msgspec.Meta(max_length=MAX_ORIGINS)] = {}


Reply = RootsReply | ChildrenReply | RowsReply | FetchReply | StateReply

_encode = msgspec.msgpack.Encoder().encode
_query_decoder = msgspec.msgpack.Decoder(Query)


class BadQuery(ValueError):
    """A query that names something that cannot exist or asks for too much; the message says what."""


def decode_query(body: bytes) -> Query:
    try:
        query = _query_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadQuery(f"not an anti-entropy query: {exc}") from None
    return check_query(query)


def check_query(query: Query) -> Query:
    """The query, when it names what can exist and asks for no more than one answer may hold (BadQuery otherwise):
    the checks of every query a peer sends, and of the admin port's digest-tree requests (`coordinator.diff`)."""
    if not NAME_RE.match(query.database):
        raise BadQuery(f"bad database name {query.database[:70]!r}")
    if isinstance(query, Children | Rows | Fetch):
        try:
            check_name(query.table, "table")
        except BadName as exc:
            raise BadQuery(str(exc)) from None
    if isinstance(query, Children | Rows):
        top = digests.MAX_LEVEL - 1 if isinstance(query, Children) else digests.MAX_LEVEL
        if not 0 <= query.level <= top:
            raise BadQuery(f"level {query.level} is outside 0..{top}")
        if len(query.nodes) > MAX_NODES:
            raise BadQuery(f"{len(query.nodes)} nodes in one query; at most {MAX_NODES}")
        width = 1 << (digests.FANOUT_BITS * query.level)
        if any(not 0 <= node < width for node in query.nodes):
            raise BadQuery(f"a node outside level {query.level} of the tree")
        # A puller asks for each node once; a copy would only make this end read the same rows again.
        if len(set(query.nodes)) != len(query.nodes):
            raise BadQuery(f"{len(query.nodes) - len(set(query.nodes))} nodes asked for twice in one query")
    if isinstance(query, Fetch):
        if len(query.ids) > MAX_IDS:
            raise BadQuery(f"{len(query.ids)} ids in one fetch; at most {MAX_IDS}")
        if len(set(query.ids)) != len(query.ids):
            raise BadQuery(f"{len(query.ids) - len(set(query.ids))} ids asked for twice in one fetch")
    return query


def answer(db: Database, query: Query) -> Reply:
    """The serving end: one query against this node's copy of the database, within the caps above (BadQuery past
    one). Blocking SQLite work, bounded per query: the worker runs it in a thread (`Admission`)."""
    match query:
        case Roots():
            return RootsReply(tables=db.roots())
        case Children(table=table, level=level, nodes=nodes):
            if level >= digests.STORED_LEVEL:
                _within_scan(db, table, level, nodes)
            try:
                return ChildrenReply(children=db.children(table, level, nodes, scan_limit=MAX_SCAN_ROWS))
            except ScanLimit as exc:
                raise BadQuery(f"{exc}; ask for fewer nodes") from None
        case Rows(table=table, level=level, nodes=nodes):
            if level <= digests.STORED_LEVEL:
                held = db.rows_under(table, level, nodes)
                if held > MAX_ROWS:
                    raise BadQuery(
                        f"{held} rows under these nodes; a Rows answer holds at most {MAX_ROWS}: ask for their children"
                    )
            else:
                _within_scan(db, table, level, nodes)
            try:
                return RowsReply(rows=db.summaries(table, level, nodes, limit=MAX_ROWS, scan_limit=MAX_SCAN_ROWS))
            except ScanLimit as exc:
                raise BadQuery(f"{exc}; a Rows answer holds at most {MAX_ROWS}: ask for their children") from None
        case Fetch(table=table, ids=ids):
            entries, damaged, left = db.fetch_within(table, ids, FETCH_BYTES)
            return FetchReply(entries=entries, damaged=damaged, left=left)
        case State():
            return StateReply(complete=db.progress(), purged=db.purged())
    raise BadQuery(f"unknown query {type(query).__name__}")


def _within_scan(db: Database, table: str, level: int, nodes: list[int]) -> None:
    """Refuse a query below the stored level whose nodes' buckets hold more than MAX_SCAN_ROWS rows, before
    reading them."""
    scanned = db.rows_under(table, level, nodes)
    if scanned > MAX_SCAN_ROWS:
        raise BadQuery(f"the buckets of these nodes hold {scanned} rows; one query reads at most {MAX_SCAN_ROWS}")


def encode(message: msgspec.Struct) -> bytes:
    return _encode(message)


def answer_bytes(db: Database, query: Query) -> bytes:
    """`answer`, encoded: what a thread of the serving end returns."""
    return _encode(answer(db, query))


class Busy(Exception):
    """No turn to answer the query: its peer has as many queries answered and waiting as allowed, or the wait for a
    turn ran out."""


@dataclass(eq=False)
class _PeerTurns:
    semaphore: asyncio.Semaphore
    users: int = 0  # queries of the peer answering or waiting for a turn


class Admission:
    """Turns to answer peers' queries in a worker: QUERIES_PER_PEER of one peer at once, behind which at most
    WAITING_PER_PEER wait, and QUERIES_PER_WORKER answered in threads at once over all peers. A turn held by a
    query whose thread still runs outlasts its request: a peer that drops its queries cannot pile threads up."""

    def __init__(
        self,
        *,
        per_peer: int = QUERIES_PER_PEER,
        per_worker: int = QUERIES_PER_WORKER,
        waiting: int = WAITING_PER_PEER,
        to_thread: Callable[..., Awaitable[bytes]] = asyncio.to_thread,
    ) -> None:
        self._per_peer = per_peer
        self._waiting = waiting
        self._worker = asyncio.Semaphore(per_worker)
        self._peers: dict[str, _PeerTurns] = {}
        self._to_thread = to_thread

    @property
    def peers(self) -> int:
        """Peers with a query answering or waiting (the map holds no others)."""
        return len(self._peers)

    @contextlib.asynccontextmanager
    async def turn(self, peer: str, wait: float) -> AsyncIterator[Turn]:
        """The peer's turn, waited for at most `wait` seconds (Busy after that, or at once when too many wait)."""
        turns = self._peers.get(peer)
        if turns is None:
            turns = self._peers[peer] = _PeerTurns(asyncio.Semaphore(self._per_peer))
        if turns.users >= self._per_peer + self._waiting:
            raise Busy(f"{turns.users} queries of this peer are answering or waiting; at most {self._per_peer} answer")
        turns.users += 1
        turn = Turn(self, peer, turns, wait)
        try:
            try:
                async with asyncio.timeout(wait):
                    await turns.semaphore.acquire()
            except TimeoutError:
                raise Busy(f"no turn within {wait:g} s: {self._per_peer} queries of this peer answer at once") from None
            turn.held.append(turns.semaphore)
            yield turn
        finally:
            if not turn.handed:
                turn.release()

    def _left(self, peer: str, turns: _PeerTurns) -> None:
        turns.users -= 1
        if not turns.users and self._peers.get(peer) is turns:
            del self._peers[peer]


class Turn:
    """One query's turn (`Admission.turn`): `run` answers it in a thread under the worker's share too."""

    def __init__(self, admission: Admission, peer: str, turns: _PeerTurns, wait: float) -> None:
        self._admission = admission
        self._peer = peer
        self._turns = turns
        self._wait = wait
        self.held: list[asyncio.Semaphore] = []
        self.handed = False  # the thread releases the turn when it ends

    async def run(self, function: Callable[..., bytes], *args: object) -> bytes:
        admission = self._admission
        try:
            async with asyncio.timeout(self._wait):
                await admission._worker.acquire()
        except TimeoutError:
            raise Busy(f"no turn within {self._wait:g} s: the worker answers other peers' queries") from None
        self.held.append(admission._worker)
        call = asyncio.ensure_future(admission._to_thread(function, *args))
        self.handed = True
        call.add_done_callback(self._ended)
        return await asyncio.shield(call)

    def _ended(self, call: asyncio.Future[bytes]) -> None:
        if not call.cancelled():
            call.exception()  # retrieved: the request that would raise it may be gone
        self.release()

    def release(self) -> None:
        while self.held:
            self.held.pop().release()
        self._admission._left(self._peer, self._turns)


def query_batches(level: int, nodes: list[int], bucket_rows: dict[int, int]) -> Iterator[list[int]]:
    """`nodes` of one level cut into queries, as they are asked: MAX_NODES at a time above the stored buckets; below
    them at most MAX_ROW_NODES, whose buckets hold at most SCAN_BATCH rows together by the counts seen (`bucket_rows`,
    the larger side's count of each stored bucket; a lone node's bucket may hold more: the peer answers it or
    refuses)."""
    if level < digests.STORED_LEVEL:
        for start in range(0, len(nodes), MAX_NODES):
            yield nodes[start : start + MAX_NODES]
        return
    batch: list[int] = []
    buckets: set[int] = set()
    rows = 0
    for node in nodes:
        bucket = digests.bucket_above(level, node)
        extra = 0 if bucket in buckets else min(bucket_rows.get(bucket, 0), MAX_SCAN_ROWS)
        if batch and (len(batch) == MAX_ROW_NODES or rows + extra > SCAN_BATCH):
            yield batch
            batch, buckets, rows = [], set(), 0
            extra = min(bucket_rows.get(bucket, 0), MAX_SCAN_ROWS)
        batch.append(node)
        buckets.add(bucket)
        rows += extra
    if batch:
        yield batch
