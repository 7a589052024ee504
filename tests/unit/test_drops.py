"""Applying deletion markers on a node (`coordinator.drops`), in virtual time with a fake supervisor and a real store:
what is purged, when a file is removed, and that it is removed only once every worker process has closed it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from replicator.coordinator.drops import RESEND, Drops, NotHeld
from replicator.coordinator.node import Node
from replicator.shared import dropped, messages
from replicator.shared.deletion import DeletionFloors
from replicator.shared.store import SYSTEM, DatabaseRemoving, Store
from tests.unit.fakeloop import VirtualTimeLoop
from tests.unit.test_coordinator import FakeSupervisor, add, make_node, peer
from tests.unit.test_store import FakeClock, rec

WALL = 1_700_000_000.0
TIMEOUT = 5.0


async def inline(function: Any, *args: Any) -> Any:
    return function(*args)


@pytest.fixture
def node(loop: VirtualTimeLoop, tmp_path: Path) -> Iterator[tuple[Node, FakeSupervisor]]:
    node, supervisor = make_node(loop)
    for slot, handle in supervisor.workers.items():
        handle.pid = 100 + slot
    clock = FakeClock(WALL)
    node.wall = lambda: clock.ns / 1e9
    node.store = Store(tmp_path / "data", "self", clock=clock)
    node.holds = {SYSTEM}
    node.drops = Drops(node, loop=loop, to_thread=inline, removal_timeout=TIMEOUT)
    yield node, supervisor
    node.store.close()


def _hold(node: Node, name: str, versions: list[int]) -> None:
    assert node.store is not None
    db = node.store.database(name, create=True)
    db.apply_batch([rec(f"r{v}", v, "b") for v in versions])
    db.finish_recovery()  # a store without holdings takes the file for an unknown one: recovered, as peers served it
    node.holds.add(name)


def _answer(node: Node, supervisor: FakeSupervisor, slots: list[int]) -> None:
    for _, slot, message in supervisor.of(messages.DropDatabase):
        if slot in slots:
            pid = supervisor.workers[slot].pid
            closed = messages.DatabaseClosed(database=message.database, worker=slot, pid=pid, request=message.request)
            node.on_worker_message(slot, closed)


def test_the_floors_are_what_this_node_holds_of_each_origin(node: tuple[Node, FakeSupervisor]) -> None:
    node_, _ = node
    drops = node_.drops
    # Whatever the clocks say: the floors are the versions this node holds, per origin, and nothing beyond them.
    ahead = int((WALL + 600) * 1_000_000)
    _hold(node_, "typo", [ahead, 7])
    node_.store.database("typo").apply_batch([rec("c1", 40, "c")])  # type: ignore[union-attr]
    assert drops.known("typo") and not drops.known("never")
    version, floors = drops.request("typo")
    assert floors == {"b": ahead, "c": 40} and version > 0
    assert dropped.floors(node_.system()) == {"typo": DeletionFloors(origins={"b": ahead, "c": 40})}
    # A database only the registry knows of is known, but this node has seen nothing of it to delete.
    add(node_, peer("b", 2000, holds=("elsewhere",)))
    assert drops.known("elsewhere")
    with pytest.raises(NotHeld):
        drops.request("elsewhere")


def test_an_emptied_database_is_removed_once_every_worker_closed_it(
    node: tuple[Node, FakeSupervisor], loop: VirtualTimeLoop
) -> None:
    node_, supervisor = node
    store = node_.store
    assert store is not None
    _hold(node_, "typo", [10, 20, 30])
    add(node_, peer("b", 2000, holds=("typo",)))
    assert any("typo" in entry.pairs for entry in node_.map)
    _, floors = node_.drops.request("typo")

    task = loop.create_task(node_.drops.apply())
    loop.advance(0.0)
    asked = supervisor.of(messages.DropDatabase)
    assert sorted(slot for _, slot, _ in asked) == [0, 1]
    # The pair went first (its Unsubscribe is ahead of the DropDatabase on the pipe), and nothing opens it here.
    order = [type(m).__name__ for _, _, m in supervisor.sent if getattr(m, "database", None) == "typo"]
    assert order.index("Unsubscribe") < order.index("DropDatabase")
    assert not any("typo" in entry.pairs for entry in node_.map)
    with pytest.raises(DatabaseRemoving):
        store.database("typo")
    _answer(node_, supervisor, [0])
    loop.advance(1.0)
    assert not task.done() and store.path("typo").exists()  # worker 1 still has it open

    _answer(node_, supervisor, [1])
    loop.advance(RESEND)
    assert task.done()
    assert task.result() == [{"database": "typo", "floors": floors, "removed": True, "records_removed": 3}]
    assert not store.path("typo").exists() and "typo" not in store.names()
    assert "typo" not in node_.holds
    released = supervisor.of(messages.ReleaseDatabase)
    assert sorted(slot for _, slot, _ in released) == [0, 1]
    # Written to again, it is born with the floors.
    db = store.database("typo", create=True)
    assert db.dropped_floor == DeletionFloors(origins=floors) and db.put("t", "new", b"v") > 0
    assert db.apply_batch([rec("r10", 10, "b")]) == 0 and db.apply_batch([rec("r31", 31, "b")]) == 1
    # And a later pass leaves what holds a record written after the deletion alone.
    supervisor.sent.clear()
    again = loop.create_task(node_.drops.apply())
    loop.advance(0.0)
    assert again.result() == [] and supervisor.of(messages.DropDatabase) == []


def test_a_worker_that_does_not_close_it_keeps_the_file_for_a_later_pass(
    node: tuple[Node, FakeSupervisor], loop: VirtualTimeLoop
) -> None:
    node_, supervisor = node
    store = node_.store
    assert store is not None
    _hold(node_, "typo", [10])
    node_.drops.request("typo")
    task = loop.create_task(node_.drops.apply())
    loop.advance(0.0)
    _answer(node_, supervisor, [0])
    # Worker 1 is replaced meanwhile: its successor is asked too, and the old one's answer would not count for it.
    supervisor.workers[1].pid = 201
    loop.advance(RESEND)
    assert [slot for _, slot, _ in supervisor.of(messages.DropDatabase)] == [0, 1, 1]
    loop.advance(TIMEOUT)
    assert task.done()
    (event,) = task.result()
    assert (event["removed"], event["records_removed"]) == (False, 1)
    assert store.path("typo").exists() and "typo" in node_.holds
    assert sorted(slot for _, slot, _ in supervisor.of(messages.ReleaseDatabase)) == [0, 1]
    assert store.database("typo").is_empty()  # unblocked; the next pass removes it

    supervisor.sent.clear()
    retry = loop.create_task(node_.drops.apply())
    loop.advance(0.0)
    _answer(node_, supervisor, [0, 1])
    loop.advance(RESEND)
    assert retry.done() and retry.result()[0]["removed"] is True
    assert retry.result()[0]["records_removed"] == 0
    assert not store.path("typo").exists()


def test_records_written_after_the_deletion_keep_the_database(
    node: tuple[Node, FakeSupervisor], loop: VirtualTimeLoop
) -> None:
    node_, supervisor = node
    store = node_.store
    assert store is not None
    _hold(node_, "typo", [10, 20])
    _, floors = node_.drops.request("typo")
    # Arrived after the deletion was asked: c's write (an origin the deletion had not seen) and b's newer one.
    store.database("typo").apply_batch([rec("later", 5, "c"), rec("newer", 21, "b")])
    task = loop.create_task(node_.drops.apply())
    loop.advance(0.0)
    assert task.result() == [{"database": "typo", "floors": floors, "removed": False, "records_removed": 2}]
    assert supervisor.of(messages.DropDatabase) == []
    assert "typo" in node_.holds
    assert [e.id for e in store.database("typo").scan("t", None, 10)] == ["later", "newer"]


def test_a_database_written_since_and_emptied_again_stays(
    node: tuple[Node, FakeSupervisor], loop: VirtualTimeLoop
) -> None:
    """Written after the deletion, then deleted and purged again: the file holds no record but its positions pass
    the floors. The database exists again (as on the peers that hold what was written since), so it stays."""
    node_, supervisor = node
    store = node_.store
    assert store is not None
    _hold(node_, "typo", [10, 20])
    _, floors = node_.drops.request("typo")
    db = store.database("typo")
    db.apply_batch([rec("later", 25, "b", tomb=True)], {"b": 25})
    assert db.drop_through(DeletionFloors(origins=floors)) == 2
    assert db.purge_tombstones({"b": 25}, 25) == 1 and db.is_empty()
    task = loop.create_task(node_.drops.apply())
    loop.advance(0.0)
    assert task.result() == []
    assert supervisor.of(messages.DropDatabase) == [] and store.path("typo").exists()
