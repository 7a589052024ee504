"""The heartbeat watchdog in virtual time: a silent worker is killed at the exact time, but time the coordinator itself
did not run (the whole node SIGSTOPped, a frozen container) never counts as the workers' silence.

A stop is simulated by moving the virtual clock without running anything (`freeze`), then letting every overdue
callback run at once, as a process does after SIGCONT.
"""

from __future__ import annotations

import asyncio
from typing import Any

from replicator.coordinator.node import Node
from replicator.coordinator.supervisor import PauseMonitor, Supervisor, WorkerHandle
from replicator.shared import messages
from replicator.shared.config import from_mapping
from tests.unit.fakeloop import VirtualTimeLoop

TIMEOUT = 10.0  # replication.heartbeat_timeout
RECONCILE = 1.0


def freeze(loop: VirtualTimeLoop, seconds: float) -> None:
    """The process is stopped for `seconds`: its clock moves on and nothing runs; then everything overdue runs."""
    loop._now += seconds  # type: ignore[attr-defined]
    loop.advance(0)


class RecordingSupervisor(Supervisor):
    """The real supervisor's bookkeeping with workers that are not processes: kills are recorded, not done."""

    def __init__(self, loop: VirtualTimeLoop, slots: int) -> None:
        super().__init__(lambda: b"", _ignore, _ignore, _ignore, loop=loop, rng=lambda: 0.5)
        self.killed: list[tuple[float, int]] = []
        for slot in range(slots):
            handle = WorkerHandle(slot, lambda: 0.5, loop.time)
            handle.alive = handle.ready = True
            handle.pid = 1000 + slot
            self.workers[slot] = handle

    def kill(self, slot: int) -> None:
        self.killed.append((self._loop.time(), slot))
        self.workers[slot].alive = False


def _ignore(*args: Any) -> None:
    pass


class Workers:
    """Each worker heartbeats every second through the supervisor's own bookkeeping, unless hung or stopped."""

    def __init__(self, loop: VirtualTimeLoop, supervisor: RecordingSupervisor) -> None:
        self.loop = loop
        self.supervisor = supervisor
        self.hung: set[int] = set()
        self.stopped = False
        self.task = loop.create_task(self._beat())

    async def _beat(self) -> None:
        while True:
            if not self.stopped:
                for slot, handle in self.supervisor.workers.items():
                    if handle.alive and slot not in self.hung:
                        self.supervisor._note(handle, messages.Heartbeat(worker=slot, rss_bytes=0))
            await asyncio.sleep(1.0)


def make(loop: VirtualTimeLoop, slots: int = 2) -> tuple[Node, RecordingSupervisor, Workers]:
    config = from_mapping(
        {
            "node": {"name": "self", "url": "wss://127.0.0.1:1000"},
            "replication": {"heartbeat_timeout": TIMEOUT, "reconcile_interval": RECONCILE},
        },
        "",
    )
    supervisor = RecordingSupervisor(loop, slots)
    node = Node(config, loop=loop, rng=lambda: 0.5, supervisor=supervisor)
    workers = Workers(loop, supervisor)
    node.pauses.start()
    loop.create_task(node._reconcile_loop())
    return node, supervisor, workers


# -- the pause monitor -----------------------------------------------------------------------------------------------


def test_a_loop_that_runs_on_time_was_never_absent(loop: VirtualTimeLoop) -> None:
    monitor = PauseMonitor(loop, interval=1.0, slack=1.0)
    assert monitor.take() == 0.0  # not started: nothing is watched
    monitor.start()
    loop.advance(100.0)
    assert monitor.take() == 0.0


def test_a_stop_is_measured_by_the_overdue_tick(loop: VirtualTimeLoop) -> None:
    monitor = PauseMonitor(loop, interval=1.0, slack=1.0)
    monitor.start()
    loop.advance(10.0)  # ticks at 1, 2, ..., 10
    freeze(loop, 30.0)  # the tick due at 11 runs at 40
    assert loop.time() == 40.0
    assert monitor.take() == 29.0
    assert monitor.take() == 0.0  # taken once
    loop.advance(5.0)
    assert monitor.take() == 0.0


def test_take_measures_a_stop_before_the_overdue_tick_runs(loop: VirtualTimeLoop) -> None:
    monitor = PauseMonitor(loop, interval=1.0, slack=1.0)
    monitor.start()
    loop.advance(10.5)
    loop._now += 20.0  # type: ignore[attr-defined]  # stopped; the first thing to run after is the take
    assert monitor.take() == 19.5
    loop.advance(0)  # the overdue tick, right after: the same stop is not counted twice
    assert monitor.take() == 0.0


def test_lateness_within_the_slack_is_load_not_absence(loop: VirtualTimeLoop) -> None:
    monitor = PauseMonitor(loop, interval=1.0, slack=1.0)
    monitor.start()
    loop.advance(10.5)
    freeze(loop, 1.4)  # the tick due at 11 runs at 11.9: 0.9 late
    assert monitor.take() == 0.0
    freeze(loop, 2.5)  # the tick due at 12.9 runs at 14.4: 1.5 late
    assert monitor.take() == 1.5


def test_close_cancels_the_tick(loop: VirtualTimeLoop) -> None:
    monitor = PauseMonitor(loop)
    monitor.start()
    assert len(loop.pending_timers()) == 1
    monitor.close()
    assert loop.pending_timers() == []
    freeze(loop, 60.0)
    assert monitor.take() == 0.0


# -- the watchdog --------------------------------------------------------------------------------------------------


def test_a_hung_worker_is_killed_once_silent_longer_than_the_timeout(loop: VirtualTimeLoop) -> None:
    _, supervisor, workers = make(loop)
    loop.advance(5.0)  # the last heartbeat of worker 1 is at 5.0
    workers.hung.add(1)
    loop.advance(10.0)
    assert supervisor.killed == []  # at 15.0 it has been silent 10 s: not more than the timeout
    loop.advance(1.0)
    assert supervisor.killed == [(16.0, 1)]


def test_a_stopped_node_kills_none_of_its_workers(loop: VirtualTimeLoop) -> None:
    _, supervisor, workers = make(loop)
    loop.advance(5.5)
    workers.stopped = True  # SIGSTOP of the process group: the coordinator and every worker
    freeze(loop, 3 * TIMEOUT)
    workers.stopped = False  # SIGCONT
    loop.advance(3 * TIMEOUT)
    assert supervisor.killed == []
    assert all(handle.alive for handle in supervisor.workers.values())


def test_a_worker_hung_across_a_stop_is_still_killed_for_its_own_silence(loop: VirtualTimeLoop) -> None:
    _, supervisor, workers = make(loop)
    loop.advance(5.0)  # worker 1's last heartbeat is at 5.0
    workers.hung.add(1)
    loop.advance(3.5)
    workers.stopped = True
    # Stopped at 8.5, continued at 38.5: the tick last ran at 8.0, so the stop measured is 38.5 - 8.0 - 1.0 = 29.5 s,
    # which every worker gets back. Worker 1 counts as silent since 5.0 + 29.5 = 34.5.
    freeze(loop, 30.0)
    workers.stopped = False
    assert supervisor.killed == []
    assert supervisor.workers[1].last_heartbeat == 34.5
    loop.advance(6.0)  # the reconcile passes run at 39.5, 40.5, ..., 44.5: silent 10 s at most
    assert supervisor.killed == []
    loop.advance(1.0)
    assert supervisor.killed == [(45.5, 1)]
    assert supervisor.workers[0].alive
