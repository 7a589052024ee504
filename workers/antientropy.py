"""Anti-entropy between two peers: compare digest trees, descend where they differ, pull what differs.

A round runs on the subscribing end of a pair, in the worker that owns the pair's session, when the coordinator
says so (`messages.AntiEntropy`, on the schedule of `coordinator.antientropy`). It asks the peer over HTTPS on the
node port, `POST /replication/antientropy`, with the same client certificate as the replication session; each
request is one msgpack `Query` and each answer one msgpack reply (`shared.antientropy_queries`, with their caps and
the serving end, which the admin port's digest-tree requests share):

    Roots(database)                          -> RootsReply: every table's root digest
    Children(database, table, level, nodes)  -> ChildrenReply: the 16 child digests of each node
    Rows(database, table, level, nodes)      -> RowsReply: (id, version, origin, tombstone, checksum) under them
    Fetch(database, table, ids)              -> FetchReply: those records, intact ones only (and the ids left)
    State(database)                          -> StateReply: what the peer holds complete and has purged, by origin

The puller compares each table's root, asks for the children of every node that differs, level by level (see
`shared.digests` for the tree), and settles a node by exchanging its rows once it holds at most `LEAF_ROWS` on
either side. For each differing row it pulls the peer's version when that one wins last-writer-wins (or when the
local row is damaged), and applies it like a replicated batch: one transaction, an audit entry, last-writer-wins.

A row one side holds and the other lacks is judged from the lacking side's `State` (invariant 20): a side that is
complete for the row's origin past its version held the row or something newer of its record; if it has purged
tombstones past it too, what it held was a deletion it has since purged. Then the row is gone for good: the
holding side removes it (a tombstone it missed the purge of, or a record whose deletion it missed, as after a
restore from an old backup or a return after tombstone_retention), and the lacking side does not pull it back.
Otherwise the lacking side pulls it in its own round. A damaged row waits for a healthy copy; it is removed only
when a peer shows it was purged. A round also takes the peer's purge as its own: each origin's tombstones are
purged here up to where the peer purged them (as far as this node holds the origin complete). So purges spread
from the nodes that can decide them to every other holder, in any topology, and the digests meet again.

Both ends verify every row they compare or serve against its checksum, so a damaged value never travels. Repairs
are paced at `replication.antientropy_rate` records per second, and the database work is cut into small steps
between network round trips, so live replication in the same worker keeps its turn.

Every query and every answer has a bounded cost, whoever sends it (issue 21). The serving end answers in a thread,
a few queries of a peer at a time (`Admission`), and refuses a query that would read or answer more than its caps
(`answer`); a Fetch answer stops at FETCH_BYTES and names the ids it `left`. The puller keeps its queries within
those caps and its round within `Limits`: a peer whose answers take it past one fails the round (`RoundLimit`),
which the coordinator counts and backs off.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec

from replicator.shared import digests, membership, messages, revocation, wire
from replicator.shared.antientropy_queries import (
    LEAF_ROWS,
    MAX_FRONTIER,
    MAX_ROUND_BYTES,
    MAX_ROUND_QUERIES,
    SYSTEM,
    Children,
    ChildrenReply,
    Fetch,
    FetchReply,
    Query,
    Roots,
    RootsReply,
    Rows,
    RowsReply,
    State,
    StateReply,
    answer,
    decode_query,
    encode,
    query_batches,
)
from replicator.shared.config import NAME_RE
from replicator.shared.hlc import MAX_VERSION
from replicator.shared.logs import log
from replicator.shared.store import BadName, BadRecord, Database
from replicator.shared.wire import Entry

FETCH_CHUNK = 128  # records per Fetch request (and per apply transaction)


class PeerError(Exception):
    """The peer could not answer (unreachable, refused, an answer that does not decode); the round ends."""


class RoundLimit(PeerError):
    """The peer's answers took the round past one of its limits (`messages.ROUND_LIMITS`); the round ends, failed."""

    def __init__(self, limit: str, message: str) -> None:
        assert limit in messages.ROUND_LIMITS, limit
        super().__init__(message)
        self.limit = limit


