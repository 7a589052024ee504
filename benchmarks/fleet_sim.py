"""Fleet reconnection storm: N nodes redial one peer that comes back after an outage, in virtual time.

The delays come from the real `replicator.shared.backoff.Backoff` and, where the coordinator paces, the real
`SetupScheduler`, both on a heap-based virtual loop in this file (`time()`, `call_later()`), so a 10,000-node storm
of several virtual minutes runs in seconds and every run with the same seed is identical.

Usage, from the repository root:

    .venv/bin/python benchmarks/fleet_sim.py [--nodes 10000] [--validate] [--plot out.png]
        [--pairs 1] [--capacity 500] [--wasted 0..1] [--max-handshakes N] [--wedge 30] [--budget [RATE:BURST]]

The default scenario (10,000 nodes, one pair each, a 120 s outage, a peer of 500 handshakes/s) takes a few seconds.
A scenario the schedules cannot bring back (try `--pairs 4` or `--capacity 200`) runs to its horizon and takes
longer. `--plot` needs matplotlib (`.venv/bin/pip install -e '.[bench]'`); nothing else does.

Validation (`--validate`)
-------------------------
Before the fleet figures mean anything, the same loop and `Backoff` reproduce the contention experiment of the AWS
Architecture Blog post "Exponential Backoff And Jitter" (Marc Brooker, 2015): 100 clients write one record under
optimistic concurrency, and the figure is the number of calls until all 100 have succeeded. The post publishes
the result, not the model, so the model here is a reconstruction, calibrated once and then fixed:

- every client starts at t = 0; a call reads the record's version at its start and sends a conditional write that
  lands `latency` later, latency uniform in [10, 20] ms per call;
- the write succeeds if no other write succeeded between this call's read and its write (first writer wins);
  a client that succeeded leaves, one that failed sleeps one backoff delay from the moment its write failed;
- base 5 ms, cap 2 s. The exponential modes count the first retry as attempt 1, as the post's
  `min(cap, base * 2 ** attempt)` reads, so `Backoff(initial=10 ms)`; decorrelated starts from `sleep = base`,
  as the post's `min(cap, random_between(base, sleep * 3))`, so `Backoff(initial=5 ms)`.

No jitter depends only on the spread of the latency (the only thing that breaks the lockstep): a [a, 2a] spread
lands on the published figure; the jittered modes depend on latency / base. Published figures are full 795, equal
812, decorrelated 1,005, none 1,862 calls; a mode passes when the mean over the seeds is within 10%.

Fleet model
-----------
- N nodes, each holding `--pairs` databases of the one peer: P (peer, database) pairs per node, and as in the node
  each pair is its own session with its own reconnect schedule and its own dial (one TLS handshake per pair).
- The peer goes down at t = 0; every node notices within `--drop-spread` seconds (uniformly). It comes back at
  `--outage`. While it is down a dial is refused after `--refuse-time` (connection refused: no handshake).
- The returning peer completes at most `--capacity` K handshakes per second: it takes dials in arrival order, each
  occupies it for 1/K s, and a served dial connects `--handshake-cost` seconds after its turn came (round trips
  and crypto as the client sees them). A dial whose handshake cannot complete within `--timeout` of its arrival
  fails at the timeout (10 s: the peer's `listen.request_timeout`, shorter than the dialler's 15 s): beyond
  capacity, dials time out and their nodes retry. `--wasted` is the share of a handshake's work the peer still
  spends on such a dial: 1 (the default) because a peer cannot tell which of its queued handshakes have already
  been given up, which is what lets a sustained overload collapse into serving nothing but doomed handshakes; 0 is
  a peer that sheds for free. `--max-handshakes M` lets the peer refuse, before any TLS work, a connection that
  finds M handshakes queued (the listener's pre-TLS refusal, counted on handshakes rather than on connections).
  This FIFO stands in for asyncio's interleaved handshakes: the same capacity, and the same point of collapse,
  when the queued work outgrows the timeout.
- A failed dial is followed by the pair's next delay. Rows `none`, `equal`, `full`, `decorrelated` use the
  worker's reconnect schedule (`workers/session.py`: floor 0.5 s, 0.5 -> 30 s) with that jitter; the node's
  configuration offers full (default) and equal, the other two are for comparison. Row `setup_scheduler` re-arms
  each failed dial through a per-node `SetupScheduler` instead (the coordinator's setup pacing: full jitter,
  floor 0.2 s, 0.4 -> 30 s, on one ladder sweep per node, stagger 0.05 s).
- `--wedge SECONDS` adds the coordinator's wedge re-drive as the node does it (`coordinator/node.py`): every 5 s
  (a random phase per node) a pair down for the threshold, counted from when it said it would dial again, gets a
  re-drive at a ladder slot 0.2-0.4 s later (`SetupScheduler.call_at_slot`), which forces an immediate dial past
  the pair's schedule. A pair that keeps backing off on its schedule is never re-driven. `--wedge-before-fix`
  counts from the first disconnect instead, as the node did before this simulation found that a long outage then
  forced a dial of every pair every 35 s. Off by default: the main table is the per-pair schedules alone.
- `--budget [RATE:BURST]` gives each node one `RetryBudget` (`shared/retry_budget.py`) shared by its pairs, as the
  node's worker does per peer (`replication.redial_rate` and `redial_burst`; `--budget` alone uses their defaults,
  5/s and 50): a dial after a pair's delay takes a token or, when there is none, is skipped for another delay of
  the pair's schedule; a dial that connects gives its token back, and a wedge re-drive (a forced dial) takes none.
  The figures are then printed with and without it.

Figures (one row per schedule)
------------------------------
- peak_handshakes_per_s: the most dials that reached the returning peer within any one second (a sliding window),
  served or not: the load the peer has to absorb; peak_at_s is when that second began, after the return.
  peak_served_per_s is the most it completed in one second (at most K).
- seconds_over_capacity: the number of whole seconds after the return in which more than K dials arrived.
- all_reconnected_s: from the peer's return until the last pair connected (null if not within `--horizon`);
  p50/p99_reconnect_s: the same per pair.
- attempts_per_node_minute: every dial of every pair (refused while down, timed out, served) divided by the
  node-minutes spent with at least one pair down: how hard the fleet knocks per unit of outage.
- dials_while_down / dials_after_return / timeouts / refused_before_tls / wedge_redrives: the counts behind it.
- steady_offer_per_s: N x P / (mean delay at the ceiling, measured on the schedule), the rate the fleet settles at
  once every schedule has reached 30 s; above K, the schedules alone cannot keep a returning peer under capacity.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from replicator.coordinator.setup_scheduler import SetupScheduler, SlotTimer, Sweep
from replicator.shared.backoff import Backoff, Jitter
from replicator.shared.config import ReplicationSection
from replicator.shared.retry_budget import RetryBudget

JITTERS = ("none", "equal", "full", "decorrelated")
SETUP = "setup_scheduler"
ROWS = (*JITTERS, SETUP)

# The worker's reconnect schedule (workers/session.py) and the coordinator's reconcile period.
RECONNECT_FLOOR = 0.5
RECONNECT_INITIAL = 0.5
RECONNECT_MAXIMUM = 30.0
RECONCILE_INTERVAL = 5.0
# The node's redial budget per peer (replication.redial_rate, redial_burst): what `--budget` alone simulates.
NODE_BUDGET = f"{ReplicationSection().redial_rate:g}:{ReplicationSection().redial_burst:g}"

# The contention experiment of "Exponential Backoff And Jitter" and its published results (calls).
PUBLISHED_CALLS = {"full": 795, "equal": 812, "decorrelated": 1005, "none": 1862}
CONTENTION_CLIENTS = 100
CONTENTION_BASE = 0.005
CONTENTION_CAP = 2.0
CONTENTION_LATENCY = (0.010, 0.020)
TOLERANCE = 0.10


class Timer:
    __slots__ = ("args", "callback", "cancelled", "when")

    def __init__(self, when: float, callback: Callable[..., object], args: tuple[Any, ...]) -> None:
        self.when = when
        self.callback = callback
        self.args = args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class VirtualLoop:
    """`time()` and `call_later()` over a heap in virtual time; `run()` fires what is due, in order."""

    __slots__ = ("_heap", "_now", "_order")

    def __init__(self) -> None:
        self._now = 0.0
        self._heap: list[tuple[float, int, Timer]] = []
        self._order = itertools.count()

    def time(self) -> float:
        return self._now

    def call_at(self, when: float, callback: Callable[..., object], *args: Any) -> Timer:
        timer = Timer(max(when, self._now), callback, args)
        heapq.heappush(self._heap, (timer.when, next(self._order), timer))
        return timer

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any) -> Timer:
        return self.call_at(self._now + delay, callback, *args)

    def run(self, until: float = math.inf) -> None:
        """Fire every timer due at or before `until`, in time order (ties in the order they were armed)."""
        heap = self._heap
        pop = heapq.heappop
        while heap and heap[0][0] <= until:
            when, _, timer = pop(heap)
            if timer.cancelled:
                continue
            self._now = when
            timer.callback(*timer.args)
        if until != math.inf:
            self._now = max(self._now, until)


# -- validation: the AWS contention experiment --------------------------------------------------------------------


class _Contention:
    def __init__(self, jitter: Jitter, seed: int, clients: int) -> None:
        self.loop = VirtualLoop()
        rng = random.Random(seed)
        self.uniform = rng.uniform
        initial = CONTENTION_BASE if jitter == "decorrelated" else 2 * CONTENTION_BASE
        self.schedules = [
            Backoff(initial, CONTENTION_CAP, 0.0, jitter=jitter, rng=rng.random, clock=self.loop.time)
            for _ in range(clients)
        ]
        self.calls = 0
        self.last_commit = -math.inf
        self.remaining = clients

    def read(self, client: int) -> None:
        self.calls += 1
        low, high = CONTENTION_LATENCY
        self.loop.call_later(self.uniform(low, high), self.write, client, self.loop.time())

    def write(self, client: int, read_at: float) -> None:
        if self.last_commit <= read_at:
            self.last_commit = self.loop.time()
            self.remaining -= 1
            return
        delay = self.schedules[client].next_delay()
        assert delay is not None  # no budget, no attempt cap
        self.loop.call_later(delay, self.read, client)


def contention_calls(jitter: Jitter, seed: int, clients: int = CONTENTION_CLIENTS) -> int:
    """Calls until every client of the contention experiment has written once (see the module docstring)."""
    run = _Contention(jitter, seed, clients)
    for client in range(clients):
        run.loop.call_later(0.0, run.read, client)
    run.loop.run()
    assert run.remaining == 0
    return run.calls


def validate(seeds: Sequence[int]) -> dict[str, Any]:
    modes = {}
    for jitter in ("full", "equal", "decorrelated", "none"):
        calls = [contention_calls(jitter, seed) for seed in seeds]
        mean = statistics.fmean(calls)
        published = PUBLISHED_CALLS[jitter]
        error = mean / published - 1.0
        modes[jitter] = {
            "published_calls": published,
            "simulated_calls": round(mean, 1),
            "stdev": round(statistics.pstdev(calls), 1),
            "error": round(error, 4),
            "pass": abs(error) <= TOLERANCE,
        }
    return {
        "experiment": "AWS 'Exponential Backoff And Jitter': 100 clients, one record, optimistic concurrency",
        "model": {
            "clients": CONTENTION_CLIENTS,
            "base_s": CONTENTION_BASE,
            "cap_s": CONTENTION_CAP,
            "latency_s": list(CONTENTION_LATENCY),
            "seeds": len(seeds),
        },
        "tolerance": TOLERANCE,
        "modes": modes,
        "pass": all(mode["pass"] for mode in modes.values()),
    }


# -- the fleet ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    nodes: int = 10_000
    pairs: int = 1
    outage: float = 120.0
    drop_spread: float = 1.0
    refuse_time: float = 0.01
    capacity: float = 500.0
    handshake_cost: float = 0.05
    timeout: float = 10.0
    wasted: float = 1.0
    max_handshakes: int = 0  # handshakes queued at the peer past which it refuses before TLS; 0: no limit
    horizon: float = 1800.0
    wedge: float = 0.0  # the wedge threshold in seconds; 0 leaves the re-drive out
    # The re-drive as it was before the fix: it counted a pair that backs off on its own schedule as wedged.
    wedge_counts_backoff: bool = False
    budget_rate: float = 0.0  # tokens per second per node; 0 means no budget
    budget_burst: float = 1.0
    seed: int = 1


class _Peer:
    """The returning peer: refused while down, then a FIFO of handshakes at `capacity` per second."""

    __slots__ = (
        "arrivals",
        "cost",
        "free_at",
        "max_queued",
        "offered",
        "refuse_time",
        "refused",
        "served",
        "service",
        "timeout",
        "timeouts",
        "up_at",
        "waste",
    )

    def __init__(self, scenario: Scenario) -> None:
        self.up_at = scenario.outage
        self.service = 1.0 / scenario.capacity
        self.cost = scenario.handshake_cost
        self.timeout = scenario.timeout
        self.refuse_time = scenario.refuse_time
        self.waste = scenario.wasted * self.service
        # Queued work, in seconds, past which a new connection is refused before any TLS work.
        self.max_queued = scenario.max_handshakes * self.service if scenario.max_handshakes > 0 else math.inf
        self.free_at = scenario.outage
        self.arrivals: list[float] = []
        self.offered: list[int] = []
        self.served: list[int] = []
        self.timeouts = 0
        self.refused = 0

    def _count(self, bins: list[int], when: float) -> None:
        second = int(when - self.up_at)
        while len(bins) <= second:
            bins.append(0)
        bins[second] += 1

    def handshake(self, now: float) -> tuple[bool, float]:
        """A dial arriving now (the peer is up): whether it connects, and when the node learns it."""
        self.arrivals.append(now)
        self._count(self.offered, now)
        if self.free_at - now >= self.max_queued:
            self.refused += 1
            return False, now + self.refuse_time
        start = max(now, self.free_at)
        if start + self.cost <= now + self.timeout:
            self.free_at = start + self.service
            self._count(self.served, start + self.cost)
            return True, start + self.cost
        self.free_at += self.waste
        self.timeouts += 1
        return False, now + self.timeout

    def peak(self, window: float = 1.0) -> tuple[int, float]:
        """The most dials that arrived within any `window` seconds, and when that window began (since the return)."""
        arrivals = self.arrivals
        best, began, low = 0, 0.0, 0
        for high, when in enumerate(arrivals):
            while arrivals[low] <= when - window:
                low += 1
            if high - low + 1 > best:
                best, began = high - low + 1, arrivals[low]
        return best, began - self.up_at


class _Pair:
    __slots__ = ("connected", "database", "dial", "due", "node", "schedule", "since", "timer", "token")

    def __init__(self, node: _Node, database: str, schedule: Backoff | None) -> None:
        self.node = node
        self.database = database
        self.schedule = schedule
        self.connected = True
        self.since = 0.0  # down since (the coordinator's disconnected_at), moved on by a wedge re-drive
        self.due = 0.0  # when the pair said it dials again (the coordinator's retry_due)
        self.dial = 0  # the current dial; an outcome for an older one is ignored
        self.timer: Timer | None = None  # the pending delay or budget wait
        self.token = False  # the current dial (or budget wait) holds a token of the node's budget


class _Node:
    __slots__ = ("budget", "dials", "down", "down_at", "ladder", "pairs", "redrive", "scheduler", "up_at", "url")

    def __init__(self, index: int) -> None:
        self.url = f"wss://node{index}.fleet.internal:9925"
        self.pairs: list[_Pair] = []
        self.down = 0
        self.down_at = 0.0
        self.up_at: float | None = None
        self.dials = 0
        self.budget: RetryBudget | None = None
        self.scheduler: SetupScheduler | None = None
        self.ladder: Sweep | None = None
        self.redrive: SlotTimer | None = None


class Fleet:
    """One run of the storm for one row (a jitter mode, or the setup scheduler)."""

    def __init__(self, scenario: Scenario, row: str) -> None:
        if row not in ROWS:
            raise ValueError(f"row must be one of {ROWS}, got {row!r}")
        self.scenario = scenario
        self.row = row
        self.loop = VirtualLoop()
        self.rng = random.Random(f"{scenario.seed}:{row}")
        self.peer = _Peer(scenario)
        self.nodes: list[_Node] = []
        self.dials_while_down = 0
        self.redrives = 0
        self.reconnect_times: list[float] = []
        loop = self.loop
        draw = self.rng.random
        for index in range(scenario.nodes):
            node = _Node(index)
            if row == SETUP or scenario.wedge > 0:
                node.scheduler = SetupScheduler(self._dispatch, loop=loop, rng=draw)
                node.ladder = node.scheduler.sweep()
            if scenario.budget_rate > 0:
                node.budget = RetryBudget(scenario.budget_rate, scenario.budget_burst, loop=loop)
            for database in range(scenario.pairs):
                schedule = None
                if row != SETUP:
                    schedule = Backoff(
                        RECONNECT_INITIAL,
                        RECONNECT_MAXIMUM,
                        RECONNECT_FLOOR,
                        jitter=row,
                        rng=draw,
                        clock=loop.time,
                    )
                node.pairs.append(_Pair(node, f"db{database}", schedule))
            self.nodes.append(node)
            loop.call_at(draw() * scenario.drop_spread, self._drop, node)

    # -- a pair's life ----------------------------------------------------------------------------------------------

    def _drop(self, node: _Node) -> None:
        now = self.loop.time()
        node.down = len(node.pairs)
        node.down_at = now
        for pair in node.pairs:
            pair.connected = False
            pair.since = now
            self._retry(pair)
        if self.scenario.wedge > 0:
            self.loop.call_later(self.rng.random() * RECONCILE_INTERVAL, self._reconcile, node)

    def _retry(self, pair: _Pair) -> None:
        """The pair's link is down: its next dial, after its schedule's delay."""
        if pair.schedule is None:
            node = pair.node
            assert node.scheduler is not None
            node.scheduler.schedule(node.url, pair.database, pair, sweep=node.ladder)
            return
        delay = pair.schedule.next_delay()
        assert delay is not None  # the reconnect schedule never exhausts
        pair.due = self.loop.time() + delay
        pair.timer = self.loop.call_later(delay, self._take_token, pair)

    def _dispatch(self, url: str, database: str, pair: _Pair) -> None:
        self._take_token(pair)

    def _take_token(self, pair: _Pair) -> None:
        budget = pair.node.budget
        if budget is not None:
            if not budget.take():
                self._retry(pair)  # as in the node: the dial is skipped, and the pair waits another delay
                return
            pair.token = True
        self._dial(pair)

    def _dial(self, pair: _Pair) -> None:
        pair.timer = None
        pair.dial += 1
        pair.node.dials += 1
        now = self.loop.time()
        if now < self.peer.up_at:
            self.dials_while_down += 1
            self.loop.call_at(now + self.scenario.refuse_time, self._outcome, pair, pair.dial, False)
            return
        connected, when = self.peer.handshake(now)
        self.loop.call_at(when, self._outcome, pair, pair.dial, connected)

    def _outcome(self, pair: _Pair, dial: int, connected: bool) -> None:
        if dial != pair.dial or pair.connected:
            return  # a dial abandoned by a forced reconnect
        if pair.token and connected:
            assert pair.node.budget is not None
            pair.node.budget.refund()  # as in the node, a dial that connects costs the budget nothing
        pair.token = False
        if not connected:
            self._retry(pair)
            return
        now = self.loop.time()
        pair.connected = True
        self.reconnect_times.append(now - self.peer.up_at)
        node = pair.node
        if node.scheduler is not None:
            node.scheduler.note_connected(node.url, pair.database)
        node.down -= 1
        if node.down == 0:
            node.up_at = now
            if node.redrive is not None:
                node.redrive.cancel()
                node.redrive = None

    # -- the coordinator's wedge re-drive (coordinator/node.py: _redrive_wedged, _fire_wedge) ------------------------

    def _wedged(self, node: _Node, now: float) -> list[_Pair]:
        assert node.scheduler is not None
        threshold = self.scenario.wedge
        return [
            pair
            for pair in node.pairs
            if not pair.connected
            and not node.scheduler.is_armed(node.url, pair.database)
            and now - (pair.since if self.scenario.wedge_counts_backoff else max(pair.since, pair.due)) >= threshold
        ]

    def _reconcile(self, node: _Node) -> None:
        if node.down == 0:
            return
        self.loop.call_later(RECONCILE_INTERVAL, self._reconcile, node)
        if node.redrive is not None or not self._wedged(node, self.loop.time()):
            return
        assert node.scheduler is not None and node.ladder is not None
        base = 0.2 + self.rng.random() * 0.2
        node.redrive = node.scheduler.call_at_slot(node.ladder, base, self._fire_wedge, node)

    def _fire_wedge(self, node: _Node) -> None:
        node.redrive = None
        now = self.loop.time()
        wedged = self._wedged(node, now)
        if not wedged:
            return
        pair = wedged[0]  # one pair per slot, as the node does
        pair.since = now
        self.redrives += 1
        # ForceReconnect: the session drops its wait (or its dial in flight) and dials now.
        if pair.timer is not None:
            pair.timer.cancel()
            pair.timer = None
        pair.token = False  # a forced dial takes no token, as in the node; one in flight has spent its own
        pair.dial += 1
        self._dial(pair)
        if len(wedged) > 1:
            assert node.scheduler is not None and node.ladder is not None
            node.redrive = node.scheduler.call_at_slot(node.ladder, 0.0, self._fire_wedge, node)

    # -- results ----------------------------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        scenario = self.scenario
        self.loop.run(scenario.outage + scenario.horizon)
        peer = self.peer
        pairs = scenario.nodes * scenario.pairs
        times = sorted(self.reconnect_times)
        connected = len(times)
        dials = sum(node.dials for node in self.nodes)
        end = self.loop.time()
        node_minutes = sum(((node.up_at if node.up_at is not None else end) - node.down_at) for node in self.nodes)
        offered = peer.offered
        peak, peak_at = peer.peak()
        return {
            "row": self.row,
            "peak_handshakes_per_s": peak,
            "peak_at_s": round(peak_at, 2),
            "peak_served_per_s": max(peer.served, default=0),
            "seconds_over_capacity": sum(1 for count in offered if count > scenario.capacity),
            "all_reconnected_s": round(times[-1], 2) if connected == pairs else None,
            "p50_reconnect_s": round(times[len(times) // 2], 2) if times else None,
            "p99_reconnect_s": round(times[min(len(times) - 1, int(len(times) * 0.99))], 2) if times else None,
            "connected_fraction": round(connected / pairs, 4),
            "attempts_per_node_minute": round(dials / (node_minutes / 60.0), 3),
            "dials": dials,
            "dials_while_down": self.dials_while_down,
            "dials_after_return": dials - self.dials_while_down,
            "timeouts": peer.timeouts,
            "refused_before_tls": peer.refused,
            "wedge_redrives": self.redrives,
            "steady_offer_per_s": steady_offer(scenario, self.row),
            "handshakes_per_s": offered,
        }


def mean_ceiling_delay(row: str, draws: int = 20_000) -> float:
    """The mean delay of the row's schedule once it has reached its ceiling, measured on the real `Backoff`.

    Decorrelated has no closed form here: a short draw pulls the next range down, so it is measured like the others.
    """
    rng = random.Random(0)
    if row == SETUP:
        schedule = Backoff(0.4, 30.0, 0.2, jitter="full", rng=rng.random, clock=lambda: 0.0)
    else:
        schedule = Backoff(
            RECONNECT_INITIAL, RECONNECT_MAXIMUM, RECONNECT_FLOOR, jitter=row, rng=rng.random, clock=lambda: 0.0
        )
    delays = [schedule.next_delay() or 0.0 for _ in range(draws + 50)][50:]
    return statistics.fmean(delays)


def steady_offer(scenario: Scenario, row: str) -> float:
    """N x P / the mean delay at the ceiling: the dials per second the fleet settles at, not counting the time a
    dial takes to fail."""
    return round(scenario.nodes * scenario.pairs / mean_ceiling_delay(row), 1)


def run_rows(scenario: Scenario, rows: Sequence[str] = ROWS) -> list[dict[str, Any]]:
    return [Fleet(scenario, row).run() for row in rows]


# -- output -----------------------------------------------------------------------------------------------------------


def plot(path: str, scenario: Scenario, runs: dict[str, list[dict[str, Any]]]) -> None:
    """Handshakes per second at the returning peer over time, one line per row, one panel per run set."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "--plot needs matplotlib, which is not installed: .venv/bin/pip install -e '.[bench]'"
        ) from None
    figure, axes = plt.subplots(len(runs), 1, figsize=(10, 4.5 * len(runs)), squeeze=False, sharex=True)
    for axis, (title, rows) in zip(axes[:, 0], runs.items(), strict=True):
        for row in rows:
            series = row["handshakes_per_s"]
            axis.step(range(len(series)), series, where="post", label=row["row"], linewidth=1.0)
        axis.axhline(scenario.capacity, color="black", linestyle="--", linewidth=0.8, label="capacity")
        axis.set_yscale("symlog", linthresh=10)
        axis.set_ylim(bottom=0)
        axis.set_ylabel("handshakes / s at the peer")
        axis.set_title(title)
        axis.legend(loc="upper right", fontsize="small")
    axes[-1, 0].set_xlabel("seconds since the peer came back")
    figure.suptitle(
        f"{scenario.nodes} nodes x {scenario.pairs} pair(s) to one peer, outage {scenario.outage:g} s, "
        f"capacity {scenario.capacity:g} handshakes/s"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _budget(text: str) -> tuple[float, float]:
    try:
        rate, _, burst = text.partition(":")
        values = (float(rate), float(burst or 1.0))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected RATE:BURST (tokens per second:bucket), got {text!r}") from None
    if not all(math.isfinite(v) for v in values) or values[0] <= 0 or values[1] < 1:
        raise argparse.ArgumentTypeError(f"need RATE > 0 and BURST >= 1, got {text!r}")
    return values


def _table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{key: value for key, value in row.items() if key != "handshakes_per_s"} for row in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--validate", action="store_true", help="reproduce the AWS contention experiment only")
    parser.add_argument("--seeds", type=int, default=20, help="seeds averaged by --validate")
    parser.add_argument("--nodes", type=int, default=Scenario.nodes)
    parser.add_argument("--pairs", type=int, default=Scenario.pairs, help="databases of the peer per node")
    parser.add_argument("--outage", type=float, default=Scenario.outage, help="seconds the peer is down")
    parser.add_argument("--drop-spread", type=float, default=Scenario.drop_spread)
    parser.add_argument("--refuse-time", type=float, default=Scenario.refuse_time)
    parser.add_argument("--capacity", type=float, default=Scenario.capacity, help="handshakes per second")
    parser.add_argument("--handshake-cost", type=float, default=Scenario.handshake_cost, help="seconds")
    parser.add_argument("--timeout", type=float, default=Scenario.timeout, help="dial timeout, seconds")
    parser.add_argument("--wasted", type=float, default=Scenario.wasted, help="work spent on a timed-out dial, 0..1")
    parser.add_argument(
        "--max-handshakes", type=int, default=Scenario.max_handshakes, help="peer refuses past this queue (0: off)"
    )
    parser.add_argument("--horizon", type=float, default=Scenario.horizon, help="seconds simulated after the return")
    parser.add_argument("--wedge", type=float, default=Scenario.wedge, help="wedge threshold, seconds (0: off)")
    parser.add_argument(
        "--wedge-before-fix",
        action="store_true",
        help="with --wedge: count a pair that backs off on its schedule as wedged, as the node did before",
    )
    parser.add_argument(
        "--budget",
        type=_budget,
        nargs="?",
        const=NODE_BUDGET,
        help=f"RATE:BURST, a per-node retry budget (figures with/without); alone, the node's default {NODE_BUDGET}",
    )
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {','.join(ROWS)}")
    parser.add_argument("--seed", type=int, default=Scenario.seed)
    parser.add_argument("--plot", metavar="FILE.png", help="plot handshakes per second over time (needs matplotlib)")
    args = parser.parse_args(argv)

    if args.validate:
        result = validate(range(args.seeds))
        print(json.dumps({"benchmark": "fleet_sim", "validation": result}, indent=2))
        return 0 if result["pass"] else 1

    rows = [row.strip() for row in args.rows.split(",") if row.strip()]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    if args.nodes < 1 or args.pairs < 1 or args.capacity <= 0 or not 0 <= args.wasted <= 1:
        parser.error("need --nodes >= 1, --pairs >= 1, --capacity > 0 and --wasted within [0, 1]")
    scenario = Scenario(
        nodes=args.nodes,
        pairs=args.pairs,
        outage=args.outage,
        drop_spread=args.drop_spread,
        refuse_time=args.refuse_time,
        capacity=args.capacity,
        handshake_cost=args.handshake_cost,
        timeout=args.timeout,
        wasted=args.wasted,
        max_handshakes=args.max_handshakes,
        horizon=args.horizon,
        wedge=args.wedge,
        wedge_counts_backoff=args.wedge_before_fix,
        seed=args.seed,
    )
    started = time.perf_counter()
    runs = {"per-pair schedules": run_rows(scenario, rows)}
    result: dict[str, Any] = {
        "benchmark": "fleet_sim",
        "scenario": {key: value for key, value in asdict(scenario).items() if not key.startswith("budget")},
        "results": _table(runs["per-pair schedules"]),
    }
    if args.budget is not None:
        rate, burst = args.budget
        budgeted = replace(scenario, budget_rate=rate, budget_burst=burst)
        runs[f"with a per-node budget {rate:g}/s, burst {burst:g}"] = run_rows(budgeted, rows)
        with_budget = _table(list(runs.values())[-1])
        result["budget"] = {"rate_per_s": rate, "burst": burst, "results": with_budget}
    result["wall_seconds"] = round(time.perf_counter() - started, 2)
    if args.plot:
        plot(args.plot, scenario, runs)
        result["plot"] = args.plot
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
