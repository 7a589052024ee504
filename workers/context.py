"""What the parts of a worker share: its identity, configuration, store, feeds and the pipe to the coordinator."""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from shared import messages
from shared.config import Config, database_matches
from shared.store import Database, NodeRow, Store, read_nodes
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
    _known: set[str] = field(default_factory=set)

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