# -- the pulling end -------------------------------------------------------------------------------------------

_R = TypeVar("_R", bound=msgspec.Struct)
_T = TypeVar("_T")
Transport = Callable[[bytes], Awaitable[bytes]]  # one encoded query in, the peer's encoded reply out


def local_transport(db: Database) -> Transport:
    """A transport that answers from another Database in this process (tests and the benchmark)."""

    async def transport(body: bytes) -> bytes:
        return encode(answer(db, decode_query(body)))

    return transport


@dataclass(frozen=True)
class Limits:
    """What one round may take of this node, whatever the peer answers; past one, the round fails naming it."""

    frontier: int = MAX_FRONTIER  # tree nodes pending in one table
    queries: int = MAX_ROUND_QUERIES
    bytes: int = MAX_ROUND_BYTES
    seconds: float | None = None  # the round's deadline from its start (the coordinator's, `AntiEntropy.timeout`)


@dataclass
class RoundResult:
    buckets_compared: int = 0
    divergent_buckets: int = 0
    repaired: int = 0
    bytes_exchanged: int = 0
    queries: int = 0
    seconds: float = 0.0
    error: str = ""
    limit: str = ""  # the round failed on this limit (one of messages.ROUND_LIMITS)
    pending_most: int = 0  # the most tree nodes one table had pending at once
    divergent: set[tuple[str, int]] = field(default_factory=set)  # (table, bucket)
    # Registry rows the peer holds that do not verify here, or that the introduction caps refuse: (name, reason,
    # the cap or None); they are not pulled.
    refused_rows: list[tuple[str, str, str | None]] = field(default_factory=list)
    # Records the peer holds under this node's origin at versions it never wrote, and how many of them this node
    # wrote again as its own (superseding them everywhere).
    foreign: int = 0
    reasserted: int = 0


Summary = tuple[int, str, bool, int | None]  # version, origin, tombstone, checksum (None: damaged)


