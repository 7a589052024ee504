"""What the metrics collector, the admin server, worker scaling and anti-entropy need of the node: one narrow view
each.

The node imports those modules to build them and hands itself in; they read it through these protocols, so none of
them imports `coordinator.node` and the node's dependencies point one way. A `Node` satisfies every view here.
Members are read-only properties unless the module writes them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Set
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import asyncio

    from prometheus_client import CollectorRegistry

    from replicator.coordinator.antientropy import AntiEntropy
    from replicator.coordinator.blob_repairs import BlobRepairs
    from replicator.coordinator.credentials import Credentials
    from replicator.coordinator.database_limit import DatabaseLimit
    from replicator.coordinator.drops import Drops
    from replicator.coordinator.links import Links
    from replicator.coordinator.recovery import Recoveries
    from replicator.coordinator.registry import NodeView
    from replicator.coordinator.reload_health import ReloadHealth
    from replicator.coordinator.replication_map import ReplicationMap
    from replicator.coordinator.setup_scheduler import SetupScheduler, Sweep
    from replicator.coordinator.supervisor import Supervisor
    from replicator.shared import membership, messages, revocation
    from replicator.shared.config import Config
    from replicator.shared.store import Database, Store
    from replicator.shared.tls import PeerIdentity


class MetricsView(Protocol):
    """The state the metrics collector reads at scrape time."""

    @property
    def config(self) -> Config: ...

    @property
    def map(self) -> ReplicationMap: ...

    @property
    def views(self) -> Mapping[str, NodeView]: ...

    @property
    def scheduler(self) -> SetupScheduler: ...

    @property
    def supervisor(self) -> Supervisor: ...

    @property
    def reassignments(self) -> int: ...

    @property
    def redrives(self) -> Mapping[str, int]: ...

    @property
    def stalls(self) -> Mapping[str, int]: ...

    @property
    def recoveries(self) -> Recoveries: ...

    @property
    def holds(self) -> Set[str]: ...

    @property
    def antientropy(self) -> AntiEntropy: ...

    @property
    def database_limit(self) -> DatabaseLimit: ...

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def credentials(self) -> Credentials | None: ...

    @property
    def reload_health(self) -> ReloadHealth: ...


class RendersMetrics(Protocol):
    @property
    def registry(self) -> CollectorRegistry: ...

    def prepare(self) -> None: ...

    def render(self) -> bytes: ...

    def admin_refused(self, reason: str) -> None: ...


class CountsAntiEntropy(Protocol):
    """The counters anti-entropy feeds from the coordinator."""

    def antientropy_round(self, peer: str, database: str, *, repaired: int, failed: bool) -> None: ...

    def antientropy_limit(self, peer: str, database: str, limit: str) -> None: ...

    def checksum_failures(self, database: str, count: int) -> None: ...


class AdminView(MetricsView, Protocol):
    """What the admin HTTP server reads and asks of the node."""

    @property
    def name(self) -> str: ...

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def store(self) -> Store | None: ...

    @property
    def boot_error(self) -> str: ...

    @property
    def wall(self) -> Callable[[], float]: ...

    @property
    def metrics(self) -> RendersMetrics: ...

    @property
    def drops(self) -> Drops: ...

    @property
    def blob_repairs(self) -> BlobRepairs: ...

    @property
    def signer(self) -> membership.Signer | None: ...

    @property
    def verifier(self) -> membership.Verifier: ...

    @property
    def recoveries(self) -> Recoveries: ...

    @property
    def sending(self) -> Mapping[tuple[str, str], messages.Sending]: ...

    @property
    def worker_tls(self) -> Mapping[int, messages.TlsLoaded]: ...

    @property
    def links(self) -> Links: ...
    def peer_seen(self) -> Mapping[str, float]: ...

    def revoked(self, identity: PeerIdentity) -> str | None: ...

    def revocations(self) -> list[revocation.Revocation]: ...

    def system(self) -> Database: ...

    def poke_registry(self, full: bool = True) -> None: ...

    def reset_pair(self, peer: str, database: str) -> bool: ...


class ScalingView(Protocol):
    """What a change of the worker count reads, and the pairs and counter it moves."""

    reassignments: int

    @property
    def config(self) -> Config: ...

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def map(self) -> ReplicationMap: ...

    @property
    def scheduler(self) -> SetupScheduler: ...

    @property
    def ladder(self) -> Sweep: ...

    @property
    def supervisor(self) -> Supervisor: ...

    @property
    def worker_ready(self) -> asyncio.Event: ...

    def place(self) -> int: ...


class AntiEntropyView(Protocol):
    """What the anti-entropy schedules read: the pairs and their workers, the held databases and the store."""

    @property
    def config(self) -> Config: ...

    @property
    def map(self) -> ReplicationMap: ...

    @property
    def supervisor(self) -> Supervisor: ...

    @property
    def store(self) -> Store | None: ...

    @property
    def holds(self) -> Set[str]: ...

    @property
    def wall(self) -> Callable[[], float]: ...

    @property
    def metrics(self) -> CountsAntiEntropy: ...


class DropsView(Protocol):
    """What applying deletion markers reads, and what it asks of the node when a database leaves it."""

    @property
    def name(self) -> str: ...

    @property
    def config(self) -> Config: ...

    @property
    def store(self) -> Store | None: ...

    @property
    def supervisor(self) -> Supervisor: ...

    @property
    def holds(self) -> Set[str]: ...

    @property
    def views(self) -> Mapping[str, NodeView]: ...

    @property
    def wall(self) -> Callable[[], float]: ...

    def system(self) -> Database: ...

    def poke_registry(self, full: bool = True) -> None: ...

    def drop_database_pairs(self, database: str) -> None: ...

    def database_regressed(self, database: str, floor: int) -> None: ...

    def on_database_removed(self, database: str) -> None: ...


class RetentionView(Protocol):
    """What the retention pass reads: the store, the holders of each database and what each reported holding."""

    @property
    def name(self) -> str: ...

    @property
    def config(self) -> Config: ...

    @property
    def store(self) -> Store | None: ...

    @property
    def views(self) -> Mapping[str, NodeView]: ...

    @property
    def peer_holds(self) -> Mapping[tuple[str, str], Mapping[str, int]]: ...

    @property
    def wall(self) -> Callable[[], float]: ...
