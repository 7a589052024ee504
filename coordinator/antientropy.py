"""The coordinator's side of anti-entropy: when each pair compares digests with its peer, and the scrub of the
node's own files.

    rounds  one schedule per (peer, database) pair of the replication map. When its timer fires and the pair is
            connected, `messages.AntiEntropy` goes to the worker whose session carries the pair (that worker runs
            the round, see `workers.antientropy`), and the answer, `messages.AntiEntropyDone` with the same round
            number, is recorded, counted and logged. A round that does not answer within `round_timeout` counts
            as failed; a late answer is then stale and ignored. Either way the next round is drawn. A round that
            failed on one of its limits (`AntiEntropyDone.limit`: a peer whose answers went past them) puts the
            pair on a penalty schedule, a delay doubling up to MAX_PENALTY_INTERVALS, until a round ends well.
    scrub   per held database, a pass over every row on the coordinator's own store connection: checksums and
            buckets (`Database.scrub`, in chunks paced at `replication.scrub_rate`), then the bucket digests
            recounted (`Database.check_digests`). Passes run one at a time, so the rate bounds the node's total.

Every delay is a draw in [interval/2, interval) (`replication.antientropy_interval`, equal jitter): pairs and
databases that started together, at boot or after a reload, spread over half an interval instead of all comparing
at once, and none waits longer than the interval. The schedules live here, not on the replication map's entry,
for the same reason as the setup scheduler's: the stale-worker and scaling paths recreate entries, and a round in
flight must survive that. The node tells this object when a pair is wanted (`track`) and dropped (`forget`).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from replicator.coordinator.view import AntiEntropyView
from replicator.shared import messages
from replicator.shared.backoff import Backoff
from replicator.shared.logs import log

MIN_ROUND_TIMEOUT = 60.0
# A worker ends its round (failed, limit "time") at this share of the round timeout, so that its answer arrives
# while the round is still waited for.
ROUND_BUDGET = 0.9
# A round that failed on one of its limits (a peer whose answers went past them) is not tried again soon: the
# pair's next round comes after a doubling delay, at most this many intervals, and no run_soon starts one meanwhile.
MAX_PENALTY_INTERVALS = 8.0
SCRUB_CHUNK = 1000  # rows per Database.scrub call; the pace between chunks is SCRUB_CHUNK / scrub_rate
FIRST_SCRUB_DELAY = 1.0  # after the node is ready: a damaged file is found at boot, not an interval later

ToThread = Callable[..., Awaitable[Any]]


@dataclass(frozen=True)
class RoundReport:
    """How one round of a pair ended (or did not start)."""

    peer: str
    database: str
    at: float  # wall clock, when the answer (or the timeout) came
    seconds: float = 0.0
    buckets_compared: int = 0
    divergent_buckets: int = 0
    repaired: int = 0
    bytes: int = 0
    error: str = ""
    limit: str = ""  # the round failed on this one of its limits (messages.ROUND_LIMITS)
    queries: int = 0

    def status(self) -> dict[str, Any]:
        """The pair's `antientropy` field in /status."""
        return {
            "at": self.at,
            "seconds": self.seconds,
            "buckets_compared": self.buckets_compared,
            "divergent_buckets": self.divergent_buckets,
            "repaired": self.repaired,
            "bytes": self.bytes,
            "queries": self.queries,
            "error": self.error or None,
            "limit": self.limit or None,
        }

    def summary(self) -> dict[str, Any]:
        """One entry of `POST /antientropy`'s `rounds`."""
        return {
            "peer": self.peer,
            "database": self.database,
            "buckets_compared": self.buckets_compared,
            "divergent_buckets": self.divergent_buckets,
            "repaired": self.repaired,
            "bytes": self.bytes,
            "queries": self.queries,
            "seconds": self.seconds,
            "error": self.error or None,
            "limit": self.limit or None,
        }


@dataclass(frozen=True)
class ScrubReport:
    at: float  # wall clock, when the pass ended
    rows: int  # rows the database held at the end of the pass (all of them were verified)
    damaged: int  # rows found damaged in the pass, whether newly or already marked
    digests_fixed: int  # bucket digests that did not add up and were recounted

    def status(self) -> dict[str, Any]:
        return {"at": self.at, "rows": self.rows, "damaged": self.damaged, "digests_fixed": self.digests_fixed}


