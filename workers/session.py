"""The subscribing end of a replication session: one PeerSession per (connection key, database).

Lifecycle (`State`):

    IDLE -> DIALING -> STREAMING -> WAITING -> DIALING ...      (the link drops: reconnect on the schedule)
    any state -> CLOSED                                          (unsubscribe or worker shutdown; final)

A session is one dial attempt and what follows it; each has its own session id, which the reports carry so the
coordinator can tell a report from the monitored session from a stale one. Reconnects follow the one backoff
schedule (floor 0.5 s, 0.5 -> 30 s, full jitter or equal). It starts over after a session that made real progress (a
batch applied, or up for STAYED_UP), judged when the session has ended: one that ended because this node refused what
the peer sent (a clock or a version too far ahead, a batch it must refuse, a frame too large) never starts it over,
however far it got first: the peer sends the same again on the next session, and a batch applied before the refused
one would otherwise hold the pair at the schedule's floor, a redial every 0.5 s. A force reconnect interrupts whatever
the session is doing and schedules exactly one immediate reconnect.

The schedule paces one pair; the pairs of one peer together are held to the peer's redial budget
(`WorkerContext.redial_budget`, `shared.retry_budget`): a redial after a backoff delay takes a token, and when there
is none it is skipped, not queued: the pair waits another delay of its own schedule, still WAITING, and asks again.
A redial that connects hands its token back, so only failed dials spend the budget, and once the peer is back the
tokens its accepted dials return let the other pairs through on their own schedules (a queue of reservations would
hold the last pair pairs / rate seconds). Over a worker's link (issue 23) a redial while the link is up is a stream,
not a dial: it takes no token; and when a link to the peer comes up, every pair of that peer waiting on this worker
tries at once (`peer_back`), so a node's return brings its pairs back within a dial and one stream setup each,
instead of one backoff cap.
"""

from __future__ import annotations

import asyncio
import enum
import random
import sqlite3
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec

from replicator.shared import membership, messages, revocation, wire
from replicator.shared.backoff import Backoff
from replicator.shared.histograms import BATCH_APPLY_SECONDS
from replicator.shared.hlc import physical_seconds
from replicator.shared.logs import LOGGED_NAMES, log
from replicator.shared.retry_budget import RetryBudget
from replicator.shared.store import BadName, BadRecord, Database
from replicator.shared.tls import PeerIdentity, peer_identity
from replicator.workers import blobs, frames, link
from replicator.workers.context import SYSTEM, WorkerContext
from replicator.workers.dropped import open_for_subscription

HANDSHAKE_TIMEOUT = 15.0
DIAL_TIMEOUT = 15.0
PROGRESS_INTERVAL = 0.5
HOLDS_INTERVAL = 5.0
PROMPT_INTERVAL = 0.05  # at most this often, what the node knows others hold is relayed (wire.Holds.others)
HOLDS_RECHECK = 60.0  # an idle pair's holds check when no commit woke it (a lost ring)
STAYED_UP = 10.0  # a session up this long made progress: the reconnect schedule starts over after it
MAX_HEADS = 1024  # origins a Heads may name (as many as a subscription may)


class State(enum.Enum):
    IDLE = "idle"
    DIALING = "dialing"
    STREAMING = "streaming"
    WAITING = "waiting"
    CLOSED = "closed"


_ALLOWED = {
    State.IDLE: {State.DIALING, State.CLOSED},
    State.DIALING: {State.STREAMING, State.WAITING, State.DIALING, State.CLOSED},
    State.STREAMING: {State.WAITING, State.DIALING, State.CLOSED},
    State.WAITING: {State.DIALING, State.CLOSED},
    State.CLOSED: set(),
}


