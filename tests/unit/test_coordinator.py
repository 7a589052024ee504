"""The coordinator's decisions in virtual time: setups, re-drive timers, stall kicks, stale sweeps.

The node runs on the virtual-time loop with a fake supervisor that records every message it would send to a
worker, with the virtual time it was sent at. No process, no socket.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from replicator.coordinator.node import Node
from replicator.coordinator.registry import NodeView
from replicator.coordinator.replication_map import PairState, StallWatch, should_fire_stall_kick
from replicator.shared import messages
from replicator.shared.config import from_mapping
from replicator.shared.keys import connection_key
from tests.unit.fakeloop import VirtualTimeLoop

STAGGER = 0.05
WEDGE = 30.0
STALL = 900.0


@dataclass
class FakeHandle:
    slot: int
    alive: bool = True
    ready: bool = True
    retiring: bool = False
    restarts: int = 0
    pid: int = 0
    rss_bytes: int = 0
    exit_code: int | None = None
    boot_error: str = ""
    last_heartbeat: float = 0.0


@dataclass
class FakeSupervisor:
    loop: VirtualTimeLoop
    slots: int = 2
    deliver: bool = True
    sent: list[tuple[float, int, Any]] = field(default_factory=list)
    respawns: int = 0

    def __post_init__(self) -> None:
        self.workers = {slot: FakeHandle(slot) for slot in range(self.slots)}

    def live(self) -> list[int]:
        return [s for s, w in sorted(self.workers.items()) if w.alive and w.ready and not w.retiring]

    def is_live(self, slot: int | None) -> bool:
        worker = self.workers.get(slot) if slot is not None else None
        return worker is not None and worker.alive and not worker.retiring

    def all_ready(self) -> bool:
        return all(w.alive and w.ready for w in self.workers.values())

    def send(self, slot: int, message: Any) -> bool:
        if not self.deliver or not self.is_live(slot):
            return False
        self.sent.append((self.loop.time(), slot, message))
        return True

    def kill(self, slot: int) -> None:
        self.workers[slot].alive = False

    def of(self, kind: type) -> list[tuple[float, int, Any]]:
        return [item for item in self.sent if isinstance(item[2], kind)]


def make_node(loop: VirtualTimeLoop, rng: Any = None, slots: int = 2) -> tuple[Node, FakeSupervisor]:
    config = from_mapping(
        {
            "node": {"name": "self", "url": "wss://127.0.0.1:1000"},
            "replication": {
                "stagger": STAGGER,
                "wedge_threshold": WEDGE,
                "stall_threshold": STALL,
                "heartbeat_timeout": 86400.0,
            },
        },
        "",
    )
    supervisor = FakeSupervisor(loop, slots)
    node = Node(config, loop=loop, rng=rng or (lambda: 0.5), supervisor=supervisor)  # type: ignore[arg-type]
    return node, supervisor


def peer(name: str, port: int, holds: tuple[str, ...] = ("db",), leader: bool = False, version: int = 1) -> NodeView:
    return NodeView(name=name, url=f"wss://127.0.0.1:{port}", holds=holds, leader=leader, static=True, version=version)


def add(node: Node, view: NodeView) -> None:
    node.views[view.name] = view
    node.on_node_update(view)


def connect(node: Node, view: NodeView, database: str, worker: int, session: int) -> None:
    node.on_worker_message(
        worker,
        messages.Connected(key=connection_key(view.url), database=database, worker=worker, session=session),
    )


# -- setup and leadership ------------------------------------------------------------------------------------------


def test_a_storm_of_node_updates_dispatches_the_newest_payload_on_the_schedule(loop: VirtualTimeLoop) -> None:
    node, supervisor = make_node(loop)
    for i in range(6000):
        loop.advance_to(i * 0.01)
        add(node, peer("b", 2000, leader=i % 2 == 1, version=i + 1))
    loop.advance_to(60.0)
    dispatched = [(t, m) for t, _, m in supervisor.of(messages.Subscribe) if m.database == "db"]
    schedule = [0.3, 0.8, 1.7, 3.4, 6.7, 13.2, 26.1, 41.2, 56.3]
    # Each pair keeps its own schedule; the two pairs share the ladder, so db, armed second, takes the slot
    # `stagger` after system's.
    assert [round(t, 6) for t, _ in dispatched] == [round(t + STAGGER, 6) for t in schedule]
    system = [t for t, _, m in supervisor.of(messages.Subscribe) if m.database == "system"]
    assert [round(t, 6) for t in system] == schedule
    # Leadership is recomputed from the latest node state on every update, never carried forward.
    for when, message in dispatched:
        latest = round(when / 0.01) - 1
        assert message.leader == (latest % 2 == 1)
    assert node.scheduler.pending <= 2  # one per pair: db and system


def test_a_connect_report_resets_the_delay_and_cancels_nothing(loop: VirtualTimeLoop) -> None:
    node, supervisor = make_node(loop)
    view = peer("b", 2000)
    add(node, view)
    assert node.scheduler.is_armed(view.url, "db")
    connect(node, view, "db", worker=0, session=7)
    assert node.scheduler.is_armed(view.url, "db")
    loop.advance(1.0)
    assert any(m.database == "db" for _, _, m in supervisor.of(messages.Subscribe))


def test_node_updates_set_up_nothing_more_while_the_worker_sets_the_pair_up(loop: VirtualTimeLoop) -> None:
    """A peer whose row changes with every database it opens sends an update per database; each one used to set up
    again every pair still dialling, a no-op for the worker that took a slot of the ladder from a new pair."""
    node, supervisor = make_node(loop)
    add(node, peer("b", 2000))
    loop.advance(1.0)
    assert [(round(t, 6), m.database) for t, _, m in supervisor.of(messages.Subscribe)] == [
        (0.3, "system"),
        (0.35, "db"),
    ]
    for version in range(2, 60):  # updates while both sessions dial, with nothing reported yet
        add(node, peer("b", 2000, version=version))
        loop.advance(0.5)
    assert len(supervisor.of(messages.Subscribe)) == 2 and node.scheduler.pending == 0
    # db's dial failed: the next update sets it up again, on its schedule; system, still dialling, is left alone.
    entry = node.map.by_peer("b")
    assert entry is not None
    db_worker = entry.pairs["db"].placed
    failed = messages.Disconnected(key=entry.key, database="db", worker=db_worker, session=1, error="refused")
    node.on_worker_message(db_worker, failed)
    add(node, peer("b", 2000, version=60))
    assert node.scheduler.is_armed(entry.url, "db") and not node.scheduler.is_armed(entry.url, "system")
    # A changed subscription is set up whatever the worker is doing.
    add(node, peer("b", 2000, leader=True, version=61))
    assert node.scheduler.is_armed(entry.url, "system")
    # A worker that exits takes its setups with it: the stale sweep sets them up again on a live worker.
    for slot in {pair.placed for pair in entry.pairs.values()}:
        supervisor.workers[slot].alive = False
        node.on_worker_exit(supervisor.workers[slot])  # type: ignore[arg-type]
    assert all(pair.dispatched_to is None for pair in entry.pairs.values())


def test_exclusions_name_the_other_direct_peers_never_this_node(loop: VirtualTimeLoop) -> None:
    node, supervisor = make_node(loop)
    add(node, peer("b", 2000))
    add(node, peer("c", 3000))
    node.on_node_update(node.views["b"], event=False)
    loop.advance(1.0)
    latest = {(m.peer, m.database): m for _, _, m in supervisor.of(messages.Subscribe)}
    # Our own origin is always carried: a lost file gets our own writes back from the peers.
    assert latest[("b", "db")].exclude == ["c"]
    assert latest[("c", "db")].exclude == ["b"]


# -- the re-drive timer and its five disarm points -----------------------------------------------------------------


def _wedged(loop: VirtualTimeLoop) -> tuple[Node, FakeSupervisor, NodeView]:
    node, supervisor = make_node(loop)
    view = peer("b", 2000)
    add(node, view)
    loop.advance(1.0)
    entry = node.map.by_peer("b")
    assert entry is not None
    for database in ("system", "db"):
        accepted = messages.SubscribeAccepted(key=entry.key, database=database, dispatch=1)
        node.on_worker_message(entry.pairs[database].placed, accepted)
    loop.advance_to(WEDGE + 1.0)
    node.reconcile()
    entry = node.map.by_peer("b")
    assert entry is not None and entry.redrive is not None and entry.redrive_kind == "wedge"
    return node, supervisor, view


def _force_reconnects(supervisor: FakeSupervisor, key: str) -> list[Any]:
    return [m for _, _, m in supervisor.of(messages.ForceReconnect) if m.key == key]


def test_wedged_pair_is_redriven_by_its_owned_timer(loop: VirtualTimeLoop) -> None:
    node, supervisor, view = _wedged(loop)
    loop.advance(1.0)  # one draw of 0.5 in [0.2, 0.4): 0.3 s after the pass, then one slot per database
    assert _sends(supervisor, since=WEDGE) == [
        (WEDGE + 1.3, "force", connection_key(view.url), "system"),
        (WEDGE + 1.35, "force", connection_key(view.url), "db"),
    ]
    assert node.redrives["wedge"] == 2
    assert node.map.by_peer("b").redrive is None  # type: ignore[union-attr]


@pytest.mark.parametrize("point", ["unsubscribe", "node_deletion", "worker_exit", "entry_replacement", "url_migration"])
def test_the_redrive_timer_is_disarmed(loop: VirtualTimeLoop, point: str) -> None:
    node, supervisor, view = _wedged(loop)
    old_key = connection_key(view.url)
    entry = node.map.by_peer("b")
    assert entry is not None
    timer = entry.redrive
    if point == "unsubscribe":
        add(node, peer("b", 2000, holds=(), version=2))  # db no longer wanted
    elif point == "node_deletion":
        del node.views["b"]
        node.on_node_removed("b")
    elif point == "worker_exit":
        slot = entry.pairs["db"].placed
        supervisor.workers[slot].alive = False
        node.on_worker_exit(supervisor.workers[slot])  # type: ignore[arg-type]
    elif point == "entry_replacement":  # a pair of the entry found on a dead worker is placed again
        supervisor.workers[entry.pairs["db"].placed].alive = False
        node.on_database(node.views["b"], "db")
    elif point == "url_migration":
        add(node, peer("b", 2001, version=2))
    assert entry.redrive is None and timer.cancelled()
    loop.advance(5.0)
    assert _force_reconnects(supervisor, old_key) == []


def test_a_url_migration_never_reaches_the_old_address(loop: VirtualTimeLoop) -> None:
    node, supervisor, view = _wedged(loop)
    old_key = connection_key(view.url)
    add(node, peer("b", 2001, version=2))
    before = len(supervisor.sent)
    loop.advance(120.0)
    node.reconcile()
    loop.advance(120.0)
    later = supervisor.sent[before:]
    assert not [m for _, _, m in later if getattr(m, "key", None) == old_key]
    assert {m.url for _, _, m in later if isinstance(m, messages.Subscribe)} == {"wss://127.0.0.1:2001"}
    assert not node.scheduler.is_armed(view.url, "db")


# -- stall kicks ---------------------------------------------------------------------------------------------------


def _pair(worker: int = 0, session: int = 1, received: int = 10, head: int = 20) -> PairState:
    pair = PairState(database="db", payload=messages.Subscribe(key="k", peer="b", url="u", database="db"), created_at=0)
    pair.connected, pair.worker, pair.session = True, worker, session
    pair.last_received_seq, pair.peer_head_seq = received, head
    return pair


def test_stall_kick_decision_matrix() -> None:
    watch = StallWatch(worker=0, session=1, detected_at=0.0, seq=10)
    pair = _pair()
    pair.stall = watch
    assert should_fire_stall_kick(pair, watch)  # still stalled
    assert not should_fire_stall_kick(None, watch)  # pair gone
    released = _pair()
    assert not should_fire_stall_kick(released, watch)  # the monitored session released it
    progressed = _pair(received=11)
    progressed.stall = watch
    assert not should_fire_stall_kick(progressed, watch)
    caught_up = _pair(received=20, head=20)
    caught_up.stall = watch
    assert not should_fire_stall_kick(caught_up, watch)
    other_session = _pair(worker=1, session=99, received=500, head=500)
    other_session.stall = watch
    assert should_fire_stall_kick(other_session, watch)  # another session's report neither cancels nor releases


def _stalled(loop: VirtualTimeLoop) -> tuple[Node, FakeSupervisor, NodeView]:
    node, supervisor = make_node(loop)
    view = peer("b", 2000)
    add(node, view)
    connect(node, view, "system", worker=0, session=40)
    connect(node, view, "db", worker=0, session=41)
    key = connection_key(view.url)
    progress = messages.Progress(
        key=key, database="db", worker=0, session=41, last_received_seq=10, peer_head_seq=50,
        lag_seconds=3.0, applied=10,
    )  # fmt: skip
    node.on_worker_message(0, progress)
    loop.advance_to(STALL + 1.0)
    node.reconcile()
    entry = node.map.by_peer("b")
    assert entry is not None and entry.redrive_kind == "stall"
    return node, supervisor, view


def test_a_stalled_session_is_kicked_scoped_to_that_session(loop: VirtualTimeLoop) -> None:
    node, supervisor, view = _stalled(loop)
    loop.advance(1.0)
    kicks = _force_reconnects(supervisor, connection_key(view.url))
    assert [(k.database, k.session) for k in kicks] == [("db", 41)]
    assert node.redrives["stall"] == 1


def test_a_connect_report_from_another_session_does_not_cancel_the_kick(loop: VirtualTimeLoop) -> None:
    node, supervisor, view = _stalled(loop)
    connect(node, view, "db", worker=1, session=77)
    loop.advance(1.0)
    kicks = _force_reconnects(supervisor, connection_key(view.url))
    assert [(k.database, k.session) for k in kicks] == [("db", 41)]
    assert [slot for _, slot, m in supervisor.of(messages.ForceReconnect)] == [0]


def test_progress_from_the_monitored_session_releases_the_kick(loop: VirtualTimeLoop) -> None:
    node, supervisor, view = _stalled(loop)
    node.on_worker_message(
        0,
        messages.Progress(
            key=connection_key(view.url),
            database="db",
            worker=0,
            session=41,
            last_received_seq=11,
            peer_head_seq=50,
            lag_seconds=1.0,
            applied=11,
        ),
    )
    loop.advance(1.0)
    assert _force_reconnects(supervisor, connection_key(view.url)) == []


def test_the_monitored_session_ending_releases_the_kick(loop: VirtualTimeLoop) -> None:
    node, supervisor, view = _stalled(loop)
    node.on_worker_message(
        0, messages.Disconnected(key=connection_key(view.url), database="db", worker=0, session=41, error="gone")
    )
    loop.advance(1.0)
    assert _force_reconnects(supervisor, connection_key(view.url)) == []


def test_revived_pair_starts_with_a_clean_stall_stamp(loop: VirtualTimeLoop) -> None:
    node, _, view = _stalled(loop)
    add(node, peer("b", 2000, holds=(), version=2))  # unsubscribe db
    add(node, peer("b", 2000, holds=("db",), version=3))  # and want it again
    pair = node.map.pair(connection_key(view.url), "db")
    assert pair is not None
    assert pair.stall is None and pair.stall_kicked_at is None and pair.last_progress_at is None
    assert pair.created_at == loop.time() and not pair.connected


# -- stale-worker reassignment --------------------------------------------------------------------------------------


def test_a_dead_workers_pairs_move_in_one_sweep_spaced_by_the_stagger(loop: VirtualTimeLoop) -> None:
    draws = iter([0.999, 0.0, 0.5, 0.1, 0.9, 0.3, 0.7, 0.2] * 100)
    node, supervisor = make_node(loop, rng=lambda: next(draws), slots=3)
    views = [peer(f"p{i}", 2000 + i) for i in range(8)]
    for view in views:
        add(node, view)
    loop.advance(2.0)
    for view in views:  # the pairs are up; some pairs had escalated schedules first
        for database in ("system", "db"):
            entry = node.map.by_peer(view.name)
            assert entry is not None
            connect(node, view, database, worker=entry.pairs[database].placed, session=1)
    victim = node.map.by_peer("p0").pairs["system"].placed  # type: ignore[union-attr]
    moved = [(e.peer, d) for e in node.map for d in e.on_worker(victim)]
    assert len(moved) >= 2
    supervisor.sent.clear()
    supervisor.workers[victim].alive = False
    node.on_worker_exit(supervisor.workers[victim])  # type: ignore[arg-type]
    loop.advance(9.0)  # within failover_after: no route changes join the sweep
    times = sorted(t for t, slot, m in supervisor.of(messages.Subscribe))
    assert len(times) == len(moved)
    assert sorted((m.peer, m.database) for _, _, m in supervisor.of(messages.Subscribe)) == sorted(moved)
    assert all(b - a >= STAGGER - 1e-9 for a, b in itertools.pairwise(times))
    assert all(slot != victim for _, slot, _ in supervisor.of(messages.Subscribe))
    assert node.reassignments == len(moved)


# -- every path keeps the stagger (invariant 2) ---------------------------------------------------------------------


def _accept_all(node: Node, view: NodeView) -> None:
    entry = node.map.by_peer(view.name)
    assert entry is not None
    for database, pair in entry.pairs.items():
        accepted = messages.SubscribeAccepted(key=entry.key, database=database, dispatch=1)
        node.on_worker_message(pair.placed, accepted)


def _sends(supervisor: FakeSupervisor, since: float = 0.0) -> list[tuple[float, str, str, str]]:
    """(time, kind, peer url, database) of every setup and forced reconnect sent at or after `since`."""
    out = []
    for when, _, message in supervisor.sent:
        if when < since:
            continue
        if isinstance(message, messages.Subscribe):
            out.append((round(when, 9), "setup", message.url, message.database))
        elif isinstance(message, messages.ForceReconnect):
            out.append((round(when, 9), "force", message.key, message.database))
    return out


def _assert_spaced(times: list[float]) -> None:
    ordered = sorted(times)
    assert all(b - a >= STAGGER - 1e-9 for a, b in itertools.pairwise(ordered)), ordered


def test_an_entrys_wedged_databases_are_redriven_one_slot_each(loop: VirtualTimeLoop) -> None:
    node, supervisor = make_node(loop)
    view = peer("b", 2000, holds=("db1", "db2"))
    add(node, view)
    loop.advance(1.0)
    _accept_all(node, view)
    entry = node.map.by_peer("b")
    assert entry is not None and list(entry.pairs) == ["system", "db1", "db2"]
    loop.advance_to(WEDGE + 1.0)
    node.reconcile()
    # The entry owns one timer at a time: the first slot now, each next slot armed when the previous one fires.
    first = entry.redrive
    assert first is not None and entry.redrive_kind == "wedge"
    loop.advance_to(WEDGE + 1.3)
    assert entry.redrive is not None and entry.redrive is not first and entry.redrive_kind == "wedge"
    loop.advance(5.0)
    assert _sends(supervisor, since=WEDGE) == [
        (WEDGE + 1.3, "force", view.url, "system"),
        (WEDGE + 1.35, "force", view.url, "db1"),
        (WEDGE + 1.4, "force", view.url, "db2"),
    ]
    assert entry.redrive is None
    assert node.redrives["wedge"] == 3
    assert 'replicator_redrives_total{kind="wedge"} 3.0' in node.metrics.render().decode()
    # Each re-driven pair waits another threshold before the next re-drive.
    node.reconcile()
    assert entry.redrive is None


def test_dropping_an_entry_mid_redrive_cancels_its_timer_and_frees_its_slot(loop: VirtualTimeLoop) -> None:
    node, supervisor = make_node(loop)
    view = peer("b", 2000, holds=("db1", "db2"))
    add(node, view)
    loop.advance(1.0)
    _accept_all(node, view)
    loop.advance_to(WEDGE + 1.0)
    node.reconcile()
    loop.advance_to(WEDGE + 1.3)  # system re-driven; db1's slot at 31.35 is claimed
    entry = node.map.by_peer("b")
    assert entry is not None
    timer = entry.redrive
    assert timer is not None and round(timer.when, 9) == WEDGE + 1.35
    node.on_node_removed("b")
    assert timer.cancelled() and entry.redrive is None
    assert [round(t, 9) for t in node.ladder.claimed] == [WEDGE + 1.3]  # the fired slot stays, db1's is free
    add(node, peer("c", 3000))  # a setup armed now may take the freed slot
    loop.advance(5.0)
    assert _sends(supervisor, since=WEDGE) == [
        (WEDGE + 1.3, "force", view.url, "system"),
        (WEDGE + 1.6, "setup", "wss://127.0.0.1:3000", "system"),
        (WEDGE + 1.65, "setup", "wss://127.0.0.1:3000", "db"),
    ]


def test_a_registry_update_adding_several_pairs_dispatches_them_stagger_apart(
    loop: VirtualTimeLoop, tmp_path: Any
) -> None:
    from replicator.shared import membership, revocation
    from replicator.shared.store import NodeRow, Store
    from replicator.shared.tls import create_ca, issue_node_cert

    create_ca(tmp_path / "ca")
    node, supervisor = make_node(loop)
    node.store = Store(tmp_path, "self")
    node.verifier = membership.Verifier(revocation.load_ca_cert(tmp_path / "ca" / "ca.pem"))
    try:
        system = node.system()
        loop.advance_to(10.0)
        for name, port in (("b", 2000), ("c", 3000)):
            signer = membership.Signer.load(name, *issue_node_cert(tmp_path / "ca", name, ["127.0.0.1"], tmp_path))
            row = NodeRow(name=name, url=f"wss://127.0.0.1:{port}", replicates=True, holds=["db1", "db2"])
            system.apply_batch([membership.signed_entry(signer, membership.NODES, row, 1_700_000_000_000_000)])
        node.sync_registry(system)  # one update: two peers, three pairs each, every draw 0.5 (0.3 s)
        loop.advance(5.0)
        assert _sends(supervisor) == [
            (10.3, "setup", "wss://127.0.0.1:2000", "system"),
            (10.35, "setup", "wss://127.0.0.1:2000", "db1"),
            (10.4, "setup", "wss://127.0.0.1:2000", "db2"),
            (10.45, "setup", "wss://127.0.0.1:3000", "system"),
            (10.5, "setup", "wss://127.0.0.1:3000", "db1"),
            (10.55, "setup", "wss://127.0.0.1:3000", "db2"),
        ]
    finally:
        node.store.close()


def test_a_registry_change_looks_only_at_the_nodes_it_changed_and_a_poke_at_all(
    loop: VirtualTimeLoop, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass over every pair per registry change is O(pairs) per new row, and peers write a row per database they
    open: only the nodes whose view changed are looked at, and everything after a poke."""
    from replicator.shared import membership, revocation
    from replicator.shared.store import NodeRow, Store
    from replicator.shared.tls import create_ca, issue_node_cert

    create_ca(tmp_path / "ca")
    node, _ = make_node(loop)
    node.store = Store(tmp_path, "self")
    node.verifier = membership.Verifier(revocation.load_ca_cert(tmp_path / "ca" / "ca.pem"))
    looked: list[str] = []
    update = node.on_node_update

    def on_node_update(view: NodeView, event: bool = True) -> None:
        looked.append(view.name)
        update(view, event)

    monkeypatch.setattr(node, "on_node_update", on_node_update)
    try:
        system = node.system()
        signers = {
            name: membership.Signer.load(name, *issue_node_cert(tmp_path / "ca", name, ["127.0.0.1"], tmp_path))
            for name in ("b", "c")
        }

        def write_row(name: str, port: int, holds: list[str], version: int) -> None:
            row = NodeRow(name=name, url=f"wss://127.0.0.1:{port}", replicates=True, holds=holds)
            system.apply_batch([membership.signed_entry(signers[name], membership.NODES, row, version)])

        write_row("b", 2000, ["db1"], 1_700_000_000_000_000)
        write_row("c", 3000, ["db1"], 1_700_000_000_000_000)
        node.sync_registry(system)
        assert looked == ["b", "c"]
        write_row("b", 2000, ["db1", "db2"], 1_700_000_000_000_001)
        looked.clear()
        node.sync_registry(system)
        assert looked == ["b"]
        assert sorted(node.map.by_peer("b").pairs) == ["db1", "db2", "system"]  # type: ignore[union-attr]
        looked.clear()
        node.sync_registry(system)
        assert looked == []
        node.poke_registry()
        node.sync_registry(system)
        assert looked == ["b", "c"]
    finally:
        node.store.close()


