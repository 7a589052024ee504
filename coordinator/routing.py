"""Route selection: which origins each (peer, database) subscription carries.

Every write is tagged with its origin (the node that made it), and a subscription names the origins it does
*not* want from that peer (`exclude`); the sender serves every other origin it holds, from where the receiver
says it is complete. The receiver's progress is per origin, not per link, so moving an origin from one link to
another never skips or repeats an entry (a repeat is an identity tie, skipped by last-writer-wins).

The rule, per database, for an origin O that is a direct peer of this node (we dial O for that database). A link
is judged by its recent availability, not by one outage:

    DIRECT       O comes only from O's own link; every other pair excludes O.
                 Entered at first sight, and again once O's link has been stable for `failover_after`: up and
                 caught up (its sender said it had nothing more) since a moment from which it has not dropped.
    FAILED_OVER  O's link has been down (or never up) for `failover_after` at a stretch, or it is flapping: it
                 dropped (went from up to down) FLAP_DROPS times within `failover_after`, and fails over at the
                 drop that makes it so. Every connected pair carries O, so whichever peer holds O's writes passes
                 them on.

Both ways wait, so a link that drops every few seconds leaves its origin on the healthy paths until it holds,
and the route (each change sets up every pair of the database again) changes once per spell of flapping, not
once per drop.

Every origin that is not a direct peer (a node behind another, a dead or removed node, an origin never heard
of) is carried by every pair, and so is this node's own origin (peers send back what a lost file is missing;
in steady state there is nothing to send). In a full mesh with every link up each origin therefore arrives once
per receiving node; along a line, each hop relays what is not direct for the next.

Each link owns one timer, for the state it is in: DIRECT and down waits to fail over, FAILED_OVER and stable
waits to move back; the other states wait for a report and arm nothing. Every transition cancels the timer of the
state it leaves; `forget` and `close` cancel everything. `failover_after` may change on reload: it applies from
the next transition of each link, and to every flap judged from then on. The links of a database whose timers fall
due within SIMULTANEOUS of one that fires switch with it, so that a registry pass adding hundreds of links changes
the route once when they fail over, not once per link.
"""

from __future__ import annotations

import asyncio
import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

# Drops within failover_after that make a link flapping. Two drops can be one bad moment (a restart, a network
# blip and its retry); a third within the window is a pattern.
FLAP_DROPS = 3
# Links of a database whose timers fall due this close together switch at the first one's time. The links a registry
# pass adds are tracked microseconds apart (the pass takes time), and each switch on its own renews every pair of
# the database: hundreds of links failing over one by one cost hundreds of renewals of every pair (issue 21).
SIMULTANEOUS = 0.05


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
    # FAILED_OVER only: when the link was first up and caught up after its last drop; None while it is not.
    stable_since: float | None = None
    changed_at: float = 0.0
    drops: deque[float] = field(default_factory=lambda: deque(maxlen=FLAP_DROPS))  # the latest up -> down times
    timer: asyncio.TimerHandle | None = None
    due: tuple[float, Mode] | None = None  # when the timer fires and the mode it switches to

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.due = None

    def flapping(self, window: float) -> bool:
        """FLAP_DROPS drops within `window`, the last one included."""
        return len(self.drops) == FLAP_DROPS and self.drops[-1] - self.drops[0] <= window


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
        # Per database, its DIRECT origins, sorted: every subscription's exclusions are read from it, so it is
        # sorted once per change of a link's mode, not once per subscription (`exclude`).
        self._direct: dict[str, list[str]] = {}

    # -- what the node asks --------------------------------------------------------------------------------------

    def exclude(self, database: str, peer: str) -> list[str]:
        """The origins the subscription to `peer` for `database` must not carry: the other direct peers whose
        own links serve them."""
        direct = self._direct.get(database)
        if direct is None:
            links = self._links.get(database, {})
            direct = self._direct[database] = sorted(o for o, link in links.items() if link.mode is Mode.DIRECT)
        return [origin for origin in direct if origin != peer]

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
        self._direct.pop(database, None)
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
        self._direct.pop(database, None)
        if not links:
            del self._links[database]
        self._on_change(database)

    def report(self, database: str, peer: str, *, up: bool, caught_up: bool = False) -> None:
        """The link's session state: connected or not, and whether its sender said it had nothing more."""
        link = self._links.get(database, {}).get(peer)
        if link is None:
            return
        now = self._loop.time()
        link.caught_up = up and caught_up
        if up and not link.up:
            link.up = True
            self._arm(database, peer, link)
        elif not up and link.up:
            link.up = False
            self._dropped(database, peer, link, now)
        # Only a drop ends the wait to move back, not a report that the link is behind again: under write load
        # the sender says "caught up" at the end of each backlog and not between, and a connected link that lags
        # loses nothing by carrying its origin (progress is per origin).
        if link.mode is Mode.FAILED_OVER and link.caught_up and link.stable_since is None:
            link.stable_since = now
            self._arm(database, peer, link)

    def close(self) -> None:
        for links in self._links.values():
            for link in links.values():
                link.disarm()
        self._links.clear()
        self._direct.clear()

    # -- transitions and timers ----------------------------------------------------------------------------------

    def _dropped(self, database: str, peer: str, link: Link, now: float) -> None:
        link.down_since = now
        link.stable_since = None
        link.drops.append(now)
        if link.mode is Mode.DIRECT and link.flapping(self.failover_after):
            # The drop that makes the link flapping fails it over at once, rather than when an outage lasts
            # failover_after: none of its outages may last that long, and each holds the origin's writes back
            # while other paths are healthy. The link is down at that drop, by definition; that it may be up
            # again a moment later does not change the verdict (a link that is up between drops this frequent is
            # not carrying well), and moving back waits until it has been stable for failover_after.
            self._switch(database, peer, link, Mode.FAILED_OVER)
        else:
            self._arm(database, peer, link)

    def _switch(self, database: str, peer: str, link: Link, mode: Mode) -> None:
        link.mode = mode
        self._direct.pop(database, None)
        link.changed_at = self._loop.time()
        link.stable_since = None
        self._arm(database, peer, link)
        self._on_change(database)

    def _arm(self, database: str, peer: str, link: Link) -> None:
        """Cancel the timer of the state the link left and arm the one of the state it is in, if any."""
        link.disarm()
        if link.mode is Mode.DIRECT and not link.up:
            deadline, then = link.down_since + self.failover_after, Mode.FAILED_OVER
        elif link.mode is Mode.FAILED_OVER and link.stable_since is not None:
            deadline, then = link.stable_since + self.failover_after, Mode.DIRECT
        else:
            return
        link.due = (deadline, then)
        link.timer = self._loop.call_at(deadline, self._expire, database, peer, link, then)

    def _expire(self, database: str, peer: str, link: Link, mode: Mode) -> None:
        # Every transition and `forget` cancel the timer, so when it fires the link is still in the state it was
        # armed for.
        link.timer = None
        link.due = None
        horizon = self._loop.time() + SIMULTANEOUS
        together = [
            (other_peer, other)
            for other_peer, other in self._links.get(database, {}).items()
            if other.due is not None and other.due[1] is mode and other.due[0] <= horizon
        ]
        self._switch(database, peer, link, mode)
        for other_peer, other in together:
            self._switch(database, other_peer, other, mode)
