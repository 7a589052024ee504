"""The supervisor: worker processes, one duplex pipe each, exits watched, respawns paced.

Workers are forked by the worker template (coordinator.template) when the node has one, so that they share the
coordinator's imported code; otherwise, or once the template is lost, they are started with the spawn context.
Either way a worker is a child of the coordinator, and its exit code reads as multiprocessing's (the status, or
minus the signal that killed it).

A worker that exits is respawned on the one backoff schedule (0.5 -> 30 s, full jitter), reset once a worker stayed
up for RESPAWN_HEALTHY_UPTIME; a crash loop therefore slows down instead of spinning. The schedule protects the
node from one slot's crash loop, never at the cost of serving nothing: a respawn that would leave the node with no
live worker until it comes waits at most RESPAWN_FLOOR (a node whose every worker crash-loops forks about two a
second, the one that is due; the others keep their schedules). A worker that exits with
EXIT_BOOT_ERROR cannot start at all (port, certificates, data directory): respawning it would fail the same way,
so the supervisor stops and reports why.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import socket
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

import msgspec

from replicator.coordinator.template import StartRefused, TemplateLost, WorkerTemplate
from replicator.shared import messages
from replicator.shared.backoff import Backoff
from replicator.shared.logs import log
from replicator.shared.notify import Doorbell
from replicator.workers.main import EXIT_BOOT_ERROR, worker_entry

RESPAWN_HEALTHY_UPTIME = 10.0
RESPAWN_FLOOR = 0.5  # the schedule's first step: the respawn delay while no other worker is alive
# The coordinator's own loop ticks this often; a tick later than PAUSE_SLACK past its time is not load: the loop
# did not run (the process was stopped, its container frozen, its host suspended, or the loop blocked).
PAUSE_TICK = 1.0
PAUSE_SLACK = 1.0


class PauseMonitor:
    """How long this process's event loop was not running, so workers are not judged by time their judge was absent.

    After a SIGSTOP of the whole node, every worker looks silent for as long as the stop lasted, and the heartbeat
    watchdog would kill healthy workers. A tick every `interval` measures each stretch the loop did not run (beyond
    `slack` late); `take()` measures too, since after a stop the reconcile pass may run before the overdue tick.
    """

    def __init__(
        self, loop: asyncio.AbstractEventLoop, *, interval: float = PAUSE_TICK, slack: float = PAUSE_SLACK
    ) -> None:
        self._loop = loop
        self._interval = interval
        self._slack = slack
        self._last: float | None = None  # when the loop was last seen running; None while not started
        self._absent = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self.close()
        self._last = self._loop.time()
        self._timer = self._loop.call_later(self._interval, self._tick)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._last = None

    def take(self) -> float:
        """Seconds the loop was not running since the last take (0.0 when it ran on time, or is not watched)."""
        self._note()
        absent, self._absent = self._absent, 0.0
        return absent

    def _tick(self) -> None:
        self._note()
        self._timer = self._loop.call_later(self._interval, self._tick)

    def _note(self) -> None:
        if self._last is None:
            return
        now = self._loop.time()
        late = now - self._last - self._interval
        if late > self._slack:
            self._absent += late
        self._last = now


async def wait_until(condition: Callable[[], bool], changed: asyncio.Event, timeout: float) -> bool:
    """Wait until `condition()` holds, re-checking each time `changed` is set; False when `timeout` ran out."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not condition():
        left = end - loop.time()
        if left <= 0:
            return False
        changed.clear()
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancellation that lands as the event
            # is set.
            async with asyncio.timeout(left):
                await changed.wait()
        except TimeoutError:
            return condition()
    return True


class WorkerProcess(Protocol):
    """A running worker process, forked (coordinator.template.ForkedWorker) or spawned (SpawnedWorker)."""

    @property
    def pid(self) -> int: ...

    @property
    def sentinel(self) -> int:
        """A descriptor that turns readable once the process has exited."""
        ...

    def kill(self) -> None: ...

    def reap(self) -> int | None:
        """The exit code, once the sentinel is readable: the status, or minus the signal that killed it."""
        ...

    def close(self) -> None: ...


