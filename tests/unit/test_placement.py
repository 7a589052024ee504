"""Placement by (peer, database), in virtual time: each pair is placed on a worker of its own.

New pairs go to the worker with the fewest pairs placed (round-robin among equals), so the databases of even a few peers
spread over every worker; a worker's exit moves only its pairs, spread over the others on the stagger ladder, and a
respawned worker takes its share back once it has stayed up; scaling moves pairs onto new workers, and off retiring
ones, on the same ladder. The node runs with the fake supervisor of tests/unit/test_coordinator.py, which records every
message sent with its virtual time.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from typing import Any

import pytest

from replicator.coordinator.admin import status_document
from replicator.coordinator.node import Node
from replicator.coordinator.supervisor import RESPAWN_HEALTHY_UPTIME
from replicator.shared import messages
from tests.unit.fakeloop import VirtualTimeLoop
from tests.unit.test_coordinator import STAGGER, FakeHandle, FakeSupervisor, add, connect, make_node, peer

DATABASES = ("db1", "db2", "db3", "db4", "db5")


def placements(node: Node) -> dict[tuple[str, str], int]:
    return {(entry.peer, database): pair.placed for entry in node.map for database, pair in entry.pairs.items()}


def up(node: Node, names: tuple[str, ...] = ("b", "c")) -> None:
    """Every pair of the named peers connected on the worker it is placed on."""
    for name in names:
        entry = node.map.by_peer(name)
        assert entry is not None
        for database, pair in entry.pairs.items():
            connect(node, node.views[name], database, worker=pair.placed, session=1)


def subscribes(supervisor: FakeSupervisor, since: float = 0.0) -> list[tuple[float, int, str, str]]:
    """(time, worker, peer, database) of every setup sent at or after `since`."""
    return [
        (round(when, 9), slot, message.peer, message.database)
        for when, slot, message in supervisor.of(messages.Subscribe)
        if when >= since
    ]


def events(capsys: pytest.CaptureFixture[str], name: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("event") == name]


def _two_peers(loop: VirtualTimeLoop, slots: int = 3) -> tuple[Node, FakeSupervisor]:
    node, supervisor = make_node(loop, slots=slots)
    add(node, peer("b", 2000, holds=DATABASES))
    add(node, peer("c", 3000, holds=DATABASES))
    loop.advance(2.0)
    return node, supervisor


def test_the_pairs_of_two_peers_spread_over_three_workers(loop: VirtualTimeLoop) -> None:
    node, supervisor = _two_peers(loop)
    placed = placements(node)
    assert len(placed) == 12  # system and five databases, of each of two peers
    assert Counter(placed.values()) == {0: 4, 1: 4, 2: 4}
    for name in ("b", "c"):  # one peer's databases are on every worker
        assert {worker for (p, _), worker in placed.items() if p == name} == {0, 1, 2}
    # Each setup went to the worker its pair is placed on, stagger apart on the one ladder.
    sent = subscribes(supervisor)
    assert [(worker, (p, d)) for _, worker, p, d in sent] == [(placed[(p, d)], (p, d)) for _, _, p, d in sent]
    assert [t for t, *_ in sent] == [round(0.3 + STAGGER * i, 9) for i in range(12)]
    # /status says where each pair is, and which workers carry each connection.
    up(node)
    for connection in status_document(node)["connections"]:
        assert connection["workers"] == [0, 1, 2]
        for pair in connection["databases"]:
            assert pair["worker"] == pair["placed"] == placed[(connection["peer"], pair["database"])]


def test_placement_is_deterministic(loop: VirtualTimeLoop) -> None:
    first = placements(_two_peers(loop)[0])
    with VirtualTimeLoop() as other:
        assert placements(_two_peers(other)[0]) == first


def test_a_dead_workers_pairs_spread_over_the_others_on_the_ladder(
    loop: VirtualTimeLoop, capsys: pytest.CaptureFixture[str]
) -> None:
    node, supervisor = _two_peers(loop)
    up(node)
    before = placements(node)
    victim = 1
    moved = sorted(key for key, worker in before.items() if worker == victim)
    assert len(moved) == 4
    loop.advance_to(10.0)
    supervisor.sent.clear()
    capsys.readouterr()
    supervisor.workers[victim].alive = False
    node.on_worker_exit(supervisor.workers[victim])  # type: ignore[arg-type]
    loop.advance(5.0)
    sent = subscribes(supervisor)
    # Only the dead worker's pairs are set up again, each on the worker it is now placed on: half on each of the
    # two others. The connect reset their delays to the first draw (0.3 s), and the ladder spaces them.
    assert sorted((p, d) for _, _, p, d in sent) == moved
    assert [t for t, *_ in sent] == [10.3, 10.35, 10.4, 10.45]
    after = placements(node)
    assert Counter(after[key] for key in moved) == {0: 2, 2: 2}
    assert all(worker == after[(p, d)] for _, worker, p, d in sent)
    assert {key: worker for key, worker in after.items() if key not in moved} == {
        key: worker for key, worker in before.items() if key not in moved
    }
    assert not supervisor.of(messages.Unsubscribe)  # the pairs elsewhere keep their sessions
    reassigned = events(capsys, "stale_reassigned")
    assert sorted((e["peer"], e["database"]) for e in reassigned) == moved
    assert all(e["worker"] == after[(e["peer"], e["database"])] != victim for e in reassigned)
    assert node.reassignments == 4


def test_a_respawned_worker_in_the_same_slot_gets_no_pair_back_by_itself(loop: VirtualTimeLoop) -> None:
    """The sessions died with the process: a pair is never left placed on a slot whose new worker never had it."""
    node, supervisor = _two_peers(loop)
    up(node)
    supervisor.workers[2].alive = False
    node.on_worker_exit(supervisor.workers[2])  # type: ignore[arg-type]
    supervisor.workers[2].alive = True  # respawned before the sweep's setups fire
    loop.advance(5.0)
    assert 2 not in placements(node).values()


def _respawn(node: Node, supervisor: FakeSupervisor, slot: int, pid: int) -> None:
    """The slot's worker exited earlier and comes back: a new process, ready."""
    handle = supervisor.workers[slot]
    handle.alive, handle.pid, handle.restarts = True, pid, handle.restarts + 1
    node.on_worker_message(slot, messages.Ready(worker=slot, pid=pid))


