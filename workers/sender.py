"""The sending end of a replication session (inbound connection, authenticated peer).

After the handshake the sender answers `Schema`, then serves every origin the subscriber did not exclude from the
records table, in version order per origin, starting where the subscription says the subscriber is complete, and
tails new commits the same way. Each batch carries marks (see `shared.wire.Batch`): an origin's mark rises to
what this node holds complete of it once everything held above the subscriber's position has been sent. At most
`replication.window` batches are in flight unacknowledged, and every send awaits the socket's drain, so a slow
receiver slows the sender instead of making it buffer. No frame is larger than the smaller of the two ends' frame
limits (`frames.send` refuses one that would be); a batch's entries fill at most half of it (`_chunks`, counting each
entry's encoded size, `wire.entry_size`), which leaves the other half to its marks and fields.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from typing import Any

from replicator.shared import messages, wire
from replicator.shared.config import NAME_RE
from replicator.shared.hlc import MAX_VERSION
from replicator.shared.logs import log
from replicator.shared.store import Database, UnknownDatabase
from replicator.workers import frames
from replicator.workers.context import WorkerContext

HANDSHAKE_TIMEOUT = 15.0
MAX_ORIGINS = 1024
# At most this often, what the subscriber holds is reported to the coordinator: a write waiting for confirmations
# (coordinator.confirmations) hears of them within it. The pair's state for /status goes at most every
# HOLDS_INTERVAL.
PROMPT_INTERVAL = 0.05
HOLDS_INTERVAL = 5.0
MAX_RELAYED_NODES = 256  # nodes a Holds may say something of (`others`)
MAX_RELAYED = 65_536  # positions a Holds may relay, all nodes together
HEADS_INTERVAL = 5.0  # at most this often, the subscriber is told what this end could serve it (wire.Heads)
HEADS_RECHECK = 60.0  # an idle session's heads check when no commit woke it (a lost ring)
BACKLOG_COUNT_CAP = 5_000_000  # a session's backlog is counted up to this many records (an index range count)
_session_numbers = itertools.count(1)


class Sender:
    def __init__(self, ctx: WorkerContext, ws: Any, peer: str) -> None:
        self._ctx = ctx
        self._ws = frames.Metered(ws, ctx.counters, peer)
        self._peer = peer
        self._settings = ctx.config.replication
        # The largest frame this end sends: the smaller of its own limit and the one the subscriber's Hello says.
        self._send_limit = self._settings.max_frame_bytes
        self._frame_budget = self._send_limit // 2  # what a batch's entries may fill of a frame
        self._sent = 0
        self._acked = 0
        self._room = asyncio.Event()
        self._gone: wire.SessionError | None = None
        self._database = ""
        # What the subscriber holds complete, by origin: its resume points, raised by the marks of each batch
        # once it is acknowledged. `_unacked`: (batch number, marks) of batches sent with marks.
        self._holds: dict[str, int] = {}
        self._unacked: deque[tuple[int, dict[str, int]]] = deque()
        self._others: dict[str, dict[str, int]] = {}  # what the subscriber's node says other nodes hold
        self._holds_reported = float("-inf")  # on the loop's clock
        self._state_reported = float("-inf")
        self._state_due: asyncio.TimerHandle | None = None
        self._holds_dirty = False
        self._holds_due: asyncio.TimerHandle | None = None  # the deferred report of holds acknowledged meanwhile
        self._sending = asyncio.Lock()  # batches and heads go out whole, one at a time
        self._plan: OriginPlan | None = None
        self.session = next(_session_numbers)
        self._records_sent = 0
        self._caught_up = False
        self._exclude: list[str] = []
        self.protocol = 0  # the version the session speaks, once the handshake chose it (`wire.choose_protocol`)

    @property
    def database(self) -> str:
        return self._database

    async def run(self) -> None:
        """Serve one session until it ends; raises the SessionError that ended it."""
        hello = await frames.expect(self._ws, wire.Hello, HANDSHAKE_TIMEOUT)
        if hello.node != self._peer:
            raise wire.Refused(f"Hello names {hello.node!r} but the certificate names {self._peer!r}")
        self.protocol = wire.choose_protocol(hello, self._ctx.node)
        if hello.wall:
            # Both ends see the offset before any data moves; only the subscriber refuses (it is the one applying).
            offset = round(hello.wall - self._ctx.wall(), 6)
            self._ctx.report_clock(self._peer, offset)
        if hello.max_frame:
            # Never build a frame the subscriber would refuse.
            self._send_limit = min(self._send_limit, hello.max_frame)
            self._frame_budget = self._send_limit // 2
        await frames.send(
            self._ws,
            wire.answer(
                self.protocol,
                node=self._ctx.node,
                capabilities=wire.CAPABILITIES,
                wall=self._ctx.wall(),
                max_frame=self._settings.max_frame_bytes,
            ),
            self._send_limit,
        )
        sub = await frames.expect(self._ws, wire.Subscribe, HANDSHAKE_TIMEOUT)
        db = self._open(sub)
        self._check_regression(db, sub.progress.get(self._ctx.node, 0))
        exclude = frozenset(sub.exclude)
        limits = {self._peer: sub.own_upto}
        backlog = OriginPlan.backlog(db, sub.progress, exclude, limits)
        origins = db.origins()
        purged = {origin: scanned for origin, scanned in db.purged().items() if origin not in exclude}
        await frames.send(
            self._ws,
            wire.Schema(
                database=db.name,
                epoch=db.epoch,
                head_seq=db.last_seq(),
                backlog=backlog,
                yours=origins[self._peer].complete if self._peer in origins else 0,
                purged=purged,
            ),
            self._send_limit,
        )
        self._holds = {origin: version for origin, version in sub.progress.items() if version > 0}
        self._exclude = sorted(exclude)
        self._plan = OriginPlan(dict(sub.progress), exclude, limits)
        self._report_holds(force=True)
        loop = asyncio.get_running_loop()
        reader = loop.create_task(self._read_acks(db))
        heads = loop.create_task(self._send_heads(db, self._plan)) if "heads" in hello.capabilities else None
        error = "session ended"
        try:
            await self._serve(db, self._plan)
        except BaseException as exc:
            error = getattr(exc, "reason", "") or type(exc).__name__
            raise
        finally:
            for task in (reader, heads):
                if task is not None:
                    task.cancel()
            try:
                await asyncio.gather(*(task for task in (reader, heads) if task is not None), return_exceptions=True)
            finally:
                # After the reader: its last acks may have armed the report; they go now.
                if self._holds_due is not None:
                    self._holds_due.cancel()
                    self._holds_due = None
                if self._holds_dirty:
                    self._report_holds(force=True)
                self._report_state(connected=False, error=error)

    def _open(self, sub: wire.Subscribe) -> Database:
        if not NAME_RE.match(sub.database):
            raise wire.ProtocolViolation(f"bad database name {sub.database[:70]!r}")
        if not self._ctx.replicates(sub.database):
            raise wire.Refused(f"database {sub.database!r} is not replicated by {self._ctx.node}")
        if len(sub.exclude) > MAX_ORIGINS or len(sub.progress) > MAX_ORIGINS:
            raise wire.ProtocolViolation(
                f"subscription names {len(sub.exclude)} excluded and {len(sub.progress)} resumed origins;"
                f" at most {MAX_ORIGINS} each"
            )
        if not 0 <= sub.own_upto <= MAX_VERSION:
            raise wire.ProtocolViolation(f"bad own_upto {sub.own_upto}")
        for origin, version in sub.progress.items():
            if not NAME_RE.match(origin) or not 0 <= version <= MAX_VERSION:
                raise wire.ProtocolViolation(f"bad resume point {origin[:70]!r}: {version}")
        self._database = sub.database
        try:
            # Only a database this node holds is served: a subscription never creates one here.
            return self._ctx.database(sub.database)
        except UnknownDatabase:
            raise wire.Refused(f"database {sub.database!r} is not held by {self._ctx.node}") from None

    def _check_regression(self, db: Database, claimed: int) -> None:
        """The subscriber holds our own writes up to `claimed`; above our clock, our file went back in time."""
        if claimed <= 0:
            return
        ceiling = int((self._ctx.wall() + self._settings.max_clock_skew) * 1_000_000)
        if claimed > ceiling:
            return  # no peer can hold a write of ours from the future: a lie, or its clock, not our file
        if db.regress(claimed, peer=self._peer):
            log.warning("database_regressed", peer=self._peer, database=db.name, floor=claimed)
            self._ctx.report(messages.DatabaseRegressed(name=db.name, peer=self._peer, floor=claimed))

    async def _read_acks(self, db: Database) -> None:
        try:
            while True:
                message = await frames.receive(self._ws)
                if isinstance(message, wire.Holds):
                    self._take_holds(message.progress, message.others)
                    continue
                if not isinstance(message, wire.Ack):
                    raise wire.ProtocolViolation(f"expected Ack, got {type(message).__name__}")
                if message.seq != self._acked + 1 or message.seq > self._sent:
                    raise wire.ProtocolViolation(
                        f"Ack {message.seq} after {self._acked} of {self._sent} batches sent: acks count up by one"
                    )
                self._acked += 1
                self._room.set()
                self._confirm(self._acked)
        except wire.SessionError as exc:
            self._gone = exc
        except wire.MalformedFrame as exc:
            self._gone = wire.ProtocolViolation(exc.reason, exc.close_code)
        self._room.set()
        self._ctx.feeds.poke(db.name)

    def _take_holds(self, progress: dict[str, int], others: dict[str, dict[str, int]]) -> None:
        """The subscriber says what it holds, every origin included, and what its node knows of others (see
        `wire.Holds`)."""
        _check_positions("Holds", progress)
        if len(others) > MAX_RELAYED_NODES or sum(len(held) for held in others.values()) > MAX_RELAYED:
            raise wire.ProtocolViolation(
                f"Holds relays {len(others)} nodes; at most {MAX_RELAYED_NODES} nodes and {MAX_RELAYED} positions"
            )
        for node, held in others.items():
            if not NAME_RE.match(node):
                raise wire.ProtocolViolation(f"bad Holds node {node[:70]!r}")
            _check_positions("Holds", held)
        for origin, version in progress.items():
            if version > self._holds.get(origin, 0):
                self._holds[origin] = version
                self._holds_dirty = True
        for node, held in others.items():
            if node == self._peer or node == self._ctx.node:
                continue  # the subscriber itself says so directly; this node knows its own
            mine = self._others.setdefault(node, {})
            for origin, version in held.items():
                if version > mine.get(origin, 0):
                    mine[origin] = version
                    self._holds_dirty = True
        self._report_holds()

    def _confirm(self, acked: int) -> None:
        """Batches up to `acked` arrived: their marks are held by the subscriber now."""
        while self._unacked and self._unacked[0][0] <= acked:
            _, marks = self._unacked.popleft()
            for origin, mark in marks.items():
                if mark > self._holds.get(origin, 0):
                    self._holds[origin] = mark
                    self._holds_dirty = True
        self._report_holds()

    def _report_holds(self, force: bool = False) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        if not (force or self._holds_dirty):
            return
        left = self._holds_reported + PROMPT_INTERVAL - now
        if not force and left > 0:
            # Reported less than PROMPT_INTERVAL ago: report once it is over, on a timer of the session's own, so an
            # idle session needs no periodic wake-up to get its last acknowledged marks reported.
            if self._holds_due is None:
                self._holds_due = loop.call_later(left, self._report_due_holds)
            return
        if self._holds_due is not None:
            self._holds_due.cancel()
            self._holds_due = None
        self._holds_dirty = False
        self._holds_reported = now
        others = {node: dict(held) for node, held in self._others.items()}
        self._ctx.report(
            messages.PeerHolds(peer=self._peer, database=self._database, complete=dict(self._holds), others=others)
        )
        if force or now - self._state_reported >= HOLDS_INTERVAL:
            self._report_state()
        elif self._state_due is None:
            # Reported less than HOLDS_INTERVAL ago: once it is over, so /status shows the last acknowledged batch.
            self._state_due = loop.call_later(self._state_reported + HOLDS_INTERVAL - now, self._report_due_state)

    def _report_state(self, connected: bool = True, error: str = "") -> None:
        """What this end of the pair is doing, for `/status` (messages.Sending)."""
        self._state_reported = asyncio.get_running_loop().time()
        if self._state_due is not None:
            self._state_due.cancel()
            self._state_due = None
        plan = self._plan
        self._ctx.report(
            messages.Sending(
                peer=self._peer,
                database=self._database,
                worker=self._ctx.worker_id,
                session=self.session,
                connected=connected,
                batches_sent=self._sent,
                batches_acked=self._acked,
                records_sent=self._records_sent,
                caught_up=self._caught_up,
                blocked=dict(plan.blocked) if plan is not None else {},
                exclude=self._exclude,
                protocol=self.protocol,
                error=error[:200],
            )
        )

    def _report_due_holds(self) -> None:
        self._holds_due = None
        self._report_holds()

    def _report_due_state(self) -> None:
        self._state_due = None
        self._report_state()

    async def _send_batch(self, message: wire.Message) -> None:
        while self._sent - self._acked >= self._settings.window:
            self._check_gone()
            self._room.clear()
            await self._room.wait()
        self._check_gone()
        async with self._sending:
            await frames.send(self._ws, message, self._send_limit)
        self._sent += 1
        if isinstance(message, wire.Batch) and message.marks:
            self._unacked.append((self._sent, dict(message.marks)))

    def _check_gone(self) -> None:
        if self._gone is not None:
            raise self._gone

    def _chunks(self, entries: list[wire.Entry]) -> list[list[wire.Entry]]:
        """Split a batch so that the entries of a frame take at most half the frame limit."""
        chunks: list[list[wire.Entry]] = [[]]
        size = 0
        for entry in entries:
            cost = wire.entry_size(entry)
            if cost > self._frame_budget:
                # It fits in no frame the subscriber accepts: say so, rather than send a batch it must refuse.
                raise wire.Refused(
                    f"record {entry.table}/{entry.id[:100]} ({cost} bytes) does not fit the subscriber's frame limit"
                    f" ({self._send_limit} bytes): raise its replication.max_frame_bytes",
                    wire.CLOSE_TOO_BIG,
                )
            if chunks[-1] and size + cost > self._frame_budget:
                chunks.append([])
                size = 0
            chunks[-1].append(entry)
            size += cost
        return chunks

    async def _send_heads(self, db: Database, plan: OriginPlan) -> None:
        """Tell the subscriber what this end could mark for it now, whenever that changed, at most every
        HEADS_INTERVAL (wire.Heads). It runs beside the stream on purpose: whatever holds the stream up, the
        subscriber still sees that this end is ahead of it. It wakes on the database's commits, and by itself every
        HEADS_RECHECK (a lost ring), so an idle session costs one check a minute."""
        feed = self._ctx.feeds.get(db.name)
        sent: dict[str, int] | None = None
        while True:
            version = db.data_version()
            heads = plan.heads(db)
            if heads != sent:
                async with self._sending:
                    await frames.send(self._ws, wire.Heads(complete=heads), self._send_limit)
                sent = heads
            await asyncio.sleep(HEADS_INTERVAL)
            if db.data_version() == version:
                await feed.wait(HEADS_RECHECK, polled=False)

    async def _serve(self, db: Database, plan: OriginPlan) -> None:
        """Stream every origin not excluded, from the subscriber's marks on, until the session ends."""
        feed = self._ctx.feeds.get(db.name)
        told_caught_up = False
        told_recovering = False
        while True:
            self._check_gone()
            read_at = db.data_version()
            recovering = db.recovering
            entries, new_marks, more = plan.next_batch(db, self._settings.batch_size)
            if not entries and not new_marks:
                # Caught up, said again when this end's file stops recovering: the subscriber's recovery counts a
                # peer only once it is whole (`coordinator.recovery`).
                if (not told_caught_up or told_recovering != recovering) and not plan.blocked:
                    await self._send_batch(
                        wire.Batch(entries=[], head_seq=db.last_seq(), caught_up=True, recovering=recovering)
                    )
                    told_caught_up = True
                    told_recovering = recovering
                    if not self._caught_up:
                        self._caught_up = True
                        self._report_state()
                # Woken by the next commit (workers.changes), and by nothing else: an idle session costs nothing.
                # A commit made while the caught-up batch was being sent woke the feed before this wait began, so
                # it is read first.
                if db.data_version() == read_at:
                    await feed.wait()
                continue
            head = db.last_seq()
            chunks = self._chunks(entries)
            for index, chunk in enumerate(chunks):
                last = index == len(chunks) - 1
                # Only the last chunk raises the marks: a subscriber that stops between chunks is served the
                # batch again from its previous marks.
                await self._send_batch(
                    wire.Batch(
                        entries=chunk,
                        marks=new_marks if last else {},
                        head_seq=head,
                        caught_up=last and not more and not plan.blocked,
                        recovering=recovering,
                    )
                )
            told_caught_up = not more and not plan.blocked
            told_recovering = recovering
            if entries:
                self._records_sent += len(entries)
                self._ctx.counters.inc("replicator_records_sent_total", db.name, self._peer, value=len(entries))
            if told_caught_up != self._caught_up:
                self._caught_up = told_caught_up
                self._report_state()


