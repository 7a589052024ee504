"""The connection-replication map: connection key -> Entry, one per peer connection the node wants.

An Entry holds the state of each of the peer's databases (a PairState), and each pair is placed on a worker of its
own (`PairState.placed`): the databases of one peer spread over the workers, so a node with few peers still uses
every worker. An Entry owns at most one re-drive timer (wedge or stall recovery); `disarm()` is the single place
that cancels it, and every path that ends or moves a pair calls it: unsubscribe, node deletion, worker exit, a
stale pair placed again, a pair moved by scaling, and URL migration.

The setup schedule of a pair is deliberately not here: it belongs to the pair whichever worker the pair is placed
on and however often it moves (worker exit, scaling), and one owner, the setup scheduler, keeps its dedup on every
path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from replicator.shared import messages


@dataclass
class StallWatch:
    """A suspected receive stall, scoped to the session that stalled."""

    worker: int
    session: int
    detected_at: float
    seq: int  # last_received_seq when the stall was detected
    origin: str = ""  # an origin the peer is ahead on (wire.Heads), when that is what showed the stall


@dataclass
class PairState:
    database: str
    payload: messages.Subscribe
    created_at: float
    connected: bool = False
    worker: int | None = None  # the worker whose session last reported
    session: int | None = None
    accepted_by: int | None = None  # the worker that accepted the latest dispatched subscribe
    dispatched_at: float | None = None  # when the latest subscribe went to a worker
    # The worker the latest subscribe went to, until a session of the pair reports (connected or disconnected) or
    # that worker exits: it is setting up exactly that subscription, so one more just like it would change nothing.
    dispatched_to: int | None = None
    # When a subscribe went to a worker while the pair was not connected: its connect is timed from there.
    setup_started: float | None = None
    connected_at: float | None = None
    own_upto: int = 0  # how far the connected session asked for this node's own writes back (`Connected.own_upto`)
    protocol: int = 0  # the protocol version the latest session speaks (`Connected.protocol`)
    disconnected_at: float | None = None
    last_progress_at: float | None = None
    last_received_seq: int = 0
    peer_head_seq: int = 0
    lag_seconds: float = 0.0
    progressed: bool = False  # a session reported a batch received: lag_seconds is a measurement from then on
    applied: int = 0
    caught_up: bool = False  # the peer's last batch said it had nothing more to serve
    peer_recovering: bool = False  # ... and that the peer's own file of the database was recovering
    caught_up_at: float | None = None  # when a session of the pair last reported caught up
    # Origins the peer holds complete beyond this node (its Heads), with this node's complete for each, and since
    # when none of those positions has moved: a pair ahead and not moving is stalled (invariant 21).
    ahead: dict[str, int] = field(default_factory=dict)
    ahead_since: float | None = None
    # The session's copy: what the sender had to serve when it started, what arrived since, and when it started.
    backlog: int = 0
    received: int = 0
    session_applied: int = 0
    received_bytes: int = 0
    slow_copy_warned: int | None = None  # the session a `copy_slow` warning was logged for
    reconnect_attempts: int = 0
    # When the worker said its session dials again (its latest Disconnected report): a pair backing off on its own
    # schedule is not wedged until that time has passed by the wedge threshold with no new report.
    retry_due: float | None = None
    last_error: str = ""
    stall: StallWatch | None = None
    # Set when a stall kick fired; no new kick until apply progress or another stall threshold.
    stall_kicked_at: float | None = None
    # The worker the pair is placed on: its setups and forced reconnects go there. -1 while it has none (no worker
    # was live, or its worker exited); the stale sweep places it again. Unlike `worker`, this is the coordinator's
    # choice, not what a session reported.
    placed: int = -1

    @property
    def behind(self) -> bool:
        return self.peer_head_seq > self.last_received_seq or bool(self.ahead)

    def note_ahead(self, ahead: dict[str, int], now: float) -> bool:
        """A report of the origins the peer is ahead on; True when a position moved (one rose, or caught up)."""
        moved = bool(self.ahead) and any(ahead.get(origin, mark + 1) > mark for origin, mark in self.ahead.items())
        if not ahead:
            self.ahead_since = None
        elif not self.ahead or moved:
            self.ahead_since = now
        self.ahead = ahead
        return moved

    def stalled(self, now: float, threshold: float) -> bool:
        """Connected, the peer ahead, and nothing moved for `threshold` (nor since the last stall kick): the
        session must be renewed (invariant 21). Ahead on some origin (`note_ahead`), what counts is when those
        positions last moved, however much else arrives."""
        if not self.connected or not self.behind:
            return False
        quiet_since = self.last_progress_at or self.created_at
        if self.ahead_since is not None:
            quiet_since = self.ahead_since
        return now - max(quiet_since, self.stall_kicked_at or 0.0) >= threshold

    @property
    def copying(self) -> bool:
        """The connected session is catching up on what the sender held when it started."""
        return self.connected and not self.caught_up and self.backlog > 0 and self.connected_at is not None

    @property
    def copy_remaining(self) -> int:
        """What the session still has to receive of the sender's backlog at its start; 0 when it is not copying."""
        return self.backlog - min(self.received, self.backlog) if self.copying else 0

    def copy(self, now: float) -> dict[str, Any] | None:
        """The session's copy progress while it is catching up: records received of the backlog the sender had when
        the session started, the rate since, and the time left at that rate; None once caught up."""
        if not self.copying or self.connected_at is None:
            return None
        records = min(self.received, self.backlog)
        elapsed = max(now - self.connected_at, 1e-3)
        rate = self.received / elapsed
        return {
            "records": records,
            "total": self.backlog,
            "remaining": self.backlog - records,
            "rate": round(rate, 1),
            "mb_s": round(self.received_bytes / elapsed / 1e6, 2),
            "eta_s": round((self.backlog - records) / rate, 1) if rate > 0 else None,
        }


