"""The registry: who the node replicates with, from `system.nodes` rows and the configured `[[peers]]`.

A `NodeView` is one node as the coordinator sees it after merging its row (which the node itself and operators
write, and which replicates like any record) with a static route from the config file. The row version is part of
the view, so a rewrite of a row is a node-update event even when its content did not change.
"""

from __future__ import annotations

from dataclasses import dataclass

from replicator.shared.config import Config, database_matches
from replicator.shared.keys import normalize_url
from replicator.shared.store import NodeRow

SYSTEM = "system"


@dataclass(frozen=True)
class NodeView:
    name: str
    url: str
    databases: tuple[str, ...] = ("*",)  # patterns
    holds: tuple[str, ...] = ()  # concrete databases the node holds, as it advertises them
    replicates: bool = False
    leader: bool = False
    static: bool = False
    version: int = 0


def merge(rows: dict[str, NodeRow], versions: dict[str, int], config: Config) -> dict[str, NodeView]:
    views: dict[str, NodeView] = {}
    for name, row in rows.items():
        try:
            url = normalize_url(row.url)
        except ValueError:
            continue  # a row with a broken URL cannot be dialled; the rest of the registry still works
        views[name] = NodeView(
            name=name,
            url=url,
            databases=tuple(row.databases),
            holds=tuple(sorted(row.holds)),
            replicates=row.replicates,
            leader=row.leader,
            version=versions.get(name, 0),
        )
    for peer in config.peers:
        row_view = views.get(peer.name)
        # The configured route wins over the advertised URL: an operator may reach a peer through a proxy.
        views[peer.name] = NodeView(
            name=peer.name,
            url=normalize_url(peer.url),
            databases=tuple(peer.databases),
            holds=row_view.holds if row_view else (),
            replicates=row_view.replicates if row_view else False,
            leader=row_view.leader if row_view else False,
            static=True,
            version=row_view.version if row_view else 0,
        )
    return views


def dials(config: Config, view: NodeView) -> bool:
    """Does this node subscribe to `view`? Static routes always; registered nodes when either side is in mesh mode."""
    if view.name == config.node.name:
        return False
    return view.static or view.replicates or config.replication.mesh


def databases_for(config: Config, view: NodeView) -> list[str]:
    """The databases to subscribe to from `view`: the system database, and what it holds that both sides want."""
    wanted = [SYSTEM]
    for database in view.holds:
        if database == SYSTEM:
            continue
        if database_matches(config.replication.databases, database) and database_matches(
            list(view.databases), database
        ):
            wanted.append(database)
    return wanted
