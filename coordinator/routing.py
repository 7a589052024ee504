"""Route selection: which origins each (peer, database) subscription carries.

Every write is tagged with its origin (the node that made it), and a subscription names the origins it does
*not* want from that peer (`exclude`); the sender serves every other origin it holds, from where the receiver
says it is complete. The receiver's progress is per origin, not per link, so moving an origin from one link to
another never skips or repeats an entry (a repeat is an identity tie, skipped by last-writer-wins).

The rule, per database, for an origin O that is a direct peer of this node (we dial O for that database):

    DIRECT       O comes only from O's own link; every other pair excludes O.
                 Entered at first sight, and again once O's link is connected and caught up.
    FAILED_OVER  O's link has been down (or never up) for `failover_after`: every connected pair carries O,
                 so whichever peer holds O's writes passes them on.

Every origin that is not a direct peer (a node behind another, a dead or removed node, an origin never heard
of) is carried by every pair, and so is this node's own origin (peers send back what a lost file is missing;
in steady state there is nothing to send). In a full mesh with every link up each origin therefore arrives once
per receiving node; along a line, each hop relays what is not direct for the next.

The router owns one failover timer per (database, origin) and cancels it whenever the state it was armed for
changes; `forget` and `close` cancel everything.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from dataclasses import dataclass


class Mode(enum.Enum):
    DIRECT = "direct"
    FAILED_OVER = "failed_over"


@dataclass
class Link:
    """This node's direct link to one origin for one database, as its subscription reports it."""

    mode: Mode = Mode.DIRECT
    up: bool = False
    caught_up: bool = False
    down_since: float = 0.0
    changed_at: float = 0.0
    timer: asyncio.TimerHandle | None = None

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class Router:
    def __init__(
        self,
        failover_after: float,
        on_change: Callable[[str], None],
        *,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.failover_after = failover_after
        self._on_change = on_change
        self._loop = loop
        self._links: dict[str, dict[str, Link]] = {}

    # -- what the node asks --------------------------------------------------------------------------------------

    def exclude(self, database: str, peer: str) -> list[str]:
        """The origins the subscription to `peer` for `database` must not carry: the other direct peers whose
        own links serve them."""
        links = self._links.get(database, {})
        return sorted(origin for origin, link in links.items() if origin != peer and link.mode is Mode.DIRECT)

    def mode(self, database: str, origin: str) -> Mode | None:
        link = self._links.get(database, {}).get(origin)
        return link.mode if link is not None else None

    def failed_over(self) -> dict[str, list[str]]:
        """Per database, the direct peers whose origins are currently carried by everyone."""
        routes = {
            database: sorted(origin for origin, link in links.items() if link.mode is Mode.FAILED_OVER)
            for database, links in self._links.items()
        }
        return {database: origins for database, origins in routes.items() if origins}

    # -- what the node tells -------------------------------------------------------------------------------------

    def track(self, database: str, peer: str) -> bool:
        """`peer` is a direct link for `database`; True when it is new (the other pairs now exclude it). A new
        link starts DIRECT and down: unless it connects within failover_after, its origin fails over like any
        link that went down."""
        links = self._links.setdefault(database, {})
        if peer in links:
            return False
        now = self._loop.time()
        link = Link(down_since=now, changed_at=now)
        links[peer] = link
        self._arm(database, peer, link)
        return True

    def forget(self, database: str, peer: str) -> None:
        """`peer` is no longer a direct link for `database` (dropped, removed, URL moved): its origin is carried
        by everyone from now on."""
        links = self._links.get(database)
        link = links.pop(peer, None) if links is not None else None
        if link is None:
            return
        link.disarm()
        if not links:
            del self._links[database]
        self._on_change(database)

    def report(self, database: str, peer: str, *, up: bool, caught_up: bool = False) -> None:
        """The link's session state: connected or not, and whether its sender said it had nothing more."""
        link = self._links.get(database, {}).get(peer)
        if link is None:
            return
        caught_up = up and caught_up
        now = self._loop.time()
        if up and not link.up:
            link.disarm()
        elif not up and link.up:
            link.down_since = now
            self._arm(database, peer, link)
        link.up, link.caught_up = up, caught_up
        if link.mode is Mode.FAILED_OVER and caught_up:
            link.mode = Mode.DIRECT
            link.changed_at = now
            self._on_change(database)

    def close(self) -> None:
        for links in self._links.values():
            for link in links.values():
                link.disarm()
        self._links.clear()

    # -- timers --------------------------------------------------------------------------------------------------

    def _arm(self, database: str, peer: str, link: Link) -> None:
        link.disarm()
        if link.mode is Mode.FAILED_OVER:
            return
        delay = max(0.0, link.down_since + self.failover_after - self._loop.time())
        link.timer = self._loop.call_later(delay, self._fail_over, database, peer, link)

    def _fail_over(self, database: str, peer: str, link: Link) -> None:
        link.timer = None
        if self._links.get(database, {}).get(peer) is not link or link.up or link.mode is Mode.FAILED_OVER:
            return
        link.mode = Mode.FAILED_OVER
        link.changed_at = self._loop.time()
        self._on_change(database)
