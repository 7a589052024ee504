"""Subscription-setup storm: the setup scheduler against one timer per event, measured in the same run.

1,000 (peer url, database) pairs each receive 2,000 setup events spread over 60 virtual seconds (one event per pair
every 30 ms, 33,000 events per second for the node), the shape of the registry-update storm of seed issue #327. The
baseline is the behaviour before the scheduler: every event arms its own 200 ms timer, and every timer dispatches.
Both run on the same minimal virtual-time loop, so the figures are the cost of the setup path, not of an event loop.

Prints one JSON object: dispatch counts and their ratio, the cost of one `schedule()` call and of one event including
timers and dispatch (microseconds), and memory per pair (tracemalloc) at mid-storm and at peak.
Run from the repository root: `.venv/bin/python benchmarks/setup_storm.py [--pairs N] [--events N]`.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import itertools
import json
import random
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from replicator.coordinator.setup_scheduler import SetupScheduler

BASELINE_DELAY = 0.2  # the fixed setup timer before the scheduler
TARGET_RATIO = 100.0
TARGET_US_PER_EVENT = 2.0


class _Handle:
    __slots__ = ("args", "callback", "cancelled")

    def __init__(self, callback: Callable[..., object], args: tuple[Any, ...]) -> None:
        self.callback = callback
        self.args = args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class StandInLoop:
    """`time()` and `call_later()` over a heap in virtual time; `run_until()` fires what is due, in order."""

    def __init__(self) -> None:
        self._now = 0.0
        self._heap: list[tuple[float, int, _Handle]] = []
        self._order = itertools.count()

    def time(self) -> float:
        return self._now

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any) -> _Handle:
        handle = _Handle(callback, args)
        heapq.heappush(self._heap, (self._now + delay, next(self._order), handle))
        return handle

    def run_until(self, when: float) -> None:
        heap = self._heap
        while heap and heap[0][0] <= when:
            due, _, handle = heapq.heappop(heap)
            self._now = due
            if not handle.cancelled:
                handle.callback(*handle.args)
        self._now = when

    @property
    def armed(self) -> int:
        return sum(not handle.cancelled for _, _, handle in self._heap)


class Counter:
    def __init__(self) -> None:
        self.count = 0

    def dispatch(self, url: str, database: str, payload: Any) -> None:
        self.count += 1


def pairs_of(n: int) -> list[tuple[str, str]]:
    return [(f"wss://node{i // 4}.cluster.internal:9925", f"db{i % 4}") for i in range(n)]


def run_scheduler(
    pairs: list[tuple[str, str]], events: int, duration: float, stop_at: float | None = None
) -> dict[str, Any]:
    loop = StandInLoop()
    counter = Counter()
    scheduler = SetupScheduler(counter.dispatch, loop=loop, rng=random.Random(327).random)
    schedule = scheduler.schedule
    tick = duration / events
    in_schedule = 0.0
    most_pending = 0
    started = time.perf_counter()
    for k in range(events):
        now = k * tick
        if stop_at is not None and now >= stop_at:
            break
        loop.run_until(now)
        t0 = time.perf_counter()
        for url, database in pairs:
            schedule(url, database, k)
        in_schedule += time.perf_counter() - t0
        most_pending = max(most_pending, scheduler.pending)
    if stop_at is not None:
        return {"loop": loop, "scheduler": scheduler}
    loop.run_until(duration)
    storm = time.perf_counter() - started
    during = counter.count
    loop.run_until(duration + 60.0)
    return {
        "loop": loop,
        "scheduler": scheduler,
        "in_schedule_s": in_schedule,
        "storm_s": storm,
        "dispatched_during_storm": during,
        "dispatched_total": counter.count,
        "most_pending": most_pending,
    }


def run_baseline(
    pairs: list[tuple[str, str]], events: int, duration: float, stop_at: float | None = None
) -> dict[str, Any]:
    loop = StandInLoop()
    counter = Counter()
    dispatch = counter.dispatch
    call_later = loop.call_later
    tick = duration / events
    in_schedule = 0.0
    most_pending = 0
    started = time.perf_counter()
    for k in range(events):
        now = k * tick
        if stop_at is not None and now >= stop_at:
            break
        loop.run_until(now)
        t0 = time.perf_counter()
        for url, database in pairs:
            call_later(BASELINE_DELAY, dispatch, url, database, k)
        in_schedule += time.perf_counter() - t0
        if k % 50 == 0:
            most_pending = max(most_pending, loop.armed)
    if stop_at is not None:
        return {"loop": loop}
    loop.run_until(duration)
    storm = time.perf_counter() - started
    during = counter.count
    loop.run_until(duration + 60.0)
    return {
        "loop": loop,
        "in_schedule_s": in_schedule,
        "storm_s": storm,
        "dispatched_during_storm": during,
        "dispatched_total": counter.count,
        "most_pending": most_pending,
    }


def memory_per_pair(run: Callable[..., dict[str, Any]], pairs: list[tuple[str, str]], events: int) -> dict[str, float]:
    """Bytes per pair held at mid-storm (30 of 60 virtual seconds), and the peak up to then."""
    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        state = run(pairs, events, 60.0, stop_at=30.0)
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del state
    return {
        "held_bytes_per_pair": round((held - base) / len(pairs), 1),
        "peak_bytes_per_pair": round((peak - base) / len(pairs), 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=1000)
    parser.add_argument("--events", type=int, default=2000, help="events per pair over 60 virtual seconds")
    args = parser.parse_args(argv)
    pairs = pairs_of(args.pairs)
    total_events = args.pairs * args.events

    scheduler = run_scheduler(pairs, args.events, 60.0)
    baseline = run_baseline(pairs, args.events, 60.0)
    scheduler_memory = memory_per_pair(run_scheduler, pairs, args.events)
    baseline_memory = memory_per_pair(run_baseline, pairs, args.events)

    setup = scheduler["scheduler"]
    ratio = baseline["dispatched_total"] / max(1, scheduler["dispatched_total"])
    schedule_us = scheduler["in_schedule_s"] / total_events * 1e6
    result = {
        "benchmark": "setup_storm",
        "pairs": args.pairs,
        "events_per_pair": args.events,
        "events": total_events,
        "virtual_seconds": 60.0,
        "python": sys.version.split()[0],
        "scheduler": {
            "dispatched_during_storm": scheduler["dispatched_during_storm"],
            "dispatched_total": scheduler["dispatched_total"],
            "armed": setup.armed,
            "requests": setup.requests,
            "most_pending": scheduler["most_pending"],
            "schedule_us_per_event": round(schedule_us, 3),
            "storm_us_per_event": round(scheduler["storm_s"] / total_events * 1e6, 3),
            **scheduler_memory,
        },
        "baseline_timer_per_event": {
            "dispatched_during_storm": baseline["dispatched_during_storm"],
            "dispatched_total": baseline["dispatched_total"],
            "most_pending": baseline["most_pending"],
            "schedule_us_per_event": round(baseline["in_schedule_s"] / total_events * 1e6, 3),
            "storm_us_per_event": round(baseline["storm_s"] / total_events * 1e6, 3),
            **baseline_memory,
        },
        "dispatch_ratio": round(ratio, 1),
        "target": {"dispatch_ratio_min": TARGET_RATIO, "schedule_us_per_event_max": TARGET_US_PER_EVENT},
        "meets_target": ratio >= TARGET_RATIO and schedule_us <= TARGET_US_PER_EVENT,
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