class Round:
    """One anti-entropy round of this node's copy of `db` against a peer reached through `ask`."""

    def __init__(
        self,
        db: Database,
        transport: Transport,
        *,
        rate: float,
        ceiling: Callable[[], int] = lambda: MAX_VERSION,
        ca: revocation.CA | None = None,
        verifier: membership.Verifier | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        blobs: Callable[[list[Entry]], Awaitable[None]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        limits: Limits = Limits(),
    ) -> None:
        """`rate`: records repaired per second at most. `ceiling()`: the highest version this node accepts now
        (its wall clock plus max_clock_skew); a peer's record above it is not pulled. `limits`: what the round may
        take; a deadline (`limits.seconds`) needs a running event loop."""
        self._db = db
        self._transport = transport
        self._rate = rate
        self._ceiling = ceiling
        self._peer_state: Holder | None = None  # asked once, when the first table differs
        self._peer_state_asked = False
        self._ca = ca  # verifies the revocations a peer serves for the system database
        self._verifier = verifier if verifier is not None else membership.Verifier(ca)  # and its registry rows
        self._sleep = sleep
        # Fetches the blobs pulled records refer to (workers.blobs.ensure); PeerError when one cannot be had.
        self._blobs = blobs
        self._clock = clock
        self._limits = limits
        self._deadline: float | None = None
        # The larger side's row count of each stored bucket of the table being compared, as the level above showed
        # it: what a query of nodes below the bucket costs the peer to answer (`_batches`).
        self._bucket_rows: dict[int, int] = {}
        self.result = RoundResult()

    async def run(self) -> RoundResult:
        started = self._clock()
        if self._limits.seconds is not None:
            self._deadline = started + self._limits.seconds
        result = self.result
        try:
            remote = await self._ask(Roots(database=self._db.name), RootsReply)
            local = self._db.roots()
            for table in sorted(set(remote.tables) | set(local)):
                result.buckets_compared += 1
                theirs = tuple(remote.tables.get(table, digests.EMPTY))
                ours = local.get(table, digests.EMPTY)
                if theirs != ours:
                    if not NAME_RE.match(table):
                        raise PeerError(f"the peer named a table {table[:70]!r}")
                    await self._table(table, theirs, ours)
        except RoundLimit as exc:
            result.error = str(exc)
            result.limit = exc.limit
        except PeerError as exc:
            result.error = str(exc)
        result.divergent_buckets = len(result.divergent)
        result.seconds = self._clock() - started
        return result

    async def _ask(self, query: Query, reply_type: type[_R]) -> _R:
        result = self.result
        most = self._limits
        if result.queries >= most.queries:
            raise RoundLimit("queries", f"the round asked the peer {result.queries} queries; at most {most.queries}")
        self._time_left()
        result.queries += 1
        body = encode(query)
        result.bytes_exchanged += len(body)
        data = await self._in_time(self._transport(body))
        result.bytes_exchanged += len(data)
        if result.bytes_exchanged > most.bytes:
            raise RoundLimit("bytes", f"the round exchanged {result.bytes_exchanged} bytes; at most {most.bytes}")
        try:
            return msgspec.msgpack.decode(data, type=reply_type)
        except msgspec.ValidationError as exc:  # msgpack, but not the answer's shape, or past its caps
            raise RoundLimit("answer", f"the peer's answer to {type(query).__name__} does not decode: {exc}") from None
        except msgspec.DecodeError as exc:
            raise PeerError(f"the peer's answer to {type(query).__name__} does not decode: {exc}") from None

    def _time_left(self) -> float | None:
        """Seconds to the round's deadline (None: it has none); past it, RoundLimit "time"."""
        if self._deadline is None:
            return None
        left = self._deadline - self._clock()
        if left <= 0:
            raise RoundLimit("time", f"the round ran past its {self._limits.seconds:g} s")
        return left

    async def _in_time(self, step: Awaitable[_T]) -> _T:
        """`step`, cut off at the round's deadline."""
        try:
            left = self._time_left()
        except RoundLimit:
            if inspect.iscoroutine(step):
                step.close()  # never started: no "never awaited" warning
            raise
        if left is None:
            return await step
        try:
            async with asyncio.timeout(left):
                return await step
        except TimeoutError:
            raise RoundLimit("time", f"the round ran past its {self._limits.seconds:g} s") from None

    def _pending(self, pending: int) -> None:
        """A table has `pending` tree nodes waiting (its next level's frontier and the nodes to settle)."""
        self.result.pending_most = max(self.result.pending_most, pending)
        if pending > self._limits.frontier:
            raise RoundLimit(
                "frontier",
                f"the peer's digests leave {pending} tree nodes of one table pending; at most {self._limits.frontier}",
            )

    def _batches(self, level: int, nodes: list[int]) -> Iterator[list[int]]:
        return query_batches(level, nodes, self._bucket_rows)

    async def _table(self, table: str, theirs: digests.Digest, ours: digests.Digest) -> None:
        leaves: dict[int, list[int]] = {}
        settling = 0  # nodes in `leaves`
        frontier = [0]
        level = 0
        self._bucket_rows = {}
        if max(theirs[0], ours[0]) <= LEAF_ROWS:
            leaves[0] = [0]
            settling = 1
            frontier = []
        while frontier:
            following: list[int] = []
            asked = 0
            for nodes in self._batches(level, frontier):
                remote = await self._ask(
                    Children(database=self._db.name, table=table, level=level, nodes=nodes), ChildrenReply
                )
                if len(remote.children) != len(nodes) or any(len(c) != digests.FANOUT for c in remote.children):
                    raise PeerError("the peer answered a different number of tree nodes than asked")
                local = self._db.children(table, level, nodes)
                for node, their_children, our_children in zip(nodes, remote.children, local, strict=True):
                    self.result.buckets_compared += digests.FANOUT
                    for index in range(digests.FANOUT):
                        theirs_child = tuple(their_children[index])
                        if theirs_child == our_children[index]:
                            continue
                        child = (node << digests.FANOUT_BITS) | index
                        rows = max(theirs_child[0], our_children[index][0])
                        if level + 1 == digests.STORED_LEVEL:
                            self._bucket_rows[child] = rows
                        if rows <= LEAF_ROWS or level + 1 == digests.MAX_LEVEL:
                            leaves.setdefault(level + 1, []).append(child)
                            settling += 1
                        else:
                            following.append(child)
                asked += len(nodes)
                self._pending(len(frontier) - asked + len(following) + settling)
                await asyncio.sleep(0)
            frontier = following
            level += 1
        for leaf_level, nodes in sorted(leaves.items()):
            for batch in self._batches(leaf_level, nodes):
                await self._settle(table, leaf_level, batch)

    async def _holder_state(self) -> Holder | None:
        """What the peer holds complete and has purged (asked once per round); None from a peer that does not
        answer `State` (an older version): then no row is judged purged, and none is removed or left unpulled."""
        if not self._peer_state_asked:
            self._peer_state_asked = True
            try:
                reply = await self._ask(State(database=self._db.name), StateReply)
            except RoundLimit:
                raise  # an answer past its caps (more than MAX_ORIGINS origins), or the round's own limits
            except PeerError as exc:
                log.debug("antientropy_state_unanswered", database=self._db.name, error=str(exc)[:200])
            else:
                self._peer_state = Holder(reply.complete, reply.purged)
                await self._adopt_purges(self._peer_state)
        return self._peer_state

    async def _adopt_purges(self, peer: Holder) -> None:
        """The peer purged each origin's tombstones up to its `purged` version, having found every holder had them:
        this node purges its own up to there too (as far as it holds the origin complete), so a purge decided where
        every holder is heard spreads to every node, and this node stops pulling back what the peer no longer has."""
        held = self._db.progress()
        ours = self._db.purged()
        levels = {
            origin: min(level, held.get(origin, 0))
            for origin, level in peer.purged.items()
            if NAME_RE.match(origin) and min(level, held.get(origin, 0)) > ours.get(origin, 0)
        }
        if levels:
            removed = self._db.purge_tombstones(levels, max(levels.values()))
            self.result.repaired += removed
            await self._pace(removed)

    async def _settle(self, table: str, level: int, nodes: list[int]) -> None:
        """Compare the rows under `nodes` and repair this side."""
        reply = await self._ask(Rows(database=self._db.name, table=table, level=level, nodes=nodes), RowsReply)
        theirs: dict[str, Summary] = {}
        for record_id, version, origin, tombstone, stored in reply.rows:
            theirs[record_id] = (version, origin, tombstone, stored)
        if len(theirs) != len(reply.rows):
            raise RoundLimit("answer", "the peer answered a row twice in one Rows answer")
        ours: dict[str, Summary] = {
            record_id: (version, origin, tombstone, stored)
            for record_id, version, origin, tombstone, stored in self._db.summaries(table, level, nodes)
        }
        peer = await self._holder_state()
        here = Holder(self._db.progress(), self._db.purged())
        # What this node has seen, by origin, for the damaged rows (`_takes`): its own origin as far as the file holds
        # its own writes, which a recovering file's complete (what peers confirmed) falls short of.
        seen = {**here.complete, self._db.node: max(here.complete.get(self._db.node, 0), self._db.own_history().held)}
        pull: list[str] = []
        gone: list[tuple[str, int, str]] = []  # rows of ours the peer shows were deleted and purged
        claims: list[tuple[str, int, str]] = []  # (id, version, kind): a peer's row under our origin to judge
        for record_id in sorted(theirs.keys() | ours.keys()):
            their_row = theirs.get(record_id)
            our_row = ours.get(record_id)
            if their_row == our_row:
                continue
            if their_row is None:
                assert our_row is not None
                # A damaged row is garbage once the peer, which held it or something newer, holds nothing of it.
                damaged_and_unheld = our_row[3] is None and peer is not None and peer.held(our_row)
                if peer is not None and (peer.purged_it(our_row) or damaged_and_unheld):
                    gone.append((record_id, our_row[0], our_row[1]))
                    self.result.divergent.add((table, digests.bucket_of(record_id)))
                continue  # otherwise the peer pulls it in its own round (a damaged one waits for a healthy copy)
            if our_row is None and here.purged_it(their_row):
                continue  # deleted here and purged: the peer removes it in its own round
            self.result.divergent.add((table, digests.bucket_of(record_id)))
            kind = self._claim(their_row, our_row)
            if kind is not None:
                claims.append((record_id, their_row[0], kind))
            elif their_row[3] is not None and self._takes(their_row, our_row, peer, seen):
                pull.append(record_id)
        forged: list[tuple[str, int]] = []
        if claims:
            proven = self._forged(table, claims)
            for record_id, version, _ in claims:
                if (record_id, version) in proven:
                    forged.append((record_id, version))
                elif _wins(theirs[record_id], ours.get(record_id)):
                    pull.append(record_id)  # ours may be an older version the file took after losing the newer
        for start in range(0, len(pull), FETCH_CHUNK):
            await self._pull(table, pull[start : start + FETCH_CHUNK])
        if forged:
            self.result.foreign += len(forged)
            written = self._db.reassert(table, forged)
            self.result.reasserted += written
            await self._pace(written)
        if gone:
            removed = self._db.drop_superseded(table, gone)
            self.result.repaired += removed
            await self._pace(removed)

    def _takes(self, theirs: Summary, ours: Summary | None, peer: Holder | None, seen: dict[str, int]) -> bool:
        """Does the peer's healthy row replace ours: ours is absent, or theirs wins last-writer-wins? A damaged row
        of ours says nothing it can be trusted for (the damage may have changed its version or origin too), so an
        older-looking copy replaces it only from a peer that has seen everything this node has (`seen`: complete,
        for every origin, at least as far; for this node's own origin as far as the file holds its own writes,
        `OwnHistory.held`, even while it recovers and counts complete only what peers confirmed): a peer lagging
        behind would otherwise put back a version older than the one this node's positions promise, a delete
        undone among them, or an own write the node made before its recovery ended (sim seed 52604 of nemesis 3).
        It waits for such a peer."""
        if ours is None or _wins(theirs, ours):
            return True
        if ours[3] is not None or peer is None:
            return False
        return all(peer.complete.get(origin, 0) >= mark for origin, mark in seen.items())

    def _forged(self, table: str, claims: list[tuple[str, int, str]]) -> set[tuple[str, int]]:
        """The claims (a peer's row under this node's origin) that this node provably never wrote, as its own
        history tells (`shared.own_writes`): an "altered" row (ours at the very version holds other content) when
        the audit log shows ours is what this node wrote at that version; a "newer" one when this node cannot have
        written that version."""
        altered = [(record_id, version) for record_id, version, kind in claims if kind == "altered"]
        newer = [(record_id, version) for record_id, version, kind in claims if kind == "newer"]
        proven = set(self._db.wrote(table, altered))
        possible = set(self._db.may_have_written(table, newer))
        proven.update(claim for claim in newer if claim not in possible)
        return proven

    async def _pull(self, table: str, ids: list[str]) -> None:
        """Fetch `ids` and apply what wins; the ids an answer leaves (past the peer's FETCH_BYTES) are asked again,
        each answer serving at least one of them."""
        while ids:
            reply = await self._ask(Fetch(database=self._db.name, table=table, ids=ids), FetchReply)
            wanted = set(ids)
            served = [entry.id for entry in reply.entries if entry.table == table and entry.id in wanted]
            if len(set(served)) != len(served):
                raise RoundLimit("answer", "the peer served a record twice in one Fetch answer")
            left = set(reply.left) & wanted - set(served)
            following = [record_id for record_id in ids if record_id in left]
            if following and len(following) >= len(ids):
                raise RoundLimit("answer", f"the peer answered a Fetch of {len(ids)} ids and served none of them")
            await self._apply(table, reply.entries, wanted)
            ids = following

    async def _apply(self, table: str, served: list[Entry], wanted: set[str]) -> None:
        ceiling = self._ceiling()
        entries = [e for e in served if e.table == table and e.id in wanted and e.version <= ceiling]
        # A value that is not msgpack, or a revocation the CA did not sign (or its removal), is refused; the rest of
        # the answer still counts.
        refused = [entry for entry in entries if self._refuse([entry]) is not None]
        if self._db.name == SYSTEM:
            self.result.refused_rows.extend((e.id, r, None) for e, r in self._verifier.refusals(refused))
            if table == membership.INTRODUCTIONS:
                # Beyond the caps a round takes no more than a stream would (`membership.IntroductionCaps`).
                capped = membership.capped(self._db, [entry for entry in entries if entry not in refused])
                self.result.refused_rows.extend((e.id, cap.reason, cap.limit) for e, cap in capped)
                left_out = {id(e) for e, _ in capped}
                entries = [entry for entry in entries if id(entry) not in left_out]
        if refused:
            log.warning(
                "antientropy_value_refused",
                database=self._db.name,
                records=len(refused),
                reason=self._refuse(refused[:1]),
                sample_by=("database",),
            )
            entries = [entry for entry in entries if entry not in refused]
        if self._blobs is not None:
            await self._in_time(self._blobs(entries))  # a record is applied only once its blob is safe here
        try:
            won = self._db.apply_batch(entries, repair=True)
        except (BadRecord, BadName) as exc:
            raise PeerError(f"the peer served a record that cannot be stored: {exc}") from None
        self.result.repaired += won
        await self._pace(won)

    def _refuse(self, entries: list[Entry]) -> str | None:
        found = wire.bad_value(entries)
        if found is None and self._db.name == SYSTEM:
            found = revocation.refusal(entries, self._ca)
            for entry, reason in self._verifier.refusals(entries):
                found = found or f"registry row {entry.id[:70]!r}: {reason}"
        return found

    def _claim(self, theirs: Summary, ours: Summary | None) -> str | None:
        """Does the peer hold, under this node's origin, a version of a record that this node may never have
        written? "altered": our own row at that very version has other content; "newer": our row is healthy and
        older; None: nothing to judge. `_forged` decides. A record this node does not hold at all proves nothing
        (its file may have lost it: anti-entropy brings it back), and neither does a damaged row on either side."""
        if theirs[1] != self._db.node or theirs[3] is None or ours is None or ours[3] is None:
            return None
        if ours[0] == theirs[0] and ours[1] == theirs[1] and ours[3] != theirs[3]:
            return "altered"
        if ours[0] < theirs[0]:
            return "newer"
        return None

    async def _pace(self, records: int) -> None:
        if records and self._rate > 0:
            await self._in_time(self._sleep(records / self._rate))


class Holder:
    """What one side of a round holds complete and has purged, by origin (`StateReply`)."""

    def __init__(self, complete: dict[str, int], purged: dict[str, int]) -> None:
        self.complete = complete
        self.purged = purged
        self._purged_most = max(purged.values(), default=0)

    def held(self, row: Summary) -> bool:
        """Is this side complete for the row's origin past its version: it held the row or something newer of its
        record?"""
        return row[0] <= self.complete.get(row[1], 0)

    def purged_it(self, row: Summary) -> bool:
        """This side lacks `row`: was it deleted here and the deletion purged? Being complete for the row's origin
        past its version, this side held the row or something newer of its record; having purged past it
        (tombstones of the row's own origin for a tombstone, of any origin for a record: the deletion that
        superseded it came later), what it held was a purged deletion."""
        version, origin, tombstone = row[0], row[1], row[2]
        if not self.held(row):
            return False
        if tombstone:
            return version <= self.purged.get(origin, 0)
        return version < self._purged_most


def _wins(theirs: Summary, ours: Summary | None) -> bool:
    """Does the peer's row beat ours last-writer-wins (version, origin, then checksum)?"""
    if ours is None:
        return True
    return (theirs[0], theirs[1], theirs[3] or 0) > (ours[0], ours[1], ours[3] or 0)
