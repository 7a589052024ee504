"""Commit notification for senders: wake the tail of every stream when its database changes.

A commit can come from any process of the node (another worker's data API, another worker's apply, the
coordinator's registry writes), so a local event is not enough. `PRAGMA data_version` moves whenever another
connection commits and costs no disk read, so one poller per database per worker checks it every `interval`
while any sender waits; a commit made through this worker pokes the feed and wakes its waiters at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from replicator.shared.store import Database


class ChangeFeed:
    def __init__(self, database: Database, interval: float = 0.005) -> None:
        self._db = database
        self._interval = interval
        self._version = database.data_version()
        self._changed = asyncio.Event()
        self._waiters = 0
        self._poller: asyncio.Task[None] | None = None

    def poke(self) -> None:
        """A commit made by this process."""
        self._version = self._db.data_version()
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait(self, timeout: float | None = None) -> None:
        """Return after the next commit to the database (or after `timeout`)."""
        changed = self._changed
        self._waiters += 1
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll())
        try:
            if timeout is None:
                await changed.wait()
            else:
                try:
                    await asyncio.wait_for(changed.wait(), timeout)
                except TimeoutError:
                    pass
        finally:
            self._waiters -= 1

    async def _poll(self) -> None:
        # Stops by itself once nobody waits, so an idle database costs nothing.
        while self._waiters > 0:
            await asyncio.sleep(self._interval)
            version = self._db.data_version()
            if version != self._version:
                self._version = version
                self._wake()

    async def close(self) -> None:
        if self._poller is not None and not self._poller.done():
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        self._wake()


class ChangeFeeds:
    """One feed per database of this worker."""

    def __init__(self, open_database: Callable[[str], Database], interval: float = 0.005) -> None:
        self._open = open_database
        self._interval = interval
        self._feeds: dict[str, ChangeFeed] = {}

    def get(self, database: str) -> ChangeFeed:
        feed = self._feeds.get(database)
        if feed is None:
            feed = ChangeFeed(self._open(database), self._interval)
            self._feeds[database] = feed
        return feed

    def poke(self, database: str) -> None:
        feed = self._feeds.get(database)
        if feed is not None:
            feed.poke()

    async def discard(self, database: str) -> None:
        """Close the feed of a database this worker closes (it is being removed); its waiters wake."""
        feed = self._feeds.pop(database, None)
        if feed is not None:
            await feed.close()

    async def close(self) -> None:
        for feed in self._feeds.values():
            await feed.close()
        self._feeds.clear()