def test_databases_opened_together_are_advertised_in_one_row(
    loop: VirtualTimeLoop, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The own row lists every database the node holds, and each new row is a registry change on every peer: a
    burst of new databases is written as one row, on the registry watcher's next turn."""
    from replicator.shared import membership, revocation
    from replicator.shared.store import Store
    from replicator.shared.tls import create_ca, issue_node_cert

    create_ca(tmp_path / "ca")
    node, _ = make_node(loop)
    node.store = Store(tmp_path, "self")
    node.verifier = membership.Verifier(revocation.load_ca_cert(tmp_path / "ca" / "ca.pem"))
    node.signer = membership.Signer.load("self", *issue_node_cert(tmp_path / "ca", "self", ["127.0.0.1"], tmp_path))
    node.holds = {"system"}
    written: list[tuple[float, list[str]]] = []
    write = membership.write

    def counted(db: Any, signer: Any, table: str, row: Any) -> int:
        written.append((loop.time(), sorted(row.holds)))
        return write(db, signer, table, row)

    monkeypatch.setattr(membership, "write", counted)
    watcher = loop.create_task(node._registry_loop())
    try:
        loop.advance(1.0)
        assert written == [(0.0, ["system"])]
        for name in ("d1", "d2", "d3"):
            node.on_worker_message(0, messages.DatabaseOpened(name=name))
        assert len(written) == 1 and node.holds == {"system", "d1", "d2", "d3"}
        loop.advance(1.0)
        assert written[1:] == [(1.2, ["d1", "d2", "d3", "system"])]
        own = node.verifier.own_row(node.system(), "self")
        assert own is not None and sorted(own[0].holds) == ["d1", "d2", "d3", "system"]
    finally:
        watcher.cancel()
        loop.run(asyncio.gather(watcher, return_exceptions=True))
        node.store.close()


def test_a_node_whose_certificate_is_revoked_writes_no_row_until_it_has_a_new_one(
    loop: VirtualTimeLoop, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """`node remove --revoke`: the revocation reaches the node before the deletion of its row (one origin, in
    order), so the node does not write its row back; a certificate issued after the revocation writes it again."""
    from replicator.shared import membership, revocation
    from replicator.shared.store import Store
    from replicator.shared.tls import create_ca, issue_node_cert

    create_ca(tmp_path / "ca")
    node, _ = make_node(loop)
    node.store = Store(tmp_path, "self")
    node.verifier = membership.Verifier(revocation.load_ca_cert(tmp_path / "ca" / "ca.pem"))
    node.signer = membership.Signer.load("self", *issue_node_cert(tmp_path / "ca", "self", ["127.0.0.1"], tmp_path))
    system = node.system()
    try:
        node._write_own_row(system)
        assert node.verifier.own_row(system, "self") is not None
        signed = revocation.sign(tmp_path / "ca", "self", now=9_999_999_999.0)
        system.put(revocation.TABLE, signed.record_id, revocation.encode(signed))
        system.delete(membership.NODES, "self")
        for _ in range(2):
            node._write_own_row(system)
        assert node.verifier.own_row(system, "self") is None
        events = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
        logged = [e for e in events if e["event"] == "own_certificate_revoked"]
        assert len(logged) == 1 and "self: every certificate" in logged[0]["reason"], logged

        # Only certificates issued before the revocation are revoked; this one is issued after it.
        system.delete(revocation.TABLE, signed.record_id)
        spared = revocation.sign(tmp_path / "ca", "self", now=1.0)
        system.put(revocation.TABLE, spared.record_id, revocation.encode(spared))
        node._write_own_row(system)
        assert node.verifier.own_row(system, "self") is not None
    finally:
        node.store.close()


def test_a_registry_update_during_a_stale_sweep_keeps_the_spacing(loop: VirtualTimeLoop) -> None:
    node, supervisor = make_node(loop, slots=3)
    b = peer("b", 2000)
    add(node, b)
    loop.advance(1.0)
    entry = node.map.by_peer("b")
    assert entry is not None
    for database in ("system", "db"):  # resets the pairs' delays to the first, 0.3 s
        connect(node, b, database, worker=entry.pairs[database].placed, session=1)
    loop.advance_to(10.0)
    # b's two pairs are on two workers, which exit one after the other: both pairs move on the one ladder.
    victims = [entry.pairs["system"].placed, entry.pairs["db"].placed]
    assert len(set(victims)) == 2
    for slot in victims:
        supervisor.workers[slot].alive = False
        node.on_worker_exit(supervisor.workers[slot])  # type: ignore[arg-type]
    loop.advance_to(10.02)
    # 20 ms into the stale sweep, a registry update adds c: its own delays put it at 10.32, 20 ms from b's
    # system setup; the shared ladder moves it to the first free slots after the sweep's.
    add(node, peer("c", 3000))
    loop.advance_to(11.0)
    node.reconcile()  # and a pass in between adds nothing (no stale entry, nothing wedged)
    loop.advance(5.0)
    assert _sends(supervisor, since=10.0) == [
        (10.3, "setup", b.url, "system"),
        (10.35, "setup", b.url, "db"),
        (10.4, "setup", "wss://127.0.0.1:3000", "system"),
        (10.45, "setup", "wss://127.0.0.1:3000", "db"),
    ]


def test_wedge_redrives_registry_setups_and_a_stale_sweep_share_one_ladder(loop: VirtualTimeLoop) -> None:
    node, supervisor = make_node(loop, slots=4)  # one pair a worker: c's two workers can die, b's stay
    b, c, e = peer("b", 2000), peer("c", 3000), peer("e", 5000)
    add(node, b)
    add(node, c)
    loop.advance(2.0)
    _accept_all(node, b)  # b's pairs are accepted and never connect: they wedge and are forced to reconnect
    c_entry, b_entry = node.map.by_peer("c"), node.map.by_peer("b")
    assert c_entry is not None and b_entry is not None
    victims = {pair.placed for pair in c_entry.pairs.values()}
    assert not victims & {pair.placed for pair in b_entry.pairs.values()}
    for database in ("system", "db"):  # c is up on its workers, which then die: the stale sweep moves it
        connect(node, c, database, worker=c_entry.pairs[database].placed, session=1)
    loop.advance_to(WEDGE + 1.0)
    node.reconcile()  # b is wedged: its first re-drive takes the slot at 31.3
    for slot in (c_entry.pairs["system"].placed, c_entry.pairs["db"].placed):
        supervisor.workers[slot].alive = False
        node.on_worker_exit(supervisor.workers[slot])  # type: ignore[arg-type]
    add(node, e)  # and a new peer from the registry, at the same instant
    loop.advance(5.0)
    sends = _sends(supervisor, since=WEDGE)
    # Every draw is 0.5 (0.3 s): all would fire at 31.3 without the shared ladder. The wedge re-drive holds 31.3;
    # e, a new direct peer, changes b's exclusions, so b's pairs are set up again with the new route on the
    # ladder, and the re-drive finds them armed (the schedule's, not wedged) and sends nothing of its own.
    assert sends == [
        (WEDGE + 1.35, "setup", e.url, "system"),
        (WEDGE + 1.4, "setup", e.url, "db"),
        (WEDGE + 1.5, "setup", c.url, "system"),
        (WEDGE + 1.55, "setup", c.url, "db"),
        (WEDGE + 1.6, "setup", b.url, "system"),
        (WEDGE + 1.65, "setup", b.url, "db"),
    ]
    _assert_spaced([t for t, *_ in sends])


# -- registry watcher restarts ---------------------------------------------------------------------------------------


def test_the_registry_watcher_restarts_on_the_schedule(loop: VirtualTimeLoop, tmp_path: Any) -> None:
    from replicator.shared.store import Store

    node, _ = make_node(loop)
    node.store = Store(tmp_path, "self")
    calls: list[float] = []
    healthy_until = {"t": -1.0}

    def sync(system: Any) -> None:
        calls.append(loop.time())
        if loop.time() > healthy_until["t"]:
            raise RuntimeError("registry unreadable")

    node.sync_registry = sync  # type: ignore[method-assign]
    task = loop.create_task(node._registry_loop())
    try:
        loop.advance(16.0)
        # Full jitter on 1 -> 30 s with draws of 0.5: waits of 0.5, 1, 2, 4, 8 s between the failed iterations.
        assert calls == pytest.approx([0.0, 0.5, 1.5, 3.5, 7.5, 15.5])
        # An iteration that comes up and throws at once is a failure: the delay keeps growing, up to 30 s.
        loop.advance(16.0)
        assert calls[-1] == pytest.approx(30.5)
        # The next iteration (at 45.5 s) comes up and stays live; a change read 12.5 s later fails. It stayed
        # live past 10 s, so the schedule was reset and the restart waits 0.5 s again.
        healthy_until["t"] = 57.5
        loop.advance_to(58.0)
        assert calls[-1] == pytest.approx(45.5)
        node.poke_registry()
        loop.advance(0.3)
        assert calls[-1] == pytest.approx(58.0)
        loop.advance(1.0)
        assert calls[-1] == pytest.approx(58.5)
    finally:
        task.cancel()
        loop.run(asyncio.gather(task, return_exceptions=True))
        node.store.close()


def test_the_wedge_clock_of_a_pair_that_never_connected_starts_at_its_latest_dispatch(loop: VirtualTimeLoop) -> None:
    """Time a pair spent wanted but not yet dispatched (a long ladder of new pairs) is the schedule's, not a
    wedge; a pair whose setup is armed is never re-driven on top of it."""
    node, supervisor = make_node(loop)
    add(node, peer("b", 2000))
    loop.advance(1.0)
    _accept_all(node, peer("b", 2000))
    loop.advance_to(25.0)
    add(node, peer("b", 2000, leader=True, version=2))  # a new payload: both pairs are set up again
    loop.advance(1.0)
    dispatched = max(t for t, _, m in supervisor.of(messages.Subscribe))
    assert dispatched > 25.0
    loop.advance_to(WEDGE + 5.0)  # 35 s after the pairs were wanted, about 10 s since their dispatch
    node.reconcile()
    loop.advance(1.0)
    assert node.redrives["wedge"] == 0
    loop.advance_to(dispatched + WEDGE + 0.5)
    node.reconcile()
    loop.advance(1.0)
    assert node.redrives["wedge"] == 2  # system and db, one slot each


def test_a_pair_backing_off_on_its_own_schedule_is_not_wedged(loop: VirtualTimeLoop) -> None:
    """A long outage: the worker's session keeps failing and says when it dials again. Forcing a dial every
    threshold past that schedule would redial every pair of the node each 35 s (the fleet simulation's finding);
    only a pair whose promised retry passed by the threshold without a report is wedged."""
    node, supervisor = make_node(loop)
    add(node, peer("b", 2000))
    loop.advance(1.0)
    _accept_all(node, peer("b", 2000))
    entry = node.map.by_peer("b")
    assert entry is not None
    for database in ("system", "db"):
        slot = entry.pairs[database].placed
        node.on_worker_message(slot, messages.Connected(key=entry.key, database=database, worker=slot, session=1))
    loop.advance_to(10.0)
    # The peer goes away; the sessions back off, reporting each failed attempt and the next dial (up to 30 s).
    when, session, delay = 10.0, 1, 1.0
    while when < 200.0:
        for database in ("system", "db"):
            report = messages.Disconnected(
                key=entry.key,
                database=database,
                worker=entry.pairs[database].placed,
                session=session,
                error="connection refused",
                reconnect_in=delay,
                attempts=session,
            )
            node.on_worker_message(entry.pairs[database].placed, report)
        when, session, delay = when + delay, session + 1, min(30.0, delay * 2)
        loop.advance_to(when)
        node.reconcile()
    loop.advance(1.0)
    assert node.redrives["wedge"] == 0
    assert _force_reconnects(supervisor, entry.key) == []
    # The worker goes silent (its session is stuck): once the promised dial is a threshold late, it is re-driven.
    last_due = when
    loop.advance_to(last_due + WEDGE - 1.0)
    node.reconcile()
    loop.advance(0.5)
    assert node.redrives["wedge"] == 0
    loop.advance_to(last_due + WEDGE + 0.5)
    node.reconcile()
    loop.advance(1.0)
    assert node.redrives["wedge"] == 2


# -- tombstone purge ---------------------------------------------------------------------------------------------


def test_tombstones_wait_for_every_holder_and_the_retention(loop: VirtualTimeLoop, tmp_path: Any) -> None:
    from replicator.shared.store import Store

    node, _ = make_node(loop)
    node.store = Store(tmp_path, "self")
    db = node.store.database("db", create=True)
    db.finish_recovery()  # a new file counts its own writes only once its peers have served theirs back
    db.put_many("t", [("x", b"1"), ("y", b"2")])
    tombstone = db.delete("t", "x")
    assert tombstone is not None
    for view in (peer("b", 2000), peer("c", 3000), peer("d", 4000, holds=("other",))):
        node.views[view.name] = view
    # c, a holder, has not said what it holds: nothing of "db" may go. d does not hold it.
    node.on_worker_message(0, messages.PeerHolds(peer="b", database="db", complete={"self": tombstone}))
    assert "db" not in node.retention.floors()
    node.on_worker_message(0, messages.PeerHolds(peer="c", database="db", complete={"self": tombstone - 1}))
    assert node.retention.floors()["db"] == {"self": tombstone - 1}
    node.on_worker_message(0, messages.PeerHolds(peer="c", database="db", complete={"self": tombstone + 5}))
    floors = node.retention.floors()["db"]
    assert floors == {"self": tombstone}  # our own file holds up to our newest write
    node.config.replication.tombstone_retention = 3600.0
    node.wall = lambda: tombstone / 1e6 + 60  # the tombstone is a minute old: younger than the retention
    assert node.retention.purge("db", floors) == 0
    node.wall = lambda: tombstone / 1e6 + 3601
    assert node.retention.purge("db", floors) == 1
    assert db.fetch("t", ["x", "y"])[0][0].id == "y"
    # A holder removed from the registry no longer holds anything back.
    node.on_node_removed("c")
    assert ("db", "c") not in node.peer_holds


def test_a_slow_copy_is_warned_about_once_per_session(
    loop: VirtualTimeLoop, capsys: pytest.CaptureFixture[str]
) -> None:

    from replicator.shared import messages

    node, _ = make_node(loop)
    pair = PairState(
        database="db",
        payload=messages.Subscribe(key="k", peer="b", url="wss://x:1", database="db"),
        created_at=0.0,
        connected=True,
        connected_at=0.0,
        session=7,
        backlog=1_000_000,
    )

    def report(at: float, received: int) -> None:
        pair.received, pair.received_bytes = received, received * 100
        node._warn_slow_copy("k", pair, at)

    report(10.0, 5_000)  # slow, but too early to tell
    report(40.0, 10_000)  # 0.025 MB/s with an hour to go: warned
    report(50.0, 12_000)  # the same session: not again
    pair.session, pair.connected_at = 8, 60.0
    report(100.0, 990_000)  # a new session, fast: nothing
    events = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    slow = [e for e in events if e["event"] == "copy_slow"]
    assert [(e["database"], e["records"], e["total"], e["mb_s"]) for e in slow] == [("db", 10_000, 1_000_000, 0.03)]


# -- route changes under a storm of new links (issue 21: 3,000 introductions stalled the coordinator 221 s) ---------


def test_a_storm_of_new_links_renews_each_pair_once_and_logs_what_changed(
    loop: VirtualTimeLoop, capsys: pytest.CaptureFixture[str]
) -> None:
    """A registry pass that adds 200 direct links changes every pair's exclusions once, not once per link, and the
    route change writes one line saying what changed (capped lists and counts), not every pair's whole exclusion."""

    from replicator.shared.logs import LOGGED_NAMES

    node, supervisor = make_node(loop)
    b, c = peer("b", 2000), peer("c", 3000)
    add(node, b)
    add(node, c)
    loop.advance(2.0)  # every pair of b and c dispatched, and up
    for view in (b, c):
        entry = node.map.by_peer(view.name)
        assert entry is not None
        for database in ("system", "db"):
            connect(node, view, database, worker=entry.pairs[database].placed, session=1)
    capsys.readouterr()
    ghosts = [
        NodeView(name=f"g{i:03d}", url=f"wss://127.0.0.1:{10000 + i}", holds=(), static=True, version=1)
        for i in range(200)
    ]
    for ghost in ghosts:  # one registry pass
        add(node, ghost)
    loop.advance(1.0)
    events = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    # The ghosts hold nothing but the system database: only its pairs change, each set up again once.
    (route,) = [e for e in events if e["event"] == "route_changed"]
    assert route["database"] == "system" and "exclude" not in route
    assert (route["pairs"], route["peers"]) == (2, ["b", "c"])
    assert (route["added"], route["added_count"]) == ([g.name for g in ghosts[:LOGGED_NAMES]], 200)
    assert (route["removed"], route["removed_count"]) == ([], 0)
    armed = [e for e in events if e["event"] == "subscription_setup_armed" and e["peer"] in ("b", "c")]
    assert sorted((e["peer"], e["database"]) for e in armed) == [("b", "system"), ("c", "system")]
    # No ghost ever connects: all fail over at one timer's time, one more route change.
    loop.advance(node.config.replication.failover_after + 1.0)
    events = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    (route,) = [e for e in events if e["event"] == "route_changed"]
    assert route["removed_count"] == 200 and len(route["removed"]) == LOGGED_NAMES
    assert route["pairs"] >= 2 and len(route["peers"]) <= LOGGED_NAMES
    assert node.router.exclude("system", "b") == ["c"]
    # Every pair holds the route as it stands.
    for entry in node.map:
        for database, pair in entry.pairs.items():
            assert pair.payload.exclude == node.router.exclude(database, entry.peer)
    assert len(supervisor.of(messages.Subscribe)) > 0