def _killed(node: Node, supervisor: FakeSupervisor, slot: int) -> None:
    supervisor.workers[slot].alive = False
    node.on_worker_exit(supervisor.workers[slot])  # type: ignore[arg-type]


def test_a_respawned_worker_takes_its_share_back_once_it_has_stayed_up(
    loop: VirtualTimeLoop, capsys: pytest.CaptureFixture[str]
) -> None:
    node, supervisor = _two_peers(loop)
    up(node)
    loop.advance_to(10.0)
    _killed(node, supervisor, 1)
    loop.advance(5.0)
    up(node)  # its four pairs connected on the two others
    assert Counter(placements(node).values()) == {0: 6, 2: 6}
    _respawn(node, supervisor, 1, pid=201)
    supervisor.sent.clear()
    capsys.readouterr()
    loop.advance_to(15.0 + RESPAWN_HEALTHY_UPTIME - 0.001)
    assert not supervisor.sent  # nothing moves before the worker has stayed up
    loop.advance(5.0)
    placed = placements(node)
    assert Counter(placed.values()) == {0: 4, 1: 4, 2: 4}
    back = sorted(key for key, worker in placed.items() if worker == 1)
    # Two from each busy worker, in turn: unsubscribed there, set up on the respawned one on the ladder.
    unsubscribed = [(slot, message.database) for _, slot, message in supervisor.of(messages.Unsubscribe)]
    assert Counter(slot for slot, _ in unsubscribed) == {0: 2, 2: 2}
    sent = subscribes(supervisor)
    assert sorted((p, d) for _, _, p, d in sent) == back
    assert {worker for _, worker, _, _ in sent} == {1}
    assert [t for t, *_ in sent] == [25.3, 25.35, 25.4, 25.45]
    assert [(e["worker"], e["moved"]) for e in events(capsys, "worker_rebalanced")] == [(1, 4)]