class Phase(enum.Enum):
    WAITING = "waiting"  # the next round's timer is armed
    RUNNING = "running"  # a round was sent to a worker; its timeout timer is armed
    CLOSED = "closed"  # the pair went away or the node stops: no timer


_TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.WAITING: frozenset({Phase.WAITING, Phase.RUNNING, Phase.CLOSED}),
    Phase.RUNNING: frozenset({Phase.WAITING, Phase.CLOSED}),
    Phase.CLOSED: frozenset(),
}


@dataclass(eq=False)
class _Schedule:
    """The round schedule of one pair. `timer` belongs to the phase: leaving a phase cancels it (`_enter`)."""

    key: str
    peer: str
    database: str
    backoff: Backoff
    phase: Phase = Phase.WAITING
    timer: asyncio.TimerHandle | None = None
    round: int | None = None  # the round in flight (RUNNING)
    worker: int | None = None  # where it was sent
    waiters: list[asyncio.Future[RoundReport]] = field(default_factory=list)
    last: RoundReport | None = None
    completed: RoundReport | None = None  # the last round that ended without an error
    # Since a round failed on one of its limits, until one does not: the longer schedule the pair waits on.
    penalty: Backoff | None = None


@dataclass(eq=False)
class _Scrub:
    database: str
    backoff: Backoff
    timer: asyncio.TimerHandle | None = None
    queued: bool = False
    failing: bool = False  # scrub_failed was logged; logged again only after a pass succeeded
    last: ScrubReport | None = None


