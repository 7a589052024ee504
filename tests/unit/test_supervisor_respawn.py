"""The respawn schedule in virtual time: one slot's crash loop backs off, but a respawn that would leave the node with
no live worker until it comes waits at most the floor."""

from __future__ import annotations

from replicator.coordinator.supervisor import RESPAWN_FLOOR, WorkerHandle
from tests.unit.fakeloop import VirtualTimeLoop
from tests.unit.test_supervisor_watchdog import RecordingSupervisor

KILLED = -9


class RespawnRecorder(RecordingSupervisor):
    """Respawns are recorded (and the slot comes back alive) instead of forked."""

    def __init__(self, loop: VirtualTimeLoop, slots: int) -> None:
        super().__init__(loop, slots)
        self.spawned: list[tuple[float, int]] = []

    def spawn(self, slot: int) -> WorkerHandle:
        handle = self.workers[slot]
        handle.respawn_timer = None
        handle.alive = handle.ready = True
        handle.started_at = self._loop.time()
        self.spawned.append((self._loop.time(), slot))
        return handle


def crash(loop: VirtualTimeLoop, supervisor: RespawnRecorder, slot: int) -> float:
    """The worker of `slot` dies at once after its start; returns the delay its respawn was scheduled with."""
    handle = supervisor.workers[slot]
    handle.alive = handle.ready = False
    loop.run_until_complete(supervisor._finish_exit(handle, None, KILLED, uptime=0.1))
    assert handle.respawn_timer is not None
    return handle.respawn_timer.when() - loop.time()


def test_one_slots_crash_loop_backs_off_while_another_worker_serves(loop: VirtualTimeLoop) -> None:
    supervisor = RespawnRecorder(loop, slots=2)
    delays = []
    for _ in range(6):
        delays.append(crash(loop, supervisor, 0))
        loop.advance(delays[-1])
    # Full jitter drawn at 0.5 of each ceiling: 0.5, 1, 2, 4, 8, 16 s.
    assert delays == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0]
    assert [slot for _, slot in supervisor.spawned] == [0] * 6


def test_a_respawn_that_would_leave_no_live_worker_comes_at_the_floor(loop: VirtualTimeLoop) -> None:
    supervisor = RespawnRecorder(loop, slots=2)
    for _ in range(6):
        loop.advance(crash(loop, supervisor, 0))
    long_wait = crash(loop, supervisor, 0)
    assert long_wait == 15.0  # slot 0 waits its schedule out (its ceiling at 30 s): slot 1 serves meanwhile
    started = loop.time()
    # Slot 1 dies too: nothing would serve for 15 s. Its respawn comes at the floor, each time it is the last.
    assert crash(loop, supervisor, 1) == RESPAWN_FLOOR * 0.5  # its own first draw is below the floor
    loop.advance(RESPAWN_FLOOR * 0.5)
    for _ in range(5):
        assert crash(loop, supervisor, 1) <= RESPAWN_FLOOR
        loop.advance(RESPAWN_FLOOR)
    assert supervisor.workers[1].backoff.attempts == 6  # its schedule still grew: once another serves, it backs off
    assert [slot for _, slot in supervisor.spawned[-6:]] == [1] * 6
    assert loop.time() - started < long_wait
    loop.advance(long_wait)  # slot 0 is back
    assert supervisor.spawned[-1] == (started + long_wait, 0)
    # A retiring worker is not one that serves.
    supervisor.workers[1].retiring = True
    assert crash(loop, supervisor, 0) == RESPAWN_FLOOR


def test_the_floor_does_not_apply_when_another_slot_is_alive(loop: VirtualTimeLoop) -> None:
    supervisor = RespawnRecorder(loop, slots=3)
    for _ in range(5):
        loop.advance(crash(loop, supervisor, 0))
    supervisor.workers[1].alive = False  # waiting for its own respawn
    assert crash(loop, supervisor, 0) == 8.0  # slot 2 is alive