class SpawnedWorker:
    """A worker started with multiprocessing's spawn context."""

    def __init__(self, process: BaseProcess) -> None:
        self._process = process
        self.pid = process.pid or 0
        self.sentinel = process.sentinel

    def kill(self) -> None:
        self._process.kill()

    def reap(self) -> int | None:
        self._process.join(timeout=1.0)
        return self._process.exitcode

    def close(self) -> None:
        self._process.close()


class WorkerHandle:
    def __init__(self, slot: int, rng: Callable[[], float], clock: Callable[[], float]) -> None:
        self.slot = slot
        self.process: WorkerProcess | None = None
        self.pid = 0
        self.ready = False
        self.alive = False
        self.restarts = 0
        self.started_at = 0.0
        self.last_heartbeat = 0.0
        self.rss_bytes = 0
        self.exit_code: int | None = None
        self.boot_error = ""
        self.retiring = False
        self.writer: asyncio.StreamWriter | None = None
        self.reader_task: asyncio.Task[None] | None = None
        self.respawn_timer: asyncio.TimerHandle | None = None
        self.backoff = Backoff(initial=0.5, maximum=30.0, jitter="full", rng=rng, clock=clock)


class Supervisor:
    def __init__(
        self,
        config_bytes: Callable[[], bytes],
        on_message: Callable[[int, Any], None],
        on_exit: Callable[[WorkerHandle], None],
        on_boot_error: Callable[[WorkerHandle], None],
        *,
        loop: asyncio.AbstractEventLoop,
        rng: Callable[[], float],
        template: WorkerTemplate | None = None,
    ) -> None:
        self._config_bytes = config_bytes  # a worker's start, made at each spawn (messages.WorkerBoot)
        self._on_message = on_message
        self._on_exit = on_exit
        self._on_boot_error = on_boot_error
        self._loop = loop
        self._rng = rng
        self._context = multiprocessing.get_context("spawn")
        self.workers: dict[int, WorkerHandle] = {}
        self.stopping = False
        self._exit_seen = asyncio.Event()
        self._finishing: set[asyncio.Task[None]] = set()
        self.respawns = 0  # over the node's life, retired slots included: the restarts counter reads it
        # The coordinator's commit doorbell (shared.notify): it rings the workers the supervisor runs.
        self.doorbell: Doorbell | None = None
        # The process that forks workers (coordinator.template), owned by whoever started it; None: spawn them.
        self.template = template
        if template is not None:
            self._loop.add_reader(template.sentinel, self._template_exited)

    # -- queries ------------------------------------------------------------------------------------------------

    def live(self) -> list[int]:
        """Slots whose worker is running and ready to take subscriptions, in slot order."""
        return [slot for slot, w in sorted(self.workers.items()) if w.alive and w.ready and not w.retiring]

    def is_live(self, slot: int | None) -> bool:
        worker = self.workers.get(slot) if slot is not None else None
        return worker is not None and worker.alive and not worker.retiring

    def all_ready(self) -> bool:
        active = [w for w in self.workers.values() if not w.retiring]
        return bool(active) and all(w.alive and w.ready for w in active)

    # -- lifecycle ----------------------------------------------------------------------------------------------

    def start(self, count: int) -> None:
        for slot in range(count):
            self.spawn(slot)

    def spawn(self, slot: int) -> WorkerHandle:
        handle = self.workers.get(slot)
        if handle is None:
            handle = WorkerHandle(slot, self._rng, self._loop.time)
            self.workers[slot] = handle
        elif handle.alive:
            return handle
        handle.respawn_timer = None
        config = self._config_bytes()
        process, sock = self._fork(slot, config) or self._spawn(slot, config)
        handle.process = process
        handle.pid = process.pid
        handle.alive = True
        handle.ready = False
        handle.exit_code = None
        handle.started_at = self._loop.time()
        handle.last_heartbeat = handle.started_at
        handle.reader_task = self._loop.create_task(self._serve_pipe(handle, sock), name=f"pipe {slot}")
        self._loop.add_reader(process.sentinel, self._exited, handle)
        log.info("worker_started", worker=slot, pid=handle.pid)
        self._announce_siblings()
        return handle

    def _fork(self, slot: int, config: bytes) -> tuple[WorkerProcess, socket.socket] | None:
        """A worker forked by the template, and the coordinator's end of its pipe; None without a template."""
        template = self.template
        if template is None:
            return None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            return template.start_worker(slot, config, theirs), ours
        except TemplateLost as exc:
            ours.close()
            self._lose_template(str(exc))
        except StartRefused as exc:
            ours.close()
            log.warning("worker_fork_failed", worker=slot, reason=str(exc))
        finally:
            theirs.close()
        return None

    def _spawn(self, slot: int, config: bytes) -> tuple[WorkerProcess, socket.socket]:
        parent, child = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=worker_entry,
            args=(slot, config, child),
            name=f"replicator-worker-{slot}",
        )
        process.start()
        child.close()
        sock = socket.socket(fileno=os.dup(parent.fileno()))
        parent.close()
        return SpawnedWorker(process), sock

    def _template_exited(self) -> None:
        self._lose_template("exited")

    def _lose_template(self, reason: str) -> None:
        """The template is gone (or wedged, then killed): workers are spawned from now on. A new template would
        have to be forked from this process, whose threads and loop make a fork unsafe."""
        template = self.template
        if template is None:
            return
        self.template = None
        self._loop.remove_reader(template.sentinel)
        code = template.reap()
        level = "info" if self.stopping else "warning"
        log.emit(level, "worker_template_lost", {"pid": template.pid, "code": code, "reason": reason})

    def _announce_siblings(self) -> None:
        """Tell every worker, and the coordinator's doorbell, which worker processes run now (shared.notify)."""
        pids = sorted(w.pid for w in self.workers.values() if w.alive and w.pid)
        if self.doorbell is not None:
            self.doorbell.set_siblings(pids)
        for slot in list(self.workers):
            self.send(slot, messages.Siblings(pids=pids))

    async def _serve_pipe(self, handle: WorkerHandle, sock: socket.socket) -> None:
        reader, writer = await asyncio.open_connection(sock=sock)
        handle.writer = writer
        try:
            while True:
                message = await messages.read_to_coordinator(reader)
                self._note(handle, message)
                self._on_message(handle.slot, message)
        except (messages.PipeClosed, ConnectionError):
            # ConnectionError: a write to a worker that was exiting (a Siblings announcement when another worker
            # exits) broke the pipe, and its reader hears of it: the pipe ended all the same.
            pass
        except messages.PipeProtocolError as exc:
            log.error("pipe_protocol_error", worker=handle.slot, error=str(exc))
            self.kill(handle.slot)
        finally:
            writer.close()
            handle.writer = None

    def _note(self, handle: WorkerHandle, message: messages.ToCoordinator) -> None:
        """What the supervisor itself keeps of a worker's reports: liveness, readiness, why it could not boot."""
        match message:
            case messages.Heartbeat(rss_bytes=rss):
                handle.last_heartbeat = self._loop.time()
                handle.rss_bytes = rss
            case messages.Ready(pid=pid):
                handle.ready = True
                handle.pid = pid
                handle.last_heartbeat = self._loop.time()
                self._announce_siblings()  # its pipe is open now: it hears the set too
            case messages.BootFailed(reason=reason):
                handle.boot_error = reason

    def send(self, slot: int, message: msgspec.Struct) -> bool:
        """Queue a message for a worker; False when it cannot be delivered (no such worker, or it is gone)."""
        handle = self.workers.get(slot)
        if handle is None or not handle.alive or handle.writer is None or handle.writer.is_closing():
            return False
        try:
            handle.writer.write(messages.frame(message))
        except (ConnectionError, RuntimeError):
            return False
        return True

    def excuse(self, seconds: float) -> None:
        """The coordinator was not running for `seconds`: no worker's silence over that time counts against it."""
        now = self._loop.time()
        for handle in self.workers.values():
            if handle.alive:
                handle.last_heartbeat = min(now, handle.last_heartbeat + seconds)

    @staticmethod
    def _terminate(handle: WorkerHandle) -> None:
        if handle.alive and handle.process is not None:
            try:
                os.kill(handle.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass  # exited meanwhile: the sentinel reports it

    def kill(self, slot: int) -> None:
        handle = self.workers.get(slot)
        if handle is not None and handle.alive and handle.process is not None:
            handle.process.kill()

    def _exited(self, handle: WorkerHandle) -> None:
        process = handle.process
        assert process is not None
        self._loop.remove_reader(process.sentinel)
        code = process.reap()
        process.close()
        handle.process = None
        handle.alive = False
        handle.ready = False
        handle.exit_code = code
        uptime = self._loop.time() - handle.started_at
        self._exit_seen.set()
        self._announce_siblings()
        level = "info" if self.stopping or handle.retiring else "warning"
        log.emit(
            level,
            "worker_exited",
            {"worker": handle.slot, "pid": handle.pid, "code": code, "uptime_s": round(uptime, 3)},
        )
        # What the worker wrote before it died (its boot error, its last counters) is still in the pipe: finish
        # the exit once the pipe is read to its end, which the process's death makes immediate.
        task = self._loop.create_task(self._finish_exit(handle, handle.reader_task, code, uptime))
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)

    async def _finish_exit(
        self, handle: WorkerHandle, reader: asyncio.Task[None] | None, code: int | None, uptime: float
    ) -> None:
        if reader is not None:
            try:
                async with asyncio.timeout(2.0):  # not wait_for: see wait_until
                    await asyncio.shield(reader)
            except TimeoutError:
                reader.cancel()
        self._exit_seen.set()
        self._on_exit(handle)
        if handle.retiring:
            del self.workers[handle.slot]  # scaled down: the slot is gone, not waiting for a respawn
            return
        if self.stopping:
            return
        if code == EXIT_BOOT_ERROR:
            handle.boot_error = handle.boot_error or "the worker could not boot"
            self._on_boot_error(handle)
            return
        if uptime >= RESPAWN_HEALTHY_UPTIME:
            handle.backoff.reset()
        delay = handle.backoff.next_delay()
        assert delay is not None  # the respawn schedule never exhausts
        alone = not any(w.alive for w in self.workers.values() if w is not handle and not w.retiring)
        if alone:
            delay = min(delay, RESPAWN_FLOOR)  # no other worker serves meanwhile
        log.info("worker_respawn_scheduled", worker=handle.slot, delay_s=round(delay, 4), none_alive=alone)
        handle.restarts += 1
        self.respawns += 1
        handle.respawn_timer = self._loop.call_later(delay, self.spawn, handle.slot)

    async def _wait_all_exited(self, timeout: float) -> None:
        await wait_until(lambda: not any(w.alive for w in self.workers.values()), self._exit_seen, timeout)

    def retire(self, slot: int, deadline: float) -> None:
        """Scale down: stop this worker for good (its pairs are moved by the caller first)."""
        handle = self.workers.get(slot)
        if handle is None:
            return
        handle.retiring = True
        if handle.respawn_timer is not None:
            handle.respawn_timer.cancel()
            handle.respawn_timer = None
        if handle.alive:
            self.send(slot, messages.Shutdown(deadline=deadline))
            self._loop.call_later(deadline + 1.0, self.kill, slot)

    def forget(self, slot: int) -> None:
        handle = self.workers.get(slot)
        if handle is not None and not handle.alive:
            del self.workers[slot]

    async def stop(self, deadline: float) -> None:
        """Drain every worker within the deadline; kill what is left."""
        self.stopping = True
        for handle in self.workers.values():
            if handle.respawn_timer is not None:
                handle.respawn_timer.cancel()
                handle.respawn_timer = None
            if not self.send(handle.slot, messages.Shutdown(deadline=max(0.5, deadline - 1.0))):
                # Its pipe is not served yet (just spawned): SIGTERM drains it the same way.
                self._terminate(handle)
        await self._wait_all_exited(deadline)
        for handle in self.workers.values():
            if handle.alive and handle.process is not None:
                log.warning("worker_killed_at_shutdown", worker=handle.slot, pid=handle.pid)
                handle.process.kill()
        await self._wait_all_exited(2.0)
        await asyncio.gather(*self._finishing, return_exceptions=True)
        tasks = [w.reader_task for w in self.workers.values() if w.reader_task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.template is not None:
            # The template itself is its owner's to close (the command line's); the supervisor stops watching it.
            self._loop.remove_reader(self.template.sentinel)
            self.template = None
