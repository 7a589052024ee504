"""Deleting databases on this node: the markers of `system.dropped` (`shared.dropped`) applied to its own files.

    markers' floors, file not purged through them  -> the records they cover go (Database.drop_through)
    marker, and the file holds no record at all     -> the database is removed from this node:
        block it in this process (Store.block) and drop its pairs with every peer
        DropDatabase to every worker process         -> each ends the database's sessions, inbound and outbound,
                                                        closes its handle and opens it no more
        every live worker answered DatabaseClosed   -> still empty? unlink the file with its -wal and -shm
        ReleaseDatabase to every worker; the node no longer holds, advertises, recovers or scrubs it

Every process must have closed the file before it is unlinked: one still holding it would write on into the
unlinked copy, or leave its WAL beside a new file of the same name. While a removal runs (milliseconds; at most
REMOVAL_TIMEOUT) no process of the node opens the database, so a write to it in that window is answered 503, try
again. A worker that does not answer in time leaves the file in place, and a later pass tries again.

The pass runs whenever the system database changes and every reconcile interval. A database written to after its
deletion holds records the floors do not cover and stays. A node that held the database while it was down purges it when
the marker reaches it; meanwhile its peers' subscriptions to it create nothing (`workers.dropped`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from replicator.coordinator.view import DropsView
from replicator.shared import dropped, messages
from replicator.shared.deletion import DeletionFloors
from replicator.shared.logs import log
from replicator.shared.store import SYSTEM, UnknownDatabase

# How long a removal waits for every worker to close the database before it leaves the file for a later pass.
REMOVAL_TIMEOUT = 20.0
# How often a DropDatabase that could not be delivered (a worker still starting) is offered again.
RESEND = 0.1


class NotHeld(LookupError):
    """A deletion asked of a node that holds no file of the database: it has seen nothing of it to delete."""

    def __init__(self, name: str) -> None:
        super().__init__(f"this node holds no file of database {name!r}: ask a node that holds it")
        self.name = name


class Drops:
    """The deletion markers applied on this node, and the removals they lead to; owned by the node."""

    def __init__(
        self,
        node: DropsView,
        *,
        loop: asyncio.AbstractEventLoop,
        to_thread: Callable[..., Awaitable[Any]] = asyncio.to_thread,
        removal_timeout: float = REMOVAL_TIMEOUT,
    ) -> None:
        """`to_thread(function, *args)` runs a database call off the loop (tests pass an inline runner)."""
        self._node = node
        self._loop = loop
        self._to_thread = to_thread
        self._removal_timeout = removal_timeout
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._requests = 0
        # Removal number -> the worker processes (slot, pid) that answered DatabaseClosed.
        self._closed: dict[int, set[tuple[int, int]]] = {}
        self._answered = asyncio.Event()
        self.removing: set[str] = set()  # databases whose removal runs: no pair is set up for them meanwhile

    def start(self) -> None:
        if self._task is None:
            self._task = self._loop.create_task(self._run(), name="database drops")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def poke(self) -> None:
        """The system database changed: look at the markers again."""
        self._wake.set()

    def on_closed(self, slot: int, message: messages.DatabaseClosed) -> None:
        closed = self._closed.get(message.request)
        if closed is not None:
            closed.add((slot, message.pid))
            self._answered.set()

    # -- the admin request -----------------------------------------------------------------------------------

    def known(self, name: str) -> bool:
        """Does this node hold `name`, or does any node of the registry say it does?"""
        node = self._node
        if name in node.holds or (node.store is not None and node.store.path(name).exists()):
            return True
        return any(name in view.holds for view in node.views.values())

    def request(self, name: str) -> tuple[int, dict[str, int]]:
        """Delete `name` cluster-wide: write this node's marker; returns its version and floors. Every node applies
        it, this one first.

        The floors are what this node holds of the database, per origin (the newest version of each): the deletion
        removes what this node had seen and nothing else, so a write acknowledged anywhere after it returned (by a
        node cut off at the time, say) survives it, whatever the clocks say (invariant 20). NotHeld when this node
        holds no file of the database: it has seen nothing of it to delete.
        """
        node = self._node
        store = node.store
        if store is None or not store.path(name).exists():
            raise NotHeld(name)
        try:
            held = store.database(name).origins()
        except UnknownDatabase:
            raise NotHeld(name) from None  # being removed here already
        floors = dropped.seen(held)
        version = dropped.write(node.system(), name, requested_by=node.name, at=node.wall(), floors=floors)
        log.info("database_delete_requested", database=name, marker=version, floors=floors)
        self.poke()
        return version, floors

    # -- applying the markers ----------------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            try:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancellation that lands as the
                # event is set, and close() would wait forever.
                async with asyncio.timeout(self._node.config.replication.reconcile_interval):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.apply()
            except Exception as exc:  # the markers could not be read: the next change or interval tries again
                log.warning("database_drop_failed", database="", error=repr(exc), sample_by=())

    async def apply(self) -> list[dict[str, Any]]:
        """One pass over the markers; returns what it did (the `database_dropped` events it logged)."""
        store = self._node.store
        if store is None:
            return []
        done: list[dict[str, Any]] = []
        for name, floor in sorted(dropped.floors(self._node.system()).items()):
            if not store.path(name).exists():
                continue
            try:
                event = await self._apply_one(name, floor)
            except Exception as exc:  # one database's failure (a disk error) does not hold up the others
                log.warning("database_drop_failed", database=name, error=repr(exc), sample_by=("database",))
                continue
            if event is not None:
                log.info("database_dropped", **event)
                done.append(event)
        return done

    async def _apply_one(self, name: str, floors: DeletionFloors) -> dict[str, Any] | None:
        store = self._node.store
        assert store is not None
        try:
            db = store.database(name)
        except UnknownDatabase:
            return None  # removed since the listing
        records = 0
        purging = not floors.within(db.dropped_purged)
        own = floors.floor_of(self._node.name)
        if purging and db.regress(own, by_deletion=True):
            # The deletion saw more of this node's writes than this file holds: the file went back in time (or its
            # clock did), and what it wrote since must not fall under a deletion that never saw it.
            log.warning("database_regressed", peer="", database=name, floor=own, reason="deletion floor")
            self._node.database_regressed(name, own)
        if purging:
            # Off the loop: a large database is walked in chunks, each a transaction of its own.
            records = await self._to_thread(db.drop_through, floors)
        removed = dropped.left_empty(db, floors) and await self._remove(name)
        if not (purging or removed):
            return None
        shown = dict(sorted(floors.origins.items()))
        event = {"database": name, "floors": shown, "removed": removed, "records_removed": records}
        if floors.every:
            event["every"] = floors.every  # a marker of an earlier version: every origin up to it
        return event

    async def _remove(self, name: str) -> bool:
        """Remove the empty database `name` from this node; True when its file is gone."""
        node = self._node
        store = node.store
        assert store is not None and name != SYSTEM
        self._requests += 1
        request = self._requests
        self._closed[request] = set()
        self.removing.add(name)
        store.block(name)
        removed = False
        try:
            # The sessions' Unsubscribe goes down each pipe ahead of the DropDatabase.
            node.drop_database_pairs(name)
            if await self._close_everywhere(name, request):
                removed = store.remove(name)
            else:
                log.warning(
                    "database_removal_deferred",
                    database=name,
                    reason=f"not every worker closed it within {self._removal_timeout:g} s; tried again later",
                    sample_by=("database",),
                )
        finally:
            del self._closed[request]
            self.removing.discard(name)
            store.unblock(name)
            supervisor = node.supervisor
            for slot, handle in sorted(supervisor.workers.items()):
                if handle.alive:
                    supervisor.send(slot, messages.ReleaseDatabase(database=name, request=request))
        if removed:
            node.on_database_removed(name)
        else:
            node.poke_registry()  # the pairs of a database kept here are set up again
        return removed

    async def _close_everywhere(self, name: str, request: int) -> bool:
        """Ask every worker process to close `name` and wait until each live one has; False after the deadline. A
        worker that exits meanwhile closed it by exiting; one started meanwhile is asked too."""
        supervisor = self._node.supervisor
        closed = self._closed[request]
        asked: set[tuple[int, int]] = set()
        try:
            async with asyncio.timeout_at(self._loop.time() + self._removal_timeout):
                while True:
                    waiting = [
                        (slot, handle.pid)
                        for slot, handle in sorted(supervisor.workers.items())
                        if handle.alive and (slot, handle.pid) not in closed
                    ]
                    if not waiting:
                        return True
                    for slot, pid in waiting:
                        if (slot, pid) not in asked and supervisor.send(
                            slot, messages.DropDatabase(database=name, request=request)
                        ):
                            asked.add((slot, pid))
                    self._answered.clear()
                    try:
                        async with asyncio.timeout(RESEND):  # not wait_for: see _run
                            await self._answered.wait()
                    except TimeoutError:
                        pass
        except TimeoutError:
            return False
