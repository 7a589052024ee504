"""Which setups take a slot of the stagger ladder: the coordinator's view of each worker's links (issue 23).

A worker shares one TLS link per peer URL (the link pool): the first subscription to a peer dials it, later ones
open a stream on it with one frame, and subscriptions made while the dial is in flight share that dial. The ladder
exists to bound TLS handshakes, so a setup that will not cause one takes no slot. `Links` keeps, per
(worker, connection key), whether the worker's link is up (from its `messages.LinkState` reports) and when a
slot-taking setup was last dispatched there (a dial the worker shares); `Links.needs_slot` is the rule, and the only
place it is written. `SetupScheduler` asks it when a setup is armed and again when it fires; the node asks it for
force-reconnects.

A worker that has not said it shares links (`messages.Ready.links`, or any `LinkState` from it) dials once per
pair: every setup to it takes a slot, as before.
"""

from __future__ import annotations

from collections.abc import Callable

from replicator.workers.session import DIAL_TIMEOUT

# A slot-taking setup dispatched to (worker, key) less than this long ago is a dial still in flight, which later
# setups to that worker and peer share (unless the link was reported down since). The worker gives a dial up after
# DIAL_TIMEOUT, so past it the dial has either come up (reported) or failed.
DIAL_SHARE_WINDOW = DIAL_TIMEOUT

Link = tuple[int, str]  # (worker slot, connection key)
Resolve = Callable[[str, str], "Link | None"]  # (peer url, database) -> the link its setup would go over now


class Links:
    """Per (worker, connection key): whether the link is up, and when a slot-taking setup last went out to it."""

    def __init__(self, resolve: Resolve, window: float = DIAL_SHARE_WINDOW) -> None:
        self._resolve = resolve
        self.window = window
        self._up: dict[Link, int] = {}  # link -> streams, as last reported
        self._dialed: dict[Link, float] = {}  # link -> loop time of the last slot-taking dispatch to it
        self._sharing: set[int] = set()  # workers that share one link per peer URL

    def link(self, peer_url: str, database: str) -> Link | None:
        """The link a setup of the pair would go over now (its worker and key); None when it has no live worker."""
        return self._resolve(peer_url, database)

    def needs_slot(self, link: Link | None, now: float, *, dial_armed: bool = False) -> bool:
        """The rule: a setup (a subscribe, or a force-reconnect) over `link` at `now` takes a ladder slot unless
        (a) the worker's link for the key is up, or (b) a slot-taking setup went out to that worker and key less
        than `window` ago and no link-down report arrived after it (the dial in flight is shared). An unknown link,
        or a worker that does not share links, always takes a slot.

        `dial_armed`: a slot-taking setup to the link is armed and not yet dispatched (the scheduler's, asked when a
        setup is armed): a setup armed now shares that dial as it would share one in flight."""
        if link is None or link[0] not in self._sharing:
            return True
        if link in self._up or dial_armed:
            return False
        dialed = self._dialed.get(link)
        return dialed is None or now - dialed >= self.window

    def dialed(self, link: Link | None, now: float) -> None:
        """A slot-taking setup went out to `link` at `now`."""
        if link is not None:
            self._dialed[link] = now

    def sharing(self, worker: int) -> None:
        """The worker shares one link per peer URL (its Ready said so)."""
        self._sharing.add(worker)

    def report(self, worker: int, key: str, up: bool, streams: int = 0) -> None:
        """A `LinkState` of the worker: a link down also ends the dial it came from, so the next setup dials again."""
        self._sharing.add(worker)
        link = (worker, key)
        if up:
            self._up[link] = streams
        else:
            self._up.pop(link, None)
            self._dialed.pop(link, None)

    def forget_worker(self, worker: int) -> None:
        """The worker exited or was respawned: its links and dials died with the process."""
        for table in (self._up, self._dialed):
            for link in [link for link in table if link[0] == worker]:
                del table[link]
        self._sharing.discard(worker)

    def is_up(self, worker: int, key: str) -> bool:
        return (worker, key) in self._up

    def workers_up(self, key: str) -> list[int]:
        """The workers whose link for `key` is up, in slot order (`/status`)."""
        return sorted(worker for worker, linked in self._up if linked == key)
