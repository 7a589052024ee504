"""The databases peers' rows may make a node create: data.max_databases, held and planned counted together, the
rest left out per peer and offered again when room is made (coordinator.database_limit); and the store's own limit,
which holds across the processes of a node (shared.store)."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from replicator.coordinator.database_limit import DatabaseLimit
from replicator.coordinator.registry import NodeView
from replicator.shared.store import Store, TooManyDatabases
from tests.unit.fakeloop import VirtualTimeLoop
from tests.unit.test_coordinator import make_node


def test_the_room_is_shared_by_what_is_held_and_what_is_planned() -> None:
    limit = DatabaseLimit()
    limit.held("system")
    limit.held("mine")
    assert limit.count == 1  # the system database is not counted
    admitted, changed = limit.admit("b", ["system", "mine", "d1", "d2", "d3", "d4"], 3)
    assert admitted == ["system", "mine", "d1", "d2"] and changed
    assert limit.left_out_of("b") == ("d3", "d4")
    for database in admitted:
        limit.pair_added(database)
    assert limit.count == 3
    # The same row again: what it got it keeps, nothing new, nothing logged again.
    assert limit.admit("b", ["system", "mine", "d1", "d2", "d3", "d4"], 3) == (["system", "mine", "d1", "d2"], False)
    # Another peer: what is planned already costs no room, the rest is left out for it too.
    assert limit.admit("c", ["system", "d2", "d5"], 3) == (["system", "d2"], True)
    limit.pair_added("system")
    limit.pair_added("d2")
    assert limit.left_out() == ["d3", "d4", "d5"]
    # A session created d1: held now, no longer planned, the count the same.
    limit.held("d1")
    assert limit.count == 3
    # d2 loses one of its two pairs: no room yet; then its last, before any file of it was made: room.
    assert not limit.pair_removed("d2")
    assert limit.pair_removed("d2") and limit.waiting
    assert limit.count == 2
    assert limit.admit("c", ["system", "d5"], 3) == (["system", "d5"], True)
    assert limit.left_out_of("c") == ()
    # A held database's last pair going makes no room: the file stays.
    assert not limit.pair_removed("d1")
    limit.removed("d1")
    assert limit.count == 1
    limit.forget_peer("b")
    assert not limit.waiting


def test_a_peer_listing_more_databases_than_the_limit_gets_pairs_for_the_room_left(loop: VirtualTimeLoop) -> None:
    node, _ = make_node(loop)
    node.config.data.max_databases = 50
    node.holds = {"system", "mine"}
    for database in node.holds:
        node.database_limit.held(database)
    names = tuple(sorted(f"db{i:04d}" for i in range(1500)))
    view = NodeView(name="mallet", url="wss://127.0.0.1:4000", holds=names, replicates=True, static=True, version=1)
    node.views["mallet"] = view
    node.on_node_update(view)
    entry = node.map.by_peer("mallet")
    assert entry is not None
    assert sorted(entry.pairs) == sorted(["system", *names[:49]])
    assert node.database_limit.left_out() == list(names[49:])
    # The peer drops one it was given: the room goes to the next on the next full pass, and only then.
    node._sync_all = False
    smaller = NodeView(name="mallet", url=view.url, holds=names[1:], replicates=True, static=True, version=2)
    node.views["mallet"] = smaller
    node.on_node_update(smaller)
    assert node._sync_all  # poked: room was made for a database left out
    assert sorted(entry.pairs) == sorted(["system", *names[1:49]])
    node.on_node_update(smaller)  # the full pass
    assert sorted(entry.pairs) == sorted(["system", *names[1:50]])
    assert node.database_limit.left_out() == list(names[50:])
    assert node.database_limit.count == 50


def _create(directory: str, names: list[str], limit: int, queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    made = refused = 0
    with Store(directory, "a", max_databases=limit) as store:
        for name in names:
            try:
                store.database(name, create=True)
                made += 1
            except TooManyDatabases:
                refused += 1
    queue.put((made, refused))


def test_the_store_creates_no_database_past_the_limit_whichever_process_asks(tmp_path: Path) -> None:
    with Store(tmp_path, "a", max_databases=3) as store:
        store.database("system", create=True)
        for name in ("x", "y", "z"):
            store.database(name, create=True)
        with pytest.raises(TooManyDatabases, match=r"holds 3 databases, the limit \(data.max_databases = 3\)"):
            store.database("w", create=True)
        store.database("x", create=True)  # held already: not a creation
    # Two processes creating at once, 30 names each, 20 places in all.
    context = multiprocessing.get_context("spawn")
    queue: multiprocessing.Queue = context.Queue()  # type: ignore[type-arg]
    directory = tmp_path / "shared"
    directory.mkdir()
    processes = [
        context.Process(target=_create, args=(str(directory), [f"p{k}-{i}" for i in range(30)], 20, queue))
        for k in range(2)
    ]
    for process in processes:
        process.start()
    results = [queue.get(timeout=60) for _ in processes]
    for process in processes:
        process.join(60)
    assert sum(made for made, _ in results) == 20
    assert sum(refused for _, refused in results) == 40
    assert len(list(directory.glob("*.sqlite"))) == 20