class PeerSession:
    def __init__(
        self,
        ctx: WorkerContext,
        http: aiohttp.ClientSession,
        sub: messages.Subscribe,
        new_session_id: Callable[[], int],
        rng: Callable[[], float] = random.random,
        links: link.LinkPool | None = None,
    ) -> None:
        self._ctx = ctx
        self._http = http
        self._links = links  # the worker's links (workers.link); without, every session dials a socket of its own
        self.sub = sub
        self._new_session_id = new_session_id
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._backoff = Backoff(
            initial=0.5,
            maximum=30.0,
            floor=0.5,
            jitter=ctx.config.replication.reconnect_jitter,
            rng=rng,
            clock=loop.time,
        )
        # A batch whose commit fails (a busy or full disk) is committed again on the seed's copy-cursor flush
        # schedule, in the same session: the batch and its marks commit together or not at all, so the position
        # never runs ahead of what is stored.
        self._commit_backoff = Backoff(initial=0.25, maximum=30.0, floor=0.25, jitter="full", rng=rng, clock=loop.time)
        self.state = State.IDLE
        self.session_id = 0
        self.connected = False
        self.last_error = ""
        self._own_upto = 0  # how far this session asked for our own writes back (a file that lost them)
        # The session's copy figures: what the sender had to serve when it started, and what arrived since.
        self.backlog = 0
        self.received = 0
        self.session_applied = 0
        self.received_bytes = 0
        self.attempts = 0
        self._forced = False
        self._going_away = False
        # The session in progress made real progress: a batch applied, or the subscription accepted this long ago.
        self._applied_batch = False
        self._up_since: float | None = None
        self._token: RetryBudget | None = None  # the budget the dial in progress took a token of
        self._wake = asyncio.Event()
        self._attempt: asyncio.Task[None] | None = None
        self._task: asyncio.Task[None] | None = None
        # Progress, reported to the coordinator at most every PROGRESS_INTERVAL.
        self.last_received_seq = 0
        self.peer_head_seq = 0
        self.lag_seconds = 0.0
        self.applied = 0
        self.caught_up = False
        self.peer_recovering = False  # the peer's file of the database is recovering (wire.Batch.recovering)
        self.server_identity: PeerIdentity | None = None  # the certificate the peer presented, once dialled
        # The protocol version the current session speaks (`wire.check_choice`), what a later version's code branches
        # on; 0 before a handshake chose one.
        self.protocol = 0
        # What the peer could mark for us (wire.Heads) and, of those origins, the ones where it is ahead of what
        # this node holds complete, with this node's complete for each (reported: the coordinator's stall check).
        self._peer_heads: dict[str, int] = {}
        self.ahead: dict[str, int] = {}
        # Per origin, the position this session's marks stay at or below: just under the first registry row of that
        # origin this node refused on the session (`refuse_registry_rows`).
        self._refused_below: dict[str, int] = {}
        self._dirty = False
        self._last_progress = 0.0

    @property
    def key(self) -> str:
        return self.sub.key

    @property
    def database(self) -> str:
        return self.sub.database

    @property
    def peer(self) -> str:
        return self.sub.peer

    def start(self) -> None:
        self._task = self._loop.create_task(self._run(), name=f"session {self.peer}/{self.database}")

    def _set_state(self, new: State) -> None:
        if new not in _ALLOWED[self.state]:
            raise RuntimeError(f"session {self.peer}/{self.database}: {self.state.value} -> {new.value}")
        self.state = new

    # -- commands from the coordinator -------------------------------------------------------------------

    def update(self, sub: messages.Subscribe) -> bool:
        """Take a newer subscribe for the same pair; True when it needs a new session to take effect (a new
        route resumes from the origins' complete versions, so nothing is skipped or lost by the move)."""
        reconnect = (
            sub.url != self.sub.url
            or sorted(sub.exclude) != sorted(self.sub.exclude)
            or sub.recovery != self.sub.recovery
        )
        self.sub = sub
        if reconnect:
            self.force_reconnect(None, "subscription changed")
        return reconnect

    def force_reconnect(self, session: int | None, reason: str) -> bool:
        """Tear down the current attempt (if it is `session`, when given) and dial once, now."""
        if self.state is State.CLOSED:
            return False
        if session is not None and session != self.session_id:
            return False
        if self._forced:
            return True  # one reconnect is already scheduled
        self._forced = True
        self.last_error = reason or "forced reconnect"
        if self._attempt is not None and not self._attempt.done():
            self._attempt.cancel()
        self._wake.set()
        return True

    def peer_back(self) -> None:
        """A link of this worker to the pair's peer has just come up: the peer answers again. A session waiting out a
        backoff delay (or a deferred redial) tries now: over the live link a new session is a stream opened with
        one frame, not a TLS dial, so it needs no wait and no token of the redial budget. Link-ups are dials, which
        the coordinator's ladder spaces, so this wakes each pair at most once per dial."""
        if self.state is State.WAITING:
            self._wake.set()

    def stop(self, going_away: bool = False) -> None:
        """Unsubscribe: no live session may remain, whatever the session was doing (handshake included)."""
        if self.state is State.CLOSED:
            return
        self._going_away = going_away
        self._set_state(State.CLOSED)
        if self._attempt is not None and not self._attempt.done():
            self._attempt.cancel()
        self._wake.set()

    async def wait_closed(self) -> None:
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    # -- the session loop --------------------------------------------------------------------------------

    async def _run(self) -> None:
        while self.state is not State.CLOSED:
            self.session_id = self._new_session_id()
            self._set_state(State.DIALING)
            self._applied_batch, self._up_since = False, None
            attempt = self._loop.create_task(self._attempt_once(self.session_id))
            self._attempt = attempt
            await asyncio.wait({attempt})
            self._attempt = None
            self._token = None  # a dial that failed keeps its token spent (one that connected gave it back)
            error = self._outcome(attempt)
            if self._progressed() and not refused_input(attempt):
                self._backoff.reset()
            was_connected = self.connected
            self.connected = False
            if was_connected:
                log.info(
                    "session_disconnected",
                    peer=self.peer,
                    database=self.database,
                    worker=self._ctx.worker_id,
                    session=self.session_id,
                    error=error,
                )
            if self.state is State.CLOSED:
                self._report_disconnected(error, None)
                break
            if error:
                self.last_error = error
            if self._forced:
                self._forced = False
                delay = 0.0
            else:
                next_delay = self._backoff.next_delay()
                assert next_delay is not None  # the reconnect schedule has no budget and no cap
                delay = next_delay
                self.attempts += 1
                self._ctx.counters.inc("replicator_reconnect_attempts_total", self.peer)
                log.info(
                    "reconnect_scheduled",
                    peer=self.peer,
                    database=self.database,
                    delay_s=round(delay, 4),
                    attempt=self.attempts,
                    error=error,
                )
            self._report_disconnected(error, delay)
            if delay > 0:
                self._set_state(State.WAITING)
                if not await self._pause(delay):
                    await self._take_token(error)
                if self._forced:
                    self._forced = False

    def _progressed(self) -> bool:
        """Whether the session that just ended made real progress: a batch applied, or up for STAYED_UP. A peer whose
        sessions fail right after the handshake (a full disk, a mute peer) keeps backing off."""
        if self._applied_batch:
            return True
        return self._up_since is not None and self._loop.time() - self._up_since >= STAYED_UP

    async def _pause(self, seconds: float) -> bool:
        """Wait `seconds`; True when woken first (closed, or a forced reconnect)."""
        self._wake.clear()
        try:
            async with asyncio.timeout(seconds):  # not wait_for: see workers.frames.receive
                await self._wake.wait()
        except TimeoutError:
            return False
        return True

    async def _take_token(self, error: str) -> None:
        """Take a token of the peer's redial budget for the dial due now; while the budget is spent, skip the dial
        and wait another delay of the pair's own schedule. Only a dial after a backoff delay comes here: the first
        dial and a forced reconnect take none, and neither does an attempt that a live link of this worker will
        carry (a stream, not a dial). Woken while it waits (closed, a forced reconnect, which dials without a token,
        or the peer's link up: `peer_back`), the session stops asking."""
        budget = self._ctx.redial_budget(self.peer, self._loop)
        if budget is None:
            return
        while not self._linked() and not budget.take():
            wait = self._backoff.next_delay()
            assert wait is not None  # the reconnect schedule never exhausts
            self._ctx.counters.inc("replicator_redials_deferred_total", self.peer)
            log.warning(
                "redial_deferred",
                sample_by=("peer",),
                peer=self.peer,
                database=self.database,
                wait_s=round(wait, 4),
            )
            # The coordinator counts a pair as wedged only from when it said it dials again: now later.
            self._report_disconnected(error, wait)
            if await self._pause(wait):
                return
        if not self._linked():
            self._token = budget

    def _linked(self) -> bool:
        """Whether the next attempt goes over a live link of this worker (a stream, not a dial)."""
        return self._links is not None and self._links.live(self._url())

    def _outcome(self, attempt: asyncio.Task[None]) -> str:
        if attempt.cancelled():
            return "unsubscribed" if self.state is State.CLOSED else self.last_error or "forced reconnect"
        exc = attempt.exception()
        if exc is None:
            return "session ended"
        if isinstance(exc, wire.ClockSkew):
            log.warning(
                "clock_skew_refused",
                sample_by=("peer", "database"),
                peer=self.peer,
                database=self.database,
                skew_s=round(exc.skew_s, 3),
            )
            self._ctx.counters.inc("replicator_clock_skew_refusals_total", self.peer)
            return exc.reason
        if isinstance(exc, wire.SessionError):
            return exc.reason
        if isinstance(exc, wire.MalformedFrame):
            return exc.reason
        if isinstance(exc, aiohttp.WSServerHandshakeError):
            return f"refused by the peer: HTTP {exc.status} {exc.message}"
        if isinstance(exc, aiohttp.ClientConnectorCertificateError):
            return f"TLS: {exc.certificate_error}"
        if isinstance(exc, aiohttp.ClientConnectorError):
            reason = exc.os_error.strerror or str(exc.os_error) or type(exc.os_error).__name__
            return f"cannot connect to {exc.host}:{exc.port}: {reason}"
        if isinstance(exc, aiohttp.ClientError | OSError | TimeoutError):
            return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        log.error("session_failed", peer=self.peer, database=self.database, error=repr(exc))
        return f"internal error: {exc!r}"

    def _report_disconnected(self, error: str, delay: float | None) -> None:
        self._ctx.report(
            messages.Disconnected(
                key=self.key,
                database=self.database,
                worker=self._ctx.worker_id,
                session=self.session_id,
                error=error,
                reconnect_in=delay,
                attempts=self.attempts,
            )
        )

    def _url(self) -> str:
        return self.sub.url.rstrip("/") + "/replication"

    async def _dial(self) -> Any:
        url = self._url()
        if self._links is not None:
            return await self._links.open(self.peer, self.sub.key, url)
        return await dial_socket(self._http, self._ctx, url, [wire.SUBPROTOCOL])

    async def _dial_within(self, seconds: float) -> Any:
        async with asyncio.timeout(seconds):  # not wait_for: see workers.frames.receive
            return await self._dial()

    async def _attempt_once(self, session: int) -> None:
        # The dial runs in its own task so that a cancellation arriving just as the handshake completes cannot
        # lose the socket: either the dial task is cancelled (aiohttp closes what it opened) or we get the
        # WebSocket and close it ourselves below.
        dial = self._loop.create_task(self._dial_within(DIAL_TIMEOUT))
        try:
            ws = await asyncio.shield(dial)
        except asyncio.CancelledError:
            dial.cancel()
            (outcome,) = await asyncio.gather(dial, return_exceptions=True)
            if not isinstance(outcome, BaseException):
                await frames.close(outcome, self._close_code(), "unsubscribed during the handshake")
            raise
        refused: tuple[int, str] | None = None  # the peer learns why this end refused it
        try:
            await self._stream(frames.Metered(ws, self._ctx.counters, self.peer), session)
        except wire.SessionError as exc:
            refused = exc.code, exc.reason
            raise
        except wire.MalformedFrame as exc:
            refused = exc.close_code, exc.reason
            raise
        finally:
            code, reason = refused or (self._close_code(), self.last_error or "session ended")
            await frames.close(ws, code, reason)

    def _close_code(self) -> int:
        if self.state is State.CLOSED:
            return wire.CLOSE_GOING_AWAY if self._going_away else wire.CLOSE_UNSUBSCRIBED
        return wire.CLOSE_FORCED if self._forced else wire.CLOSE_NORMAL

    async def _stream(self, ws: Any, session: int) -> None:
        ctx = self._ctx
        settings = ctx.config.replication
        # The TLS layer checked the certificate's chain and its host; the node it names, and whether it is
        # revoked, are checked here, before anything is sent.
        identity = peer_identity(ws.get_extra_info("ssl_object"))
        if identity is None or identity.name != self.peer:
            found = identity.name if identity is not None else "no node name"
            raise wire.Refused(f"the server's certificate names {found!r}, not {self.peer!r}")
        refusal = ctx.revoked(identity)
        if refusal is not None:
            raise wire.Refused(f"the server's {refusal}")
        self.server_identity = identity
        self.protocol = 0
        await frames.send(
            ws,
            wire.offer(
                node=ctx.node, capabilities=wire.CAPABILITIES, wall=ctx.wall(), max_frame=settings.max_frame_bytes
            ),
        )
        hello = await frames.expect(ws, wire.Hello, HANDSHAKE_TIMEOUT)
        if hello.node != self.peer:
            raise wire.Refused(f"dialled {self.peer!r} but the peer says it is {hello.node!r}")
        self.protocol = wire.check_choice(hello, ctx.node)
        offset = hello.wall - ctx.wall() if hello.wall else 0.0
        ctx.report_clock(self.peer, round(offset, 6))
        if offset > settings.max_clock_skew:
            raise wire.ClockSkew(
                f"the peer's clock is {offset:.1f} s ahead of ours (max_clock_skew {settings.max_clock_skew:g} s)",
                offset,
            )
        db = open_for_subscription(ctx, self.database)
        progress = db.progress()
        # Our own writes come back only from a file that lost them, and only those made before it began.
        own_upto = db.own_history().asks
        self._own_upto = own_upto
        await frames.send(
            ws,
            wire.Subscribe(database=self.database, progress=progress, exclude=self.sub.exclude, own_upto=own_upto),
            hello.max_frame,
        )
        schema = await frames.expect(ws, wire.Schema, HANDSHAKE_TIMEOUT)
        self._check_schema(db, schema, progress)
        self._peer_heads = {}
        self.ahead = {}
        self._refused_below = {}
        self.peer_head_seq = schema.head_seq
        self.backlog, self.received, self.session_applied, self.received_bytes = schema.backlog, 0, 0, 0
        self.caught_up = False
        self._streaming()
        log.info(
            "session_connected",
            peer=self.peer,
            database=self.database,
            worker=ctx.worker_id,
            session=session,
            origins=len(progress),
            exclude=self.sub.exclude[:LOGGED_NAMES],
            excluded=len(self.sub.exclude),
            protocol=self.protocol,
        )
        ctx.report(
            messages.Connected(
                key=self.key,
                database=self.database,
                worker=ctx.worker_id,
                session=session,
                peer_head_seq=schema.head_seq,
                own_upto=own_upto,
                protocol=self.protocol,
            )
        )
        self._report_progress(session, force=True)
        sending = asyncio.Lock()
        holds = None
        if "holds" in hello.capabilities:
            holds = self._loop.create_task(self._send_holds(ws, db, dict(progress), sending, hello.max_frame))
        try:
            await self._receive(ws, db, session, sending)
        finally:
            if holds is not None:
                holds.cancel()
                await asyncio.gather(holds, return_exceptions=True)

    def _check_schema(self, db: Any, schema: wire.Schema, progress: dict[str, int]) -> None:
        """What the sender's Schema says of this node's file: that the peer holds more of our own writes than the
        file accounts for (it went back in time, or lost them: `shared.own_writes`), or that the peer has purged
        deletions this node may never have received (it is behind the purge: reconcile now)."""
        ctx = self._ctx
        settings = ctx.config.replication
        ceiling = int((ctx.wall() + settings.max_clock_skew) * 1_000_000)
        if 0 < schema.yours <= ceiling and isinstance(db, Database) and db.regress(schema.yours, peer=self.peer):
            log.warning("database_regressed", peer=self.peer, database=self.database, floor=schema.yours)
            ctx.report(messages.DatabaseRegressed(name=self.database, peer=self.peer, floor=schema.yours))
        behind = sorted(
            origin
            for origin, purged in schema.purged.items()
            if origin not in self.sub.exclude and progress.get(origin, 0) < purged
        )
        if behind and isinstance(db, Database) and not db.is_empty():
            log.warning(
                "purge_behind",
                peer=self.peer,
                database=self.database,
                origins=behind[:20],
                sample_by=("peer", "database"),
            )
            ctx.report(messages.PurgeBehind(key=self.key, database=self.database, peer=self.peer, origins=behind[:20]))

    def _note_heads(self, db: Any) -> None:
        """Compare what the peer could mark for us with what this node holds complete now (`ahead`)."""
        ahead = ahead_of(self._peer_heads, db.progress()) if self._peer_heads else {}
        if ahead != self.ahead:
            self.ahead = ahead
            self._dirty = True

    def _streaming(self) -> None:
        """The peer accepted the subscription: the session is up, and the dial that got here was free."""
        self.connected = True
        self._set_state(State.STREAMING)
        self._up_since = self._loop.time()
        self.last_error = ""
        if self._token is not None:
            self._token.refund()
            self._token = None

    async def _send_holds(self, ws: Any, db: Any, sent: dict[str, int], sending: asyncio.Lock, limit: int) -> None:
        """Tell the sender what this node holds, when it changed, at most every HOLDS_INTERVAL: origins it gets over
        other links too, which the sender cannot see from its own acknowledged marks. What this node knows other
        nodes hold (`ctx.relays`, for the sender's confirmations) goes as soon as it changes, at most every
        PROMPT_INTERVAL.

        It wakes on the database's commits (workers.changes) and on what the coordinator relays, not on a timer: an
        idle pair costs nothing. Without the safety poll behind it (a lost ring would only delay a report), it looks
        by itself every HOLDS_RECHECK.
        """
        ctx = self._ctx
        feed = ctx.feeds.get(db.name)
        version: int | None = None  # the file's data_version when progress was last read
        relayed: dict[str, dict[str, int]] = {}
        due = self._loop.time() + HOLDS_INTERVAL  # the subscription said where it stood
        while True:
            progress = sent
            now = self._loop.time()
            if now < due:
                await ctx.relays.wait(db.name, due - now)
            else:
                current = db.data_version()
                # Nothing committed since: what it holds has not moved. What is relayed changing pokes the feed.
                while current == version and ctx.relays.get(db.name, self.peer) == relayed:
                    await feed.wait(HOLDS_RECHECK, polled=False)
                    current = db.data_version()
                if current != version:
                    version = current
                    self._note_heads(db)
                    progress = db.progress()
                    due = self._loop.time() + HOLDS_INTERVAL
            others = ctx.relays.get(db.name, self.peer)
            if progress != sent or others != relayed:
                async with sending:
                    await frames.send(ws, wire.Holds(progress=progress, others=others), limit)
                sent, relayed = progress, others
                await asyncio.sleep(PROMPT_INTERVAL)

    async def _receive(self, ws: Any, db: Any, session: int, sending: asyncio.Lock) -> None:
        """Read the sender's batches and apply them in order, in two tasks: reading goes on while a batch waits on
        its commit (see `_commit`) or on anything else, so the sender's pings are still answered. The sender has
        at most its window of batches unacknowledged, which bounds the queue between them."""
        queue: asyncio.Queue[wire.Batch] = asyncio.Queue()
        reader = self._loop.create_task(self._read_batches(ws, db, queue))
        applier = self._loop.create_task(self._apply_batches(ws, db, session, sending, queue))
        try:
            done, _ = await asyncio.wait({reader, applier}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            for task in (reader, applier):
                task.cancel()
            await asyncio.gather(reader, applier, return_exceptions=True)

    async def _read_batches(self, ws: Any, db: Any, queue: asyncio.Queue[wire.Batch]) -> None:
        ctx = self._ctx
        exclude = frozenset(self.sub.exclude)  # as this session subscribed (an update renews the session)
        while True:
            message = await frames.receive(ws)
            if isinstance(message, wire.Heads):
                self._take_heads(message, db)
                continue
            if not isinstance(message, wire.Batch):
                raise wire.ProtocolViolation(f"unexpected {type(message).__name__} from the sender")
            self._check_clock(message)
            message = self._without_excluded(message, exclude)
            refusal = wire.bad_value(message.entries) or self._claims_our_origin(message.entries)
            if refusal is None and self.database == SYSTEM:
                refusal = revocation.refusal(message.entries, ctx.ca)
            if refusal is not None:
                raise wire.ProtocolViolation(f"batch refused, nothing applied: {refusal}")
            queue.put_nowait(message)

    def _take_heads(self, message: wire.Heads, db: Any) -> None:
        if len(message.complete) > MAX_HEADS:
            raise wire.ProtocolViolation(f"Heads names {len(message.complete)} origins; at most {MAX_HEADS}")
        ceiling = int((self._ctx.wall() + self._ctx.config.replication.max_clock_skew) * 1_000_000)
        # A head above our clock's ceiling is a version this node would refuse: it cannot be waited for.
        self._peer_heads = {origin: head for origin, head in message.complete.items() if head <= ceiling}
        self._note_heads(db)
        self._report_progress(self.session_id)

    async def _apply_batches(
        self, ws: Any, db: Any, session: int, sending: asyncio.Lock, queue: asyncio.Queue[wire.Batch]
    ) -> None:
        ctx = self._ctx
        labels = (self.database, self.peer)
        batches = 0
        while True:
            message = await queue.get()
            entries = message.entries
            marks = message.marks
            if self.database == SYSTEM:
                entries, marks = refuse_registry_rows(ctx, self.peer, entries, marks, self._refused_below)
            # The durability watermark: the batch and its marks wait until every blob it refers to is safe here.
            await blobs.ensure(ctx, self._http, self.database, self.sub.url, self.peer, entries)
            started = self._loop.time()
            applied = await self._commit(db, entries, marks)
            if entries:  # not the empty batch that only says caught up
                ctx.counters.observe(BATCH_APPLY_SECONDS, self._loop.time() - started)
            self._applied_batch = True
            batches += 1
            async with sending:
                await frames.send(ws, wire.Ack(seq=batches))
            self.applied += applied
            self.session_applied += applied
            self.received += len(entries)
            self.received_bytes += sum(len(entry.value) + len(entry.id) for entry in entries)
            if entries:
                ctx.counters.inc("replicator_records_received_total", self.peer, value=len(entries))
            if applied:
                ctx.counters.inc("replicator_records_applied_total", *labels, value=applied)
            was = (self.caught_up, self.peer_recovering)
            self.caught_up = message.caught_up
            self.peer_recovering = message.recovering
            if message.caught_up:
                self.last_received_seq = self.peer_head_seq = message.head_seq
                self.lag_seconds = 0.0
            else:
                self.peer_head_seq = max(message.head_seq, self.last_received_seq + 1)
                if message.entries:
                    self.lag_seconds = max(0.0, ctx.wall() - physical_seconds(message.entries[-1].version))
            self._dirty = True
            if self._peer_heads and (marks or message.caught_up):
                self._note_heads(db)
            # Reaching or leaving the caught-up state is reported at once: routing and recovery wait on it.
            self._report_progress(session, force=(message.caught_up, message.recovering) != was)

    async def _commit(self, db: Any, entries: list[wire.Entry], marks: dict[str, int]) -> int:
        """Apply one batch and its marks in one transaction; when the store cannot commit (busy past its timeout,
        a full disk, an I/O error), try the same batch again on the flush schedule, 0.25 s doubling to 30 s,
        reset by a commit. A batch the store refuses as malformed ends the session instead."""
        while True:
            try:
                applied = db.apply_batch(entries, marks, peer=self.peer)
            except (BadRecord, BadName) as exc:
                raise wire.ProtocolViolation(f"batch refused, nothing applied: {exc}") from None
            except (sqlite3.OperationalError, OSError) as exc:
                delay = self._commit_backoff.next_delay()
                assert delay is not None  # the flush schedule never runs out
                self._ctx.counters.inc("replicator_commit_retries_total", self.database)
                log.warning(
                    "commit_retry",
                    peer=self.peer,
                    database=self.database,
                    delay_s=round(delay, 4),
                    error=str(exc)[:200],
                    sample_by=("database",),
                )
                await asyncio.sleep(delay)
                continue
            self._commit_backoff.reset()
            return applied

    def _claims_our_origin(self, entries: list[wire.Entry]) -> str | None:
        """A sender serves this node's own writes back only to a file that lost them, up to where the subscription
        asked (`own_upto`): any other record under our origin is one this node never wrote."""
        for entry in entries:
            if entry.origin == self._ctx.node and entry.version > self._own_upto:
                self._ctx.counters.inc("replicator_foreign_origin_refusals_total", self.peer, self.database)
                log.warning(
                    "foreign_origin_refused",
                    peer=self.peer,
                    database=self.database,
                    records=1,
                    reasserted=0,
                    reason="the sender served a record under this node's origin that it never wrote",
                    sample_by=("peer", "database"),
                )
                return (
                    f"record {entry.table}/{entry.id[:70]} claims this node's origin at version {entry.version},"
                    " which it never wrote"
                )
        return None

    def _without_excluded(self, batch: wire.Batch, exclude: frozenset[str]) -> wire.Batch:
        """The batch without what it carries of origins this subscription excluded: this node receives those over
        their own links, and a position for one taken from another sender could pass writes that link has not
        delivered yet. A sender that follows the protocol serves none of them."""
        if not exclude or not (
            any(entry.origin in exclude for entry in batch.entries) or any(origin in exclude for origin in batch.marks)
        ):
            return batch
        log.warning(
            "excluded_origin_ignored",
            peer=self.peer,
            database=self.database,
            origins=sorted(
                {entry.origin for entry in batch.entries if entry.origin in exclude} | (exclude & batch.marks.keys())
            ),
            sample_by=("peer", "database"),
        )
        return msgspec.structs.replace(
            batch,
            entries=[entry for entry in batch.entries if entry.origin not in exclude],
            marks={origin: mark for origin, mark in batch.marks.items() if origin not in exclude},
        )

    def _check_clock(self, batch: wire.Batch) -> None:
        """Refuse versions further ahead of our wall clock than max_clock_skew: they would drag our clock (and,
        relayed, every node's) into the future."""
        ceiling = int((self._ctx.wall() + self._ctx.config.replication.max_clock_skew) * 1_000_000)
        top = max((entry.version for entry in batch.entries), default=0)
        top = max(top, max(batch.marks.values(), default=0))
        if top > ceiling:
            skew = physical_seconds(top) - self._ctx.wall()
            raise wire.ClockSkew(
                f"version {top} is {skew:.1f} s ahead of our clock"
                f" (max_clock_skew {self._ctx.config.replication.max_clock_skew:g} s)",
                skew,
            )

    def _report_progress(self, session: int, force: bool = False) -> None:
        now = self._loop.time()
        if not force and (not self._dirty or now - self._last_progress < PROGRESS_INTERVAL):
            return
        self.flush_progress(session)

    def flush_progress(self, session: int | None = None) -> None:
        """Send this session's progress now (the worker calls it periodically so idle sessions stay fresh)."""
        self._dirty = False
        self._last_progress = self._loop.time()
        self._ctx.report(
            messages.Progress(
                key=self.key,
                database=self.database,
                worker=self._ctx.worker_id,
                session=self.session_id if session is None else session,
                last_received_seq=self.last_received_seq,
                peer_head_seq=self.peer_head_seq,
                lag_seconds=round(self.lag_seconds, 6),
                applied=self.applied,
                caught_up=self.caught_up,
                peer_recovering=self.peer_recovering,
                backlog=self.backlog,
                received=self.received,
                session_applied=self.session_applied,
                received_bytes=self.received_bytes,
                ahead=dict(self.ahead),
            )
        )

    @property
    def dirty(self) -> bool:
        return self._dirty


def refused_input(attempt: asyncio.Task[None]) -> bool:
    """Whether the session ended because this node refused what the peer sent: its clock or a version too far ahead
    (`wire.ClockSkew`), a frame or a batch the protocol does not allow, a blob sent slower than
    `replication.blob_min_rate` or past its deadline (`blobs.TransferAborted`). The next session would be sent the
    same, so it comes on the growing schedule, not at its floor."""
    if attempt.cancelled():
        return False
    return isinstance(
        attempt.exception(), wire.Refused | wire.ProtocolViolation | wire.MalformedFrame | blobs.TransferAborted
    )


def ahead_of(heads: dict[str, int], progress: dict[str, int]) -> dict[str, int]:
    """The origins a peer could mark beyond what this node holds complete (its `wire.Heads` against `progress`),
    with this node's position for each: what the coordinator's stall check watches (invariant 21)."""
    return {origin: progress.get(origin, 0) for origin, head in heads.items() if head > progress.get(origin, 0)}


def note_refused_row(ctx: WorkerContext, peer: str, name: str, reason: str, limit: str | None) -> None:
    """Count and log a registry row refused from `peer`, by a session or an anti-entropy round; `limit` names the
    introduction cap it is past, None for a row that does not verify. Sampled per peer (and cap): the names are the
    peer's to choose, thousands of them each its own."""
    ctx.counters.inc("replicator_registry_rows_refused_total", peer)
    if limit is None:
        log.warning("registry_row_refused", peer=peer, name=name[:70], reason=reason, sample_by=("peer",))
    else:
        log.warning(
            "registry_row_refused", peer=peer, name=name[:70], reason=reason, limit=limit, sample_by=("peer", "limit")
        )


def refuse_registry_rows(
    ctx: WorkerContext,
    peer: str,
    entries: list[wire.Entry],
    marks: dict[str, int],
    refused_below: dict[str, int],
) -> tuple[list[wire.Entry], dict[str, int]]:
    """The entries of a system-database batch without the registry rows that do not verify, or that the
    introduction caps refuse (`membership.capped`; each logged as `registry_row_refused`), and the batch's marks
    held below each refused row: this node does not hold it, so its position for that origin must not pass it
    (invariant 13). `refused_below` is the session's: once a row of an origin is refused, no later batch of the
    session moves that origin's position past it either (the sender, which does not know, marks on); the next
    session is served from below it again, when the row may verify (a CA bundle here that gains the signer's CA, as
    during a rotation) or fit (an introduction removed since). Skipped, not the whole batch: the rest of the stream
    must go on. The log is sampled per peer, and per cap: a peer that sends thousands of rows, each with a name of
    its own, writes a few lines and a suppressed count."""
    refused = [(entry, reason, None) for entry, reason in ctx.verifier.refusals(entries)]
    if any(entry.table == membership.INTRODUCTIONS for entry in entries):
        bad = {id(entry) for entry, _, _ in refused}
        verified = [entry for entry in entries if id(entry) not in bad]
        system = ctx.store.database(SYSTEM)
        refused += [(entry, cap.reason, cap.limit) for entry, cap in membership.capped(system, verified)]
    for entry, reason, limit in refused:
        note_refused_row(ctx, peer, entry.id, reason, limit)
        refused_below[entry.origin] = min(refused_below.get(entry.origin, entry.version), entry.version - 1)
    if not refused_below:
        return entries, marks
    held = {origin: min(mark, refused_below.get(origin, mark)) for origin, mark in marks.items()}
    dropped = {id(entry) for entry, _, _ in refused}
    return [entry for entry in entries if id(entry) not in dropped], held


async def dial_socket(http: aiohttp.ClientSession, ctx: WorkerContext, url: str, protocols: list[str]) -> Any:
    """A replication WebSocket to `url` offering `protocols`, the most wanted first. Offering a link, its messages
    may be a link frame's header larger than the frame limit (`workers.link.receive_limit`)."""
    limit = ctx.config.replication.max_frame_bytes
    ws = await http.ws_connect(
        url,
        protocols=protocols,
        ssl=ctx.client_ssl,
        max_msg_size=link.receive_limit(limit) if link.SUBPROTOCOL in protocols else frames.receive_limit(limit),
        heartbeat=frames.SUBSCRIBER_HEARTBEAT,  # a frozen peer misses its pong: the session ends within 11 s
        timeout=aiohttp.ClientWSTimeout(ws_close=5.0),
    )
    if isinstance(ws, frames.SubscriberSocket):  # the worker's session makes them (workers.main)
        ws.frame_limit = limit
    return ws