def _check_positions(what: str, positions: dict[str, int]) -> None:
    """A peer's positions by origin: at most MAX_ORIGINS, each a name and a version, or the session ends."""
    if len(positions) > MAX_ORIGINS:
        raise wire.ProtocolViolation(f"{what} names {len(positions)} origins; at most {MAX_ORIGINS}")
    for origin, version in positions.items():
        if not NAME_RE.match(origin) or not 0 <= version <= MAX_VERSION:
            raise wire.ProtocolViolation(f"bad {what} entry {origin[:70]!r}: {version}")


class OriginPlan:
    """Which records of which origin go next on one session, and the marks they earn.

    `marks[o]`: the subscriber holds every version of origin o up to it (its resume point, then what this
    session has served). `positions[o]`: the last version of o sent. An origin's mark rises to this node's
    complete version of it once nothing held above the position remains unsent; while a batch is cut short by
    the size limit, the mark rises only to the last version sent. Records above what this node holds complete
    (a recovering origin's newest writes) are served as they come but earn no mark; if the complete version
    later rises past the mark, the origin is served again from the mark, so a version that arrived here late,
    below one already sent, is not skipped. `limits[o]` caps what is served of o (the subscriber's own origin:
    it holds everything it wrote since its file began); a limit of 0 serves nothing of o.
    """

    def __init__(self, marks: dict[str, int], exclude: frozenset[str], limits: dict[str, int] | None = None) -> None:
        self.marks = marks
        self.positions = dict(marks)
        self.exclude = exclude
        self.limits = limits or {}
        # The damaged record an origin's stream waits at (this node holds it, but not intact), by origin. The
        # marks stay below it until anti-entropy replaces it.
        self.blocked: dict[str, str] = {}

    @staticmethod
    def backlog(db: Database, marks: dict[str, int], exclude: frozenset[str], limits: dict[str, int]) -> int:
        """How many records a session from `marks` serves before it is caught up (what this node holds now)."""
        total = 0
        for origin, held in db.origins().items():
            cap = limits.get(origin)
            if origin in exclude or cap == 0:
                continue
            top = held.top if cap is None else min(held.top, cap)
            if top > marks.get(origin, 0):
                total += db.count_origin(origin, marks.get(origin, 0), top, cap=BACKLOG_COUNT_CAP - total)
            if total >= BACKLOG_COUNT_CAP:
                break
        return total

    def heads(self, db: Database) -> dict[str, int]:
        """Per origin this session serves, the mark the subscriber could be given now: what this node holds complete
        of it, within the limits. Origins whose stream waits at a damaged record are left out (wire.Heads)."""
        heads: dict[str, int] = {}
        for origin, held in db.origins().items():
            if origin in self.exclude or origin in self.blocked:
                continue
            cap = self.limits.get(origin)
            complete = held.complete if cap is None else min(held.complete, cap)
            if complete > 0:
                heads[origin] = complete
        return heads

    def next_batch(self, db: Database, limit: int) -> tuple[list[wire.Entry], dict[str, int], bool]:
        """(entries, raised marks, more pending) for the next batch of at most `limit` entries."""
        entries: list[wire.Entry] = []
        raised: dict[str, int] = {}
        more = False
        for origin, held in sorted(db.origins().items()):
            if origin in self.exclude:
                continue
            cap = self.limits.get(origin)
            if cap == 0:
                continue
            complete = held.complete if cap is None else min(held.complete, cap)
            top = held.top if cap is None else min(held.top, cap)
            mark = self.marks.get(origin, 0)
            position = self.positions.get(origin, mark)
            if complete > mark and position > mark:
                position = mark
            cut_short = False
            self.blocked.pop(origin, None)
            if top > position:
                room = limit - len(entries)
                if room <= 0:
                    more = True
                    continue
                got, damaged = db.serve_origin(origin, position, room, upto=cap)
                entries.extend(got)
                if got:
                    position = got[-1].version
                cut_short = len(got) == room or damaged is not None
                if damaged is not None:
                    self.blocked[origin] = f"{damaged.table}/{damaged.id}"
            self.positions[origin] = position
            reach = min(position, complete) if cut_short else complete
            more = more or (cut_short and origin not in self.blocked)
            if reach > mark:
                self.marks[origin] = raised[origin] = reach
        return entries, raised, more
