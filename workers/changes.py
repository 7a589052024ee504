"""Commit notification for senders: wake the tail of every stream when its database changes.

A commit can come from any process of the node (this worker's data API or apply, another worker's, the
coordinator's registry writes), and it is pushed, never polled for:

- a commit this process makes wakes the database's waiting senders directly (`Store.on_commit`), and rings the
  doorbells of the node's other processes (`shared.notify`);
- a ring from another process wakes the senders waiting on that database here.

Nothing runs while nothing is written. A ring can still be lost (a full socket queue, a process that was not bound
yet, a tool writing the file from outside the node), so a safety poll checks `PRAGMA data_version` of every
database with a waiting sender every `safety_interval` seconds: one timer per worker, not one per database.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable

from replicator.shared.notify import Doorbell
from replicator.shared.store import Database

SAFETY_INTERVAL = 1.0


class ChangeFeed:
    """The commits of one database, as the senders waiting on it see them."""

    def __init__(self, database: Database) -> None:
        self._db = database
        self._version = database.data_version()
        self._changed = asyncio.Event()
        self.waiters = 0

    def poke(self) -> None:
        """The database changed (or may have): wake every waiter."""
        self._version = self._db.data_version()
        self._wake()

    def check(self) -> bool:
        """The safety poll: wake the waiters if the file changed since the feed last looked. True if it had."""
        version = self._db.data_version()
        if version == self._version:
            return False
        self._version = version
        self._wake()
        return True

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait(self, timeout: float | None = None, *, polled: bool = True) -> None:
        """Return after the next commit to the database (or after `timeout`).

        `polled` False: this waiter does not make the safety poll look at the database. It suits a waiter with a
        slow check of its own (its `timeout`), for which a lost ring costs a late report, not a stalled stream.
        """
        changed = self._changed
        if polled:
            self.waiters += 1
        try:
            if timeout is None:
                await changed.wait()
            else:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancellation that lands as the
                # feed is woken, and the waiter (a session's holds or heads task) would never end.
                try:
                    async with asyncio.timeout(timeout):
                        await changed.wait()
                except TimeoutError:
                    pass
        finally:
            if polled:
                self.waiters -= 1

    def close(self) -> None:
        self._wake()


class ChangeFeeds:
    """One feed per database of this worker, woken by its own commits, its siblings' doorbells and a slow poll."""

    def __init__(
        self,
        open_database: Callable[[str], Database],
        *,
        doorbell: Doorbell | None = None,
        safety_interval: float | None = SAFETY_INTERVAL,
    ) -> None:
        """`safety_interval` None: no safety poll (tests of the pushed paths alone)."""
        self._open = open_database
        self._doorbell = doorbell
        self._safety_interval = safety_interval
        self._feeds: dict[str, ChangeFeed] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = 0
        self._safety: asyncio.TimerHandle | None = None
        self.caught_by_poll = 0  # commits the safety poll found that no notification had announced

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Listen on `loop` (the worker's): its doorbell, and the safety poll."""
        self._loop = loop
        self._thread = threading.get_ident()
        if self._doorbell is not None:
            self._doorbell.listen(loop, self._heard)
        self._arm_safety()

    def get(self, database: str) -> ChangeFeed:
        feed = self._feeds.get(database)
        if feed is None:
            feed = ChangeFeed(self._open(database))
            self._feeds[database] = feed
        return feed

    def committed(self, database: str) -> None:
        """A commit this process made (`Store.on_commit`, from whichever thread committed)."""
        if self._doorbell is not None:
            self._doorbell.ring(database)
        loop = self._loop
        if loop is None or threading.get_ident() == self._thread:
            self.poke(database)
        elif not loop.is_closed():
            loop.call_soon_threadsafe(self.poke, database)

    def poke(self, database: str) -> None:
        """Wake the senders waiting on `database`, if any."""
        feed = self._feeds.get(database)
        if feed is not None:
            feed.poke()

    def _heard(self, databases: set[str]) -> None:
        for database in databases:
            self.poke(database)

    def _arm_safety(self) -> None:
        if self._loop is not None and self._safety_interval is not None:
            self._safety = self._loop.call_later(self._safety_interval, self._safety_poll)

    def _safety_poll(self) -> None:
        try:
            for feed in list(self._feeds.values()):
                try:
                    if feed.waiters and feed.check():
                        self.caught_by_poll += 1
                except sqlite3.Error:
                    continue  # a file being closed for removal: its feed is discarded with it
        finally:
            self._arm_safety()

    def take_caught_by_poll(self) -> int:
        """Commits the safety poll found since the last call (`replicator_commits_caught_by_poll_total`)."""
        caught, self.caught_by_poll = self.caught_by_poll, 0
        return caught

    async def discard(self, database: str) -> None:
        """Close the feed of a database this worker closes (it is being removed); its waiters wake."""
        feed = self._feeds.pop(database, None)
        if feed is not None:
            feed.close()

    async def close(self) -> None:
        if self._safety is not None:
            self._safety.cancel()
            self._safety = None
        if self._doorbell is not None:
            self._doorbell.close()
        for feed in self._feeds.values():
            feed.close()
        self._feeds.clear()
