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

The node's loop calls `prune` and `purge` every `prune_interval`; the decisions are the pure functions here, which
the simulation (`tests/sim`) runs as they are.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from replicator.shared.store import Origin

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