class AntiEntropy:
    """Round schedules per pair and scrub schedules per held database, owned by the node."""

    def __init__(
        self,
        node: AntiEntropyView,
        *,
        loop: asyncio.AbstractEventLoop,
        rng: Callable[[], float],
        to_thread: ToThread = asyncio.to_thread,
    ) -> None:
        """`to_thread(function, *args)` runs a database call off the loop (tests pass an inline runner)."""
        self._node = node
        self._loop = loop
        self._rng = rng
        self._to_thread = to_thread
        self._interval = node.config.replication.antientropy_interval
        self._schedules: dict[tuple[str, str], _Schedule] = {}
        self._rounds = 0
        self._scrubs: dict[str, _Scrub] = {}
        self._scrub_queue: asyncio.Queue[str] = asyncio.Queue()
        self._scrub_task: asyncio.Task[None] | None = None
        self._first_scrubs: asyncio.TimerHandle | None = None
        self._closed = False

    @property
    def interval(self) -> float:
        return self._interval

    @property
    def round_timeout(self) -> float:
        return max(MIN_ROUND_TIMEOUT, self._interval)

    def _backoff(self) -> Backoff:
        interval = self._interval
        return Backoff(
            initial=interval,
            maximum=interval,
            floor=interval / 2,
            jitter="equal",
            rng=self._rng,
            clock=self._loop.time,
        )

    def _penalty(self) -> Backoff:
        """After rounds that failed on a limit: [interval/2, interval), then doubling up to MAX_PENALTY_INTERVALS."""
        interval = self._interval
        return Backoff(
            initial=interval,
            maximum=interval * MAX_PENALTY_INTERVALS,
            floor=interval / 2,
            factor=2.0,
            jitter="equal",
            rng=self._rng,
            clock=self._loop.time,
        )

    @staticmethod
    def _draw(backoff: Backoff) -> float:
        delay = backoff.next_delay()
        assert delay is not None  # no budget and no attempt cap: the schedule never exhausts
        return delay

    # -- pairs -----------------------------------------------------------------------------------------------

    def track(self, key: str, peer: str, database: str) -> None:
        """The node wants the pair: give it a schedule, its first round a draw from now."""
        if self._closed or (key, database) in self._schedules:
            return
        schedule = _Schedule(key=key, peer=peer, database=database, backoff=self._backoff())
        self._schedules[(key, database)] = schedule
        self._wait(schedule)

    def forget(self, key: str, database: str) -> None:
        """The pair was dropped: its timer goes, and whoever waits for its round hears so."""
        schedule = self._schedules.pop((key, database), None)
        if schedule is not None:
            self._close(schedule, "the pair was dropped")

    def last_round(self, key: str, database: str) -> RoundReport | None:
        schedule = self._schedules.get((key, database))
        return schedule.last if schedule is not None else None

    def last_completed(self, key: str, database: str) -> RoundReport | None:
        schedule = self._schedules.get((key, database))
        return schedule.completed if schedule is not None else None

    def phase(self, key: str, database: str) -> Phase | None:
        schedule = self._schedules.get((key, database))
        return schedule.phase if schedule is not None else None

    def _enter(self, schedule: _Schedule, phase: Phase, timer: asyncio.TimerHandle | None) -> None:
        """The one place a schedule changes phase: the timer the old phase owned is cancelled."""
        if phase not in _TRANSITIONS[schedule.phase]:
            raise RuntimeError(f"anti-entropy schedule: {schedule.phase.value} -> {phase.value} is not allowed")
        if schedule.timer is not None:
            schedule.timer.cancel()
        schedule.phase = phase
        schedule.timer = timer
        if phase is not Phase.RUNNING:
            schedule.round = None
            schedule.worker = None

    def _wait(self, schedule: _Schedule) -> None:
        delay = self._draw(schedule.penalty if schedule.penalty is not None else schedule.backoff)
        self._enter(schedule, Phase.WAITING, self._loop.call_later(delay, self._fire, schedule))

    def _fire(self, schedule: _Schedule) -> None:
        schedule.timer = None  # it has run
        if not self._start(schedule, scheduled=True):
            self._wait(schedule)

    def _start(self, schedule: _Schedule, scheduled: bool = False) -> bool:
        """Send a round to the worker that carries the pair's session; False when it is not connected. A scheduled
        round also waits for the pair to be caught up: while the stream still has records to deliver, they are
        not divergence, and pulling them twice would only take the stream's turn (a round asked for by an
        operator runs regardless)."""
        if schedule.phase is Phase.CLOSED:
            return False
        entry = self._node.map.get(schedule.key)
        pair = entry.pairs.get(schedule.database) if entry is not None else None
        if pair is None or not pair.connected or pair.worker is None:
            return False
        if scheduled and not pair.caught_up:
            return False
        supervisor = self._node.supervisor
        if not supervisor.is_live(pair.worker):
            return False
        self._rounds += 1
        number = self._rounds
        message = messages.AntiEntropy(
            key=schedule.key, database=schedule.database, round=number, timeout=self.round_timeout * ROUND_BUDGET
        )
        if not supervisor.send(pair.worker, message):
            return False
        self._enter(
            schedule, Phase.RUNNING, self._loop.call_later(self.round_timeout, self._timed_out, schedule, number)
        )
        schedule.round = number
        schedule.worker = pair.worker
        return True

    def on_done(self, message: messages.AntiEntropyDone) -> None:
        """A worker's answer. Anything but the answer to the round in flight is stale: a round that timed out,
        or a pair dropped and wanted again since."""
        schedule = self._schedules.get((message.key, message.database))
        if schedule is None or schedule.phase is not Phase.RUNNING or schedule.round != message.round:
            log.debug("antientropy_stale", key=message.key, database=message.database, round=message.round)
            return
        report = RoundReport(
            peer=schedule.peer,
            database=schedule.database,
            at=self._node.wall(),
            seconds=message.seconds,
            buckets_compared=message.buckets_compared,
            divergent_buckets=message.divergent_buckets,
            repaired=message.repaired,
            bytes=message.bytes_exchanged,
            error=message.error,
            limit=message.limit if message.limit in messages.ROUND_LIMITS else "",
            queries=message.queries,
        )
        self._finish(schedule, report)

    def _timed_out(self, schedule: _Schedule, number: int) -> None:
        schedule.timer = None
        if schedule.phase is not Phase.RUNNING or schedule.round != number:
            return
        error = f"no answer from worker {schedule.worker} within {self.round_timeout:g} s"
        self._finish(schedule, RoundReport(schedule.peer, schedule.database, self._node.wall(), error=error))

    def on_worker_exit(self, slot: int) -> None:
        """Rounds running on a worker that died will not answer: they fail now rather than at their timeout."""
        for schedule in list(self._schedules.values()):
            if schedule.phase is Phase.RUNNING and schedule.worker == slot:
                error = f"worker {slot} exited during the round"
                self._finish(schedule, RoundReport(schedule.peer, schedule.database, self._node.wall(), error=error))

    def _finish(self, schedule: _Schedule, report: RoundReport) -> None:
        schedule.last = report
        if not report.error:
            schedule.completed = report
        # Records repaired by a round that then failed were changed all the same: they count.
        self._node.metrics.antientropy_round(
            report.peer, report.database, repaired=report.repaired, failed=bool(report.error)
        )
        if report.repaired:
            log.warning(
                "divergence_repaired",
                peer=report.peer,
                database=report.database,
                records=report.repaired,
                buckets=report.divergent_buckets,
            )
        if report.limit:
            self._node.metrics.antientropy_limit(report.peer, report.database, report.limit)
            if schedule.penalty is None:
                schedule.penalty = self._penalty()
        else:
            schedule.penalty = None
        if report.error:
            log.warning(
                "antientropy_failed",
                peer=report.peer,
                database=report.database,
                error=report.error[:500],
                limit=report.limit or None,
                queries=report.queries,
                sample_by=("peer", "database"),
            )
        waiters, schedule.waiters = schedule.waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(report)
        self._wait(schedule)

    def _close(self, schedule: _Schedule, reason: str) -> None:
        self._enter(schedule, Phase.CLOSED, None)
        waiters, schedule.waiters = schedule.waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(RoundReport(schedule.peer, schedule.database, self._node.wall(), error=reason))

    def run_soon(self, key: str, database: str, reason: str) -> bool:
        """Start the pair's round now rather than at its drawn time (a subscription found this node behind its
        peer's purge: `messages.PurgeBehind`). Not waiting for the stream to catch up: what the round removes is
        what no stream will ever correct. True when a round started; one already running is left to finish."""
        schedule = self._schedules.get((key, database))
        if schedule is None or schedule.phase is not Phase.WAITING:
            return False
        if schedule.penalty is not None:
            # Its last round failed on a limit: a peer that keeps asking for rounds gets them on the penalty's schedule.
            log.info(
                "antientropy_requested",
                peer=schedule.peer,
                database=database,
                reason=reason,
                started=False,
                backing_off=True,
            )
            return False
        started = self._start(schedule)
        log.info("antientropy_requested", peer=schedule.peer, database=database, reason=reason, started=started)
        return started

    async def run_now(self, database: str | None = None, timeout: float | None = None) -> list[RoundReport]:
        """Run a round now with every pair of `database` (of every held database when None) and wait for them all, at
        most `timeout` seconds (the round timeout by default). A pair whose round is already running is waited
        for rather than asked twice; a pair that is not connected is reported as such, not asked. The reports
        come in (peer, database) order; a round still out at the timeout is reported as unanswered and finishes
        on its own schedule."""
        if self._closed:
            return []
        timeout = self.round_timeout if timeout is None else timeout
        holds = self._node.holds
        chosen = sorted(
            (
                s
                for s in self._schedules.values()
                if s.database == database or (database is None and s.database in holds)
            ),
            key=lambda s: (s.peer, s.database),
        )
        waiting: dict[int, asyncio.Future[RoundReport]] = {}
        reports: dict[int, RoundReport] = {}
        for index, schedule in enumerate(chosen):
            if schedule.phase is Phase.RUNNING or self._start(schedule):
                waiter: asyncio.Future[RoundReport] = self._loop.create_future()
                schedule.waiters.append(waiter)
                waiting[index] = waiter
            else:
                error = "the pair is not connected"
                reports[index] = RoundReport(schedule.peer, schedule.database, self._node.wall(), error=error)
        if waiting:
            await asyncio.wait(waiting.values(), timeout=timeout)
        for index, waiter in waiting.items():
            schedule = chosen[index]
            if waiter.done():
                reports[index] = waiter.result()
            else:
                waiter.cancel()
                if waiter in schedule.waiters:
                    schedule.waiters.remove(waiter)
                error = f"no answer within {timeout:g} s; the round goes on"
                reports[index] = RoundReport(schedule.peer, schedule.database, self._node.wall(), error=error)
        return [reports[index] for index in range(len(chosen))]

    # -- scrub -----------------------------------------------------------------------------------------------

    def start(self) -> None:
        """The node is ready: scrub every held database soon, then on the schedule."""
        if self._closed or self._scrub_task is not None:
            return
        self._scrub_task = self._loop.create_task(self._scrub_loop(), name="scrub")
        for database in self._node.holds:
            self._scrubs[database] = _Scrub(database=database, backoff=self._backoff())
        # One timer queues them all, in name order; each then keeps its own schedule.
        self._first_scrubs = self._loop.call_later(FIRST_SCRUB_DELAY, self._queue_first_scrubs)

    def _queue_first_scrubs(self) -> None:
        self._first_scrubs = None
        for _, state in sorted(self._scrubs.items()):
            if state.timer is None:
                self._scrub_due(state)

    def note_database(self, database: str) -> None:
        """A database the node holds now (created or opened at run time): scrubbed on the schedule."""
        if self._scrub_task is not None and not self._closed and database not in self._scrubs:
            state = _Scrub(database=database, backoff=self._backoff())
            self._scrubs[database] = state
            self._arm_scrub(state)

    def forget_database(self, database: str) -> None:
        """The database is no longer held (removed from this node): its scrub schedule and last pass go."""
        state = self._scrubs.pop(database, None)
        if state is not None and state.timer is not None:
            state.timer.cancel()
            state.timer = None

    def _arm_scrub(self, state: _Scrub) -> None:
        if state.timer is not None:
            state.timer.cancel()
        state.timer = self._loop.call_later(self._draw(state.backoff), self._scrub_due, state)

    def _scrub_due(self, state: _Scrub) -> None:
        state.timer = None
        if not state.queued and self._scrubs.get(state.database) is state:
            state.queued = True
            self._scrub_queue.put_nowait(state.database)

    def scrubs(self) -> dict[str, ScrubReport]:
        """The last pass of each database that had one."""
        return {name: state.last for name, state in sorted(self._scrubs.items()) if state.last is not None}

    async def _scrub_loop(self) -> None:
        while True:
            database = await self._scrub_queue.get()
            state = self._scrubs.get(database)
            if state is None:
                continue
            state.queued = False
            if database not in self._node.holds:
                del self._scrubs[database]  # no longer held: its schedule ends here
                continue
            await self._scrub_pass(state)
            if self._scrubs.get(database) is state and state.timer is None and not state.queued:
                self._arm_scrub(state)

    async def _scrub_pass(self, state: _Scrub) -> ScrubReport | None:
        """One pass over a database; None when it could not run (logged once until a pass succeeds)."""
        store = self._node.store
        if store is None:
            return None
        name = state.database
        try:
            db = await self._to_thread(store.database, name)
            after = 0
            damaged = 0
            while True:
                last, found = await self._to_thread(db.scrub, after, SCRUB_CHUNK)
                damaged += len(found)
                if last is None:
                    break
                after = last
                await asyncio.sleep(SCRUB_CHUNK / self._node.config.replication.scrub_rate)
            fixed = await self._to_thread(db.check_digests)
            roots = await self._to_thread(db.roots)
        except Exception as exc:
            if not state.failing:
                state.failing = True
                log.warning("scrub_failed", database=name, reason=str(exc) or type(exc).__name__)
            return None
        finally:
            # Every record this process found damaged since the last pass, by this scrub or by any other read:
            # each was counted once, when it was marked.
            for database, count in store.take_checksum_failures().items():
                self._node.metrics.checksum_failures(database, count)
        state.failing = False
        report = ScrubReport(
            at=self._node.wall(), rows=sum(count for count, _ in roots.values()), damaged=damaged, digests_fixed=fixed
        )
        state.last = report
        if fixed:
            log.warning("digests_fixed", database=name, buckets=fixed)
        return report

    # -- reload and shutdown ---------------------------------------------------------------------------------

    def reconfigure(self) -> None:
        """After a reload: a new interval redraws every waiting timer from now on the new schedule."""
        interval = self._node.config.replication.antientropy_interval
        if interval == self._interval or self._closed:
            return
        self._interval = interval
        for schedule in self._schedules.values():
            schedule.backoff = self._backoff()
            if schedule.penalty is not None:
                schedule.penalty = self._penalty()
            if schedule.phase is Phase.WAITING:
                self._wait(schedule)
        for state in self._scrubs.values():
            state.backoff = self._backoff()
            if state.timer is not None:
                self._arm_scrub(state)

    async def close(self) -> None:
        """Cancel every timer and the scrub task; rounds being waited for end as `the node is stopping`."""
        self._closed = True
        for schedule in self._schedules.values():
            self._close(schedule, "the node is stopping")
        for state in self._scrubs.values():
            if state.timer is not None:
                state.timer.cancel()
                state.timer = None
        if self._first_scrubs is not None:
            self._first_scrubs.cancel()
            self._first_scrubs = None
        task, self._scrub_task = self._scrub_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