def test_a_worker_that_exits_again_before_it_stayed_up_is_given_nothing(
    loop: VirtualTimeLoop, capsys: pytest.CaptureFixture[str]
) -> None:
    node, supervisor = _two_peers(loop)
    up(node)
    loop.advance_to(10.0)
    _killed(node, supervisor, 1)
    loop.advance(5.0)
    up(node)
    _respawn(node, supervisor, 1, pid=201)
    loop.advance(RESPAWN_HEALTHY_UPTIME / 2)
    _killed(node, supervisor, 1)  # a crash loop: its timer goes with it
    loop.advance(1.0)
    _respawn(node, supervisor, 1, pid=202)
    capsys.readouterr()
    loop.advance(RESPAWN_HEALTHY_UPTIME - 0.001)
    assert 1 not in placements(node).values()
    assert not events(capsys, "worker_rebalanced")
    loop.advance(5.0)
    assert Counter(placements(node).values()) == {0: 4, 1: 4, 2: 4}
    assert [e["moved"] for e in events(capsys, "worker_rebalanced")] == [4]


class ScalingSupervisor(FakeSupervisor):
    """The fake supervisor, with the two lifecycle calls scaling makes: spawn (ready at once) and retire."""

    def __init__(self, loop: VirtualTimeLoop, slots: int) -> None:
        super().__init__(loop, slots)
        self.retired: list[int] = []

    def spawn(self, slot: int) -> FakeHandle:
        handle = self.workers[slot] = FakeHandle(slot)
        return handle

    def send(self, slot: int, message: Any) -> bool:
        """As the real supervisor: a retiring worker still running takes messages (its pairs' unsubscribes)."""
        worker = self.workers.get(slot)
        if not self.deliver or worker is None or not worker.alive:
            return False
        self.sent.append((self.loop.time(), slot, message))
        return True

    def retire(self, slot: int, deadline: float) -> None:
        self.workers[slot].retiring = True
        self.retired.append(slot)


def _scaling_node(loop: VirtualTimeLoop, slots: int) -> tuple[Node, ScalingSupervisor]:
    node, _ = make_node(loop, slots=slots)
    supervisor = ScalingSupervisor(loop, slots)
    node.supervisor = supervisor  # type: ignore[assignment]
    add(node, peer("b", 2000, holds=DATABASES))
    add(node, peer("c", 3000, holds=DATABASES))
    loop.advance(2.0)
    up(node)
    loop.advance_to(10.0)
    supervisor.sent.clear()
    return node, supervisor


def test_scaling_up_moves_pairs_onto_the_new_workers_until_the_load_is_even(loop: VirtualTimeLoop) -> None:
    node, supervisor = _scaling_node(loop, slots=2)
    before = placements(node)
    assert Counter(before.values()) == {0: 6, 1: 6}
    loop.run(node.scale(4))
    loop.advance(5.0)
    after = placements(node)
    # Twelve pairs on four workers: three each. Each old worker gave up three, to the new ones in turn.
    assert Counter(after.values()) == {0: 3, 1: 3, 2: 3, 3: 3}
    moved = sorted(key for key in after if after[key] != before[key])
    assert len(moved) == 6 and all(after[key] in (2, 3) for key in moved)
    assert Counter(before[key] for key in moved) == {0: 3, 1: 3}
    # Each moved pair is unsubscribed on the worker it left, and nothing else is.
    unsubscribed = sorted((slot, m.database) for _, slot, m in supervisor.of(messages.Unsubscribe))
    assert unsubscribed == sorted((before[key], key[1]) for key in moved)
    sent = subscribes(supervisor)
    assert sorted((p, d) for _, _, p, d in sent) == moved
    assert all(worker == after[(p, d)] for _, worker, p, d in sent)
    # The moves are on the ladder: the first draw (0.3 s), then one stagger each.
    assert [t for t, *_ in sent] == [round(10.3 + STAGGER * i, 9) for i in range(6)]
    assert node.reassignments == 6


