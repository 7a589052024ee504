"""What a node may forget, and when: the audit history past `audit_retention`, and tombstones every holder has.

    audit      pruned past audit_retention (`Database.prune_audit`): it is history only. Senders serve the records
               table by origin, so no holder, lagging or copying, depends on what the log keeps.
    tombstones purged once every holder of the database holds them and they are older than tombstone_retention
               (`Database.purge_tombstones`, with the floors below). A holder has a tombstone of origin o up to the
               version it holds o complete; this node learns that from what each holder says when it subscribes
               here and from the marks it acknowledges (`messages.PeerHolds`). A holder that has not said is not
               assumed to have anything: the database waits.

A node that does not hear from every holder (outside a full mesh) never decides a purge itself, and does not need
to: anti-entropy spreads a purge from the nodes that decided it (`workers.antientropy`, invariant 20), so every
holder ends up purged, and the digests meet again in any topology.

`Retention` runs both every `prune_interval` for the node; the decisions are the pure functions below, which the
simulation (`tests/sim`) runs as they are.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from replicator.coordinator.view import RetentionView
from replicator.shared.logs import log
from replicator.shared.store import Origin, UnknownDatabase

MICROSECONDS = 1_000_000


def tombstone_floors(held: Mapping[str, Origin], reports: Iterable[Mapping[str, int] | None]) -> dict[str, int] | None:
    """Per origin, the version up to which every holder of a database holds it complete, this node's own `held`
    included, or None while some holder's report (one per other holder of the database) is missing."""
    known = list(reports)
    if any(report is None for report in known):
        return None
    floors = {
        origin: min([state.complete, *(report.get(origin, 0) for report in known if report is not None)])
        for origin, state in held.items()
    }
    return {origin: floor for origin, floor in floors.items() if floor > 0}


def purge_horizon(wall: float, tombstone_retention: float) -> int:
    """The newest version a tombstone may have to be purged now: wall clock minus the retention, as a version."""
    return int((wall - tombstone_retention) * MICROSECONDS)


class Retention:
    """The node's retention pass, every `prune_interval`: prune every file's audit history, then purge the tombstones
    of every database whose holders have all reported."""

    def __init__(self, node: RetentionView, *, to_thread: Callable[..., Awaitable[Any]] = asyncio.to_thread) -> None:
        self._node = node
        self._to_thread = to_thread

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._node.config.replication.prune_interval)
            await self.pass_once()

    async def pass_once(self) -> None:
        """One pass. The databases it opened (every one the node holds) it closes again, in a thread: the store's trim
        closes at most RELEASE_PER_ROUND of them every few seconds, fewer than a pass a minute opens on a node with
        1,000 databases, so the coordinator kept a connection to every one for good (about 67 KiB each)."""
        store = self._node.store
        assert store is not None
        opened = store.opened()
        try:
            self.prune_audit()
        except Exception as exc:
            log.warning("audit_prune_failed", error=repr(exc))
        for database, floors in self.floors().items():
            try:
                await self._to_thread(self.purge, database, floors)
            except Exception as exc:
                log.warning("tombstone_purge_failed", database=database, error=repr(exc))
        await self._to_thread(store.release, sorted(store.opened() - opened))

    def floors(self) -> dict[str, dict[str, int]]:
        """Per database this node holds, the version of each origin up to which every holder holds it complete; a
        database some holder has not reported on is left out (it may still lack a delete). The holders are the
        registered nodes that advertise the database."""
        node = self._node
        store = node.store
        assert store is not None
        found: dict[str, dict[str, int]] = {}
        for name in store.names():
            holders = [view.name for view in node.views.values() if name in view.holds and view.name != node.name]
            try:
                held = store.database(name).origins()
            except UnknownDatabase:
                continue  # removed, or being removed, since the listing
            floors = tombstone_floors(held, [node.peer_holds.get((name, holder)) for holder in holders])
            if floors is not None:
                found[name] = floors
        return found

    def purge(self, database: str, floors: dict[str, int]) -> int:
        """Remove the tombstones of `database` every holder has that are older than tombstone_retention."""
        node = self._node
        assert node.store is not None
        horizon = purge_horizon(node.wall(), node.config.replication.tombstone_retention)
        purged = node.store.database(database).purge_tombstones(floors, horizon)
        if purged:
            log.info("tombstones_purged", database=database, records=purged)
        return purged

    def prune_audit(self) -> int:
        """Drop the audit entries past the retention window, in every file."""
        node = self._node
        assert node.store is not None
        deleted = 0
        for name in node.store.names():
            try:
                database = node.store.database(name)
            except UnknownDatabase:
                continue  # removed, or being removed, since the listing
            deleted += database.prune_audit(node.config.replication.audit_retention, node.wall())
        if deleted:
            log.info("audit_pruned", entries=deleted)
        return deleted
