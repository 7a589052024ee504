"""What the parts of a worker share: its identity, configuration, store, feeds and the pipe to the coordinator."""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
from cryptography import x509

from shared import messages, revocation
from shared.config import Config, database_matches
from shared.logs import log
from shared.store import Database, NodeRow, Store, read_nodes
from shared.tls import PeerIdentity
from workers.changes import ChangeFeeds
from workers.counters import Counters

SYSTEM = "system"


@dataclass
class WorkerContext:
    worker_id: int
    config: Config
    store: Store
    counters: Counters
    client_ssl: ssl.SSLContext
    report: Callable[[msgspec.Struct], None]
    wall: Callable[[], float] = time.time
    feeds: ChangeFeeds = field(init=False)
    ca: x509.Certificate | None = None  # the cluster CA, which signs revocations
    _known: set[str] = field(default_factory=set)
    _revocations: list[revocation.Revocation] = field(default_factory=list)
    _revocations_seen: int = -1

    def __post_init__(self) -> None:
        self.feeds = ChangeFeeds(lambda name: self.store.database(name))
        self._known.update(self.store.names())

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

    def replicates(self, database: str) -> bool:
        return database == SYSTEM or database_matches(self.config.replication.databases, database)

    def registry(self) -> dict[str, NodeRow]:
        return read_nodes(self.store.database(SYSTEM, create=True))

    def revocations(self) -> list[revocation.Revocation]:
        """The revocations in the registry that the cluster CA signed, read again whenever the system database
        changed. One that does not verify is skipped (and was refused when a peer sent it)."""
        system = self.store.database(SYSTEM, create=True)
        seen = system.data_version()
        if seen != self._revocations_seen and self.ca is not None:
            found: list[revocation.Revocation] = []
            for entry in system.scan(revocation.TABLE, None, 100_000, skip_damaged=True):
                try:
                    found.append(revocation.from_record(entry.id, entry.value, self.ca))
                except revocation.BadRevocation as exc:
                    log.warning("revocation_refused", reason=str(exc), sample_by=())
            self._revocations = found
            self._revocations_seen = seen
        return self._revocations

    def revoked(self, identity: PeerIdentity) -> str | None:
        """Why a peer's certificate may not be used, if it is revoked (signed revocations, and the serials an
        operator listed in the node's registry row), else None."""
        for found in self.revocations():
            if found.revokes(identity):
                return f"certificate of {identity.name} (serial {identity.serial}) is revoked: {found.describe()}"
        row = self.registry().get(identity.name)
        if row is not None and identity.serial in row.revoked:
            return f"certificate serial {identity.serial} of {identity.name!r} is revoked"
        return None