def test_scaling_up_leaves_no_new_worker_below_the_even_share_rounded_down(loop: VirtualTimeLoop) -> None:
    """Ten pairs (four databases and the system database of two peers) on two workers, 5 and 5, scaled to three: the
    new worker takes one beyond the share (4) from each and one more from the busiest, so the load ends 4, 3, 3
    and not 4, 4, 2."""
    node, _ = make_node(loop, slots=2)
    supervisor = ScalingSupervisor(loop, 2)
    node.supervisor = supervisor  # type: ignore[assignment]
    add(node, peer("b", 2000, holds=DATABASES[:4]))
    add(node, peer("c", 3000, holds=DATABASES[:4]))
    loop.advance(2.0)
    up(node)
    loop.advance_to(10.0)
    before = placements(node)
    assert Counter(before.values()) == {0: 5, 1: 5}
    loop.run(node.scale(3))
    loop.advance(5.0)
    after = placements(node)
    assert Counter(after.values())[2] == 3 and sorted(Counter(after.values()).values()) == [3, 3, 4]
    moved = [key for key in after if after[key] != before[key]]
    assert len(moved) == 3 and all(after[key] == 2 for key in moved)
    assert node.reassignments == 3


def test_scaling_down_spreads_the_retiring_workers_pairs_over_the_rest(loop: VirtualTimeLoop) -> None:
    node, supervisor = _scaling_node(loop, slots=4)
    before = placements(node)
    assert Counter(before.values()) == {0: 3, 1: 3, 2: 3, 3: 3}
    loop.run(node.scale(2))
    loop.advance(5.0)
    after = placements(node)
    assert supervisor.retired == [2, 3]
    assert Counter(after.values()) == {0: 6, 1: 6}
    moved = sorted(key for key in after if after[key] != before[key])
    assert moved == sorted(key for key, worker in before.items() if worker in (2, 3))
    assert sorted(slot for _, slot, _ in supervisor.of(messages.Unsubscribe)) == [2, 2, 2, 3, 3, 3]
    sent = subscribes(supervisor)
    assert sorted((p, d) for _, _, p, d in sent) == moved
    assert [t for t, *_ in sent] == [round(10.3 + STAGGER * i, 9) for i in range(6)]
    assert all(b - a >= STAGGER - 1e-9 for a, b in itertools.pairwise(t for t, *_ in sent))


def test_the_load_placement_keeps_is_the_count_of_every_pair_after_each_change(loop: VirtualTimeLoop) -> None:
    """`ReplicationMap.load` is counted once and then kept as pairs are placed (placing a thousand databases'
    pairs is linear); after each other change (a pair dropped, a worker's exit, a move) it is what a fresh count of
    every pair says."""
    node, supervisor = _scaling_node(loop, slots=3)

    def kept_is_fresh() -> None:
        live = node.supervisor.live()
        fresh = Counter(pair.placed for entry in node.map for pair in entry.pairs.values() if pair.placed in live)
        assert node.map.load(live) == {slot: fresh.get(slot, 0) for slot in live}

    kept_is_fresh()
    add(node, peer("d", 4000, holds=DATABASES))  # six more pairs placed one by one
    kept_is_fresh()
    add(node, peer("b", 2000, holds=("db1",)))  # b's pairs of db2..db5 dropped
    loop.advance(2.0)
    kept_is_fresh()
    supervisor.workers[1].alive = False
    node.on_worker_exit(supervisor.workers[1])  # type: ignore[arg-type]
    kept_is_fresh()
    loop.advance(5.0)
    kept_is_fresh()
    assert 1 not in placements(node).values()
    loop.run(node.scale(5))
    loop.advance(5.0)
    kept_is_fresh()
    spread = Counter(placements(node).values())
    assert max(spread.values()) - min(spread.values()) <= 1
