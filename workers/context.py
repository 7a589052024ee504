"""What the parts of a worker share: its identity, configuration, store, feeds and the pipe to the coordinator."""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from replicator.shared import blobs, membership, messages, revocation
from replicator.shared.config import Config, database_matches
from replicator.shared.logs import log
from replicator.shared.notify import Doorbell
from replicator.shared.retry_budget import Clock, RetryBudget
from replicator.shared.store import Database, NodeRow, Store
from replicator.shared.tls import PeerIdentity
from replicator.workers.changes import ChangeFeeds
from replicator.workers.confirm import Relays, Waiters
from replicator.workers.counters import Counters

SYSTEM = "system"
# `report_clock`: an offset within this of the last one reported, less than the interval ago, is not reported again.
CLOCK_REPORT_TOLERANCE = 0.01
CLOCK_REPORT_INTERVAL = 5.0


@dataclass
class WorkerContext:
    worker_id: int
    config: Config
    store: Store
    counters: Counters
    client_ssl: ssl.SSLContext
    report: Callable[[msgspec.Struct], None]
    wall: Callable[[], float] = time.time
    monotonic: Callable[[], float] = time.monotonic
    feeds: ChangeFeeds = field(init=False)
    ca: revocation.CA | None = None  # the cluster CA (every CA of its bundle): it signs revocations and certificates
    doorbell: Doorbell | None = None  # rung after each commit of this process; rings from siblings wake the feeds
    _known: set[str] = field(default_factory=set)
    _revocations: list[revocation.Revocation] = field(default_factory=list)
    _revocations_seen: int = -1
    verifier: membership.Verifier = field(init=False)
    _registry: dict[str, NodeRow] = field(default_factory=dict)
    _registry_seen: int = -1
    _redial_budgets: dict[str, RetryBudget] = field(default_factory=dict)
    # The blob files this process found intact or damaged, per version of each: served without hashing again.
    blob_checks: blobs.Checked = field(default_factory=blobs.Checked)
    # What the node knows other nodes hold (relayed by the sessions), and this worker's writes waiting for
    # confirmations (workers.confirm).
    relays: Relays = field(default_factory=Relays)
    waiters: Waiters = field(init=False)
    trust_changes: int = 0  # how many times the CA bundle was replaced (`trust`)
    # peer -> (offset, monotonic time) of the last PeerClock this worker reported (`report_clock`).
    _clocks: dict[str, tuple[float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.feeds = ChangeFeeds(lambda name: self.store.database(name), doorbell=self.doorbell)
        self.store.on_commit = self.feeds.committed
        self.verifier = membership.Verifier(self.ca)
        self.waiters = Waiters(self.report)
        self._known.update(self.store.names())

    def report_clock(self, peer: str, offset: float) -> None:
        """Tell the coordinator a peer's clock offset, as a handshake measured it. Every stream's handshake measures
        one, thousands on a link's first seconds with many databases: the same offset again (within
        CLOCK_REPORT_TOLERANCE) is reported only once CLOCK_REPORT_INTERVAL has passed."""
        now = self.monotonic()
        last = self._clocks.get(peer)
        if (
            last is not None
            and abs(offset - last[0]) < CLOCK_REPORT_TOLERANCE
            and now - last[1] < CLOCK_REPORT_INTERVAL
        ):
            return
        self._clocks[peer] = (offset, now)
        self.report(messages.PeerClock(peer=peer, offset_seconds=offset))

    @property
    def node(self) -> str:
        return self.config.node.name

    def database(self, name: str, create: bool = False) -> Database:
        """Open a database; a newly created one is reported so the coordinator can advertise and replicate it."""
        db = self.store.database(name, create=create)
        if name not in self._known:
            self._known.add(name)
            self.report(messages.DatabaseOpened(name=name))
        return db

    def forget(self, name: str) -> None:
        """The database was removed from this node: opening it again (re-created) is reported again."""
        self._known.discard(name)

    def redial_budget(self, peer: str, loop: Clock) -> RetryBudget | None:
        """The budget the redials toward `peer` share (`replication.redial_rate`, `redial_burst`), None when it is
        off. The coordinator gives each connection (a peer's URL) to one worker, so every pair of a peer redials
        from this process and the budget is the node's. Created at the peer's first redial; a reload that changes
        the rate or the burst replaces it, with a full bucket, at the next one (a wait already drawn stands)."""
        settings = self.config.replication
        if settings.redial_rate == 0:
            self._redial_budgets.clear()
            return None
        budget = self._redial_budgets.get(peer)
        if budget is None or (budget.rate, budget.burst) != (settings.redial_rate, settings.redial_burst):
            budget = RetryBudget(settings.redial_rate, settings.redial_burst, loop=loop)
            self._redial_budgets[peer] = budget
        return budget

    def replicates(self, database: str) -> bool:
        return database == SYSTEM or database_matches(self.config.replication.databases, database)

    def registry(self) -> dict[str, NodeRow]:
        """The registry rows that verify (`shared.membership`), read again whenever the system database changed."""
        system = self.store.database(SYSTEM, create=True)
        seen = system.data_version()
        if seen != self._registry_seen:
            self._registry, _ = self.verifier.read(system, self.revoked)
            self._registry_seen = seen
        return self._registry

    def trust(self, ca: revocation.CA) -> None:
        """Trust the CAs of a reloaded bundle: registry rows, revocations and certificates are checked against them
        from now on, and what was decided with the old bundle is forgotten."""
        self.ca = ca
        self.verifier = membership.Verifier(ca)
        self._registry_seen = -1
        self._revocations_seen = -1
        self.trust_changes += 1

    def revocations(self) -> list[revocation.Revocation]:
        """The revocations in the registry that the cluster CA signed, read again whenever the system database
        changed. One that does not verify is skipped (and was refused when a peer sent it)."""
        system = self.store.database(SYSTEM, create=True)
        seen = system.data_version()
        if seen != self._revocations_seen and self.ca is not None:
            self._revocations = revocation.stored(
                system, self.ca, lambda reason: log.warning("revocation_refused", reason=reason, sample_by=())
            )
            self._revocations_seen = seen
        return self._revocations

    def revoked(self, identity: PeerIdentity) -> str | None:
        """Why a peer's certificate may not be used, if a revocation the cluster CA signed revokes it, else None."""
        return revocation.revoked_by(self.revocations(), identity)