@dataclass
class Entry:
    key: str
    peer: str
    url: str
    pairs: dict[str, PairState] = field(default_factory=dict)
    leader: bool = False
    redrive: Any = None  # the owned timer handle (loop.call_later), or None
    redrive_kind: str = ""

    def arm(self, handle: Any, kind: str) -> None:
        self.disarm()
        self.redrive = handle
        self.redrive_kind = kind

    def disarm(self) -> None:
        if self.redrive is not None:
            self.redrive.cancel()
            self.redrive = None
            self.redrive_kind = ""

    def on_worker(self, slot: int) -> list[str]:
        """The databases of this entry placed on `slot`."""
        return [database for database, pair in self.pairs.items() if pair.placed == slot]


class ReplicationMap:
    def __init__(self) -> None:
        self._entries: dict[str, Entry] = {}
        self._by_peer: dict[str, str] = {}
        self._load: tuple[tuple[int, ...], dict[int, int]] | None = None  # (the slots counted, pairs on each)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(self._entries.values()))

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> Entry | None:
        return self._entries.get(key)

    def by_peer(self, peer: str) -> Entry | None:
        key = self._by_peer.get(peer)
        return self._entries.get(key) if key is not None else None

    def put(self, entry: Entry) -> None:
        """Add or replace; a replaced entry's re-drive timer is disarmed."""
        old = self._entries.get(entry.key)
        if old is not None and old is not entry:
            old.disarm()
        self._entries[entry.key] = entry
        self._by_peer[entry.peer] = entry.key
        self._load = None

    def remove(self, key: str) -> Entry | None:
        entry = self._entries.pop(key, None)
        self._load = None
        if entry is not None:
            entry.disarm()
            if self._by_peer.get(entry.peer) == key:
                del self._by_peer[entry.peer]
        return entry

    def pair(self, key: str, database: str) -> PairState | None:
        entry = self._entries.get(key)
        return entry.pairs.get(database) if entry is not None else None

    def load(self, slots: list[int]) -> dict[int, int]:
        """How many pairs are placed on each of `slots` (the measure placement evens out; read only). Counted over
        every pair once, then kept by `placed_on` until a pair moves or goes another way (`recount`), so placing
        the pairs of 1,000 databases is linear, not quadratic, in the coordinator's loop."""
        key = tuple(slots)
        if self._load is None or self._load[0] != key:
            load = dict.fromkeys(slots, 0)
            for entry in self._entries.values():
                for pair in entry.pairs.values():
                    if pair.placed in load:
                        load[pair.placed] += 1
            self._load = (key, load)
        return self._load[1]

    def placed_on(self, slot: int) -> None:
        """A pair was just placed on `slot` (`Node.place`)."""
        if self._load is not None and slot in self._load[1]:
            self._load[1][slot] += 1

    def recount(self) -> None:
        """A pair was dropped, moved or unplaced other than by `Node.place`: `load` counts again."""
        self._load = None


def should_fire_stall_kick(pair: PairState | None, watch: StallWatch) -> bool:
    """Decide, when the kick's timer fires, whether the stalled session still deserves a forced reconnect.

    The watch is released (pair.stall cleared) only by the monitored session's own reports: apply progress or its
    disconnect. A report from another session (a failover or superseded worker) neither cancels nor releases it,
    and the kick it leads to is scoped to the monitored session, so it cannot tear down the other one.
    """
    if pair is None or pair.stall is not watch:
        return False
    if (pair.worker, pair.session) == (watch.worker, watch.session):
        still = pair.connected and pair.behind and pair.last_received_seq <= watch.seq
        return still and (pair.ahead_since is None or pair.ahead_since <= watch.detected_at)
    return True
