"""Which setups take a slot of the stagger ladder when workers share one link per peer (issue 23), in virtual time.

The ladder spaces TLS handshakes: a setup to a worker whose link to the peer is up, or whose dial is in flight,
is a stream frame and takes no slot (`coordinator.links.Links.needs_slot`). The node runs with the fake supervisor
of tests/unit/test_coordinator.py (every message sent, with its virtual time) and a constant draw of 0.5, so a
pair's first setup comes due 0.3 s after it is armed.
"""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict

from replicator.coordinator.admin import status_document
from replicator.coordinator.links import DIAL_SHARE_WINDOW, Links
from replicator.coordinator.node import Node
from replicator.coordinator.setup_scheduler import SetupScheduler, Sweep
from replicator.shared import messages
from replicator.shared.keys import connection_key
from replicator.workers.session import DIAL_TIMEOUT
from tests.unit.fakeloop import VirtualTimeLoop
from tests.unit.test_coordinator import STAGGER, WEDGE, FakeHandle, FakeSupervisor, add, make_node, peer


def sharing_node(loop: VirtualTimeLoop, slots: int = 2) -> tuple[Node, FakeSupervisor]:
    """A node whose workers are ready and say they share one link per peer URL."""
    node, supervisor = make_node(loop, slots=slots)
    for slot in range(slots):
        node.on_worker_message(slot, messages.Ready(worker=slot, pid=100 + slot, links=True))
    return node, supervisor


def b_holds(node: Node, count: int, version: int = 1) -> None:
    """Peer b (port 2000) holds `count` databases, and the system database, at `version` of its view."""
    add(node, peer("b", 2000, holds=databases(count), version=version))


def key_of(node: Node, name: str) -> str:
    return connection_key(node.views[name].url)


def link(node: Node, slot: int, name: str, up: bool, streams: int = 0) -> None:
    key = key_of(node, name)
    node.on_worker_message(slot, messages.LinkState(worker=slot, peer=name, key=key, up=up, streams=streams))


def links_of_both_workers(node: Node, name: str, up: bool, streams: int = 0) -> None:
    for slot in (0, 1):
        link(node, slot, name, up, streams)


def claim_times(ladder: Sweep) -> list[float]:
    """When each slot of the ladder was claimed."""
    return [round(when, 9) for when in ladder.claimed]


def kicks(supervisor: FakeSupervisor) -> list[float]:
    """When each force reconnect was sent."""
    return [round(when, 9) for when, _, _ in supervisor.of(messages.ForceReconnect)]


def sent(supervisor: FakeSupervisor, since: float = 0.0) -> list[tuple[float, int, str, str]]:
    """(time, worker, peer, database) of every subscribe sent at or after `since`."""
    return [
        (round(when, 9), slot, message.peer, message.database)
        for when, slot, message in supervisor.of(messages.Subscribe)
        if when >= since
    ]


def databases(count: int, prefix: str = "db") -> tuple[str, ...]:
    return tuple(f"{prefix}{i:03}" for i in range(count))


def test_a_link_state_crosses_the_pipe(loop: VirtualTimeLoop) -> None:
    state = messages.LinkState(worker=1, peer="b", key="wss://b:1", up=True, streams=3)
    reader = asyncio.StreamReader(loop=loop)
    reader.feed_data(messages.frame(state) + messages.frame(messages.Ready(worker=1, pid=7, links=True)))
    assert loop.run_until_complete(messages.read_to_coordinator(reader)) == state
    assert loop.run_until_complete(messages.read_to_coordinator(reader)).links  # type: ignore[union-attr]


def test_the_share_window_is_the_workers_dial_timeout() -> None:
    assert DIAL_SHARE_WINDOW == DIAL_TIMEOUT


def test_a_hundred_pairs_of_one_peer_on_two_workers_take_one_slot_per_worker(loop: VirtualTimeLoop) -> None:
    node, supervisor = sharing_node(loop)
    b_holds(node, 99)  # and the system database: 100 pairs
    loop.advance(2.0)
    setups = sent(supervisor)
    assert len(setups) == 100
    by_worker: dict[int, list[float]] = defaultdict(list)
    for when, worker, _, _ in setups:
        by_worker[worker].append(when)
    assert {worker: len(times) for worker, times in by_worker.items()} == {0: 50, 1: 50}
    # One dial per worker, `stagger` apart; every other setup of that worker shares it, right after it.
    first, second = sorted(by_worker, key=lambda worker: by_worker[worker][0])
    assert set(by_worker[first]) == {0.3}
    assert set(by_worker[second]) == {round(0.3 + STAGGER, 9)}
    assert setups[0][1] == first and setups[50][1] == second  # the dial goes first, its streams after it
    assert Counter(when for when, *_ in setups) == {0.3: 50, round(0.3 + STAGGER, 9): 50}
    # Only the two dials claimed slots: a later handshake keeps `stagger` from the second, not from the streams.
    assert claim_times(node.ladder) == [0.3, round(0.3 + STAGGER, 9)]


def test_without_link_sharing_every_setup_takes_a_slot(loop: VirtualTimeLoop) -> None:
    node, supervisor = make_node(loop)  # workers that said nothing of links: one dial per pair
    b_holds(node, 9)
    loop.advance(2.0)
    assert [when for when, *_ in sent(supervisor)] == [round(0.3 + STAGGER * i, 9) for i in range(10)]


def test_on_a_live_link_setups_go_at_their_own_time_and_a_link_down_takes_a_slot_again(loop: VirtualTimeLoop) -> None:
    node, supervisor = sharing_node(loop)
    b_holds(node, 3)
    loop.advance(2.0)
    links_of_both_workers(node, "b", up=True, streams=2)
    # Two new databases on live links: no slot, both at their own due time.
    b_holds(node, 5, version=2)
    loop.advance(1.0)
    new = sent(supervisor, since=2.0)
    assert sorted(worker for _, worker, *_ in new) == [0, 1]
    assert [when for when, *_ in new] == [2.3, 2.3]
    # Both links close (less than the share window after their dials): the next setups dial, `stagger` apart.
    links_of_both_workers(node, "b", up=False)
    b_holds(node, 7, version=3)
    loop.advance(1.0)
    again = sent(supervisor, since=3.0)
    assert sorted(worker for _, worker, *_ in again) == [0, 1]
    assert [when for when, *_ in again] == [3.3, round(3.3 + STAGGER, 9)]


def test_a_dial_is_shared_only_within_the_window(loop: VirtualTimeLoop) -> None:
    node, supervisor = sharing_node(loop, slots=1)
    b_holds(node, 1)
    loop.advance(1.0)
    assert [when for when, *_ in sent(supervisor)] == [0.3, 0.3]  # one dial, one stream sharing it
    # Within the window, with no report since, a new database shares the dial in flight.
    b_holds(node, 2, version=2)
    loop.advance(1.0)
    assert [when for when, *_ in sent(supervisor, since=1.0)] == [1.3]
    # Past the window the dial has come up (and been reported) or failed: two new databases dial once again.
    loop.advance_to(0.3 + DIAL_SHARE_WINDOW + 1.0)
    start = loop.time()
    b_holds(node, 4, version=3)
    loop.advance(1.0)
    assert [when for when, *_ in sent(supervisor, since=start)] == [round(start + 0.3, 9)] * 2
    assert round(node.ladder.claimed[-1], 9) == round(start + 0.3, 9)  # the first of them took a slot


def test_a_respawned_worker_forgets_its_links(loop: VirtualTimeLoop) -> None:
    node, supervisor = sharing_node(loop)
    b_holds(node, 3)
    loop.advance(2.0)
    links_of_both_workers(node, "b", up=True, streams=2)
    key = key_of(node, "b")
    assert status_document(node)["connections"][0]["links"] == [0, 1]
    # Worker 0 dies: its pairs move to worker 1, whose link is up, with no slot, at their own due time (their second
    # setup: 0.5 s on their schedule).
    supervisor.workers[0].alive = False
    node.on_worker_exit(FakeHandle(0, alive=False))  # type: ignore[arg-type]
    assert not node.links.is_up(0, key)
    assert status_document(node)["connections"][0]["links"] == [1]
    loop.advance(1.0)
    moved = sent(supervisor, since=2.0)
    assert [(when, worker) for when, worker, *_ in moved] == [(2.5, 1), (2.5, 1)]
    # Respawned, it starts with no link: its first setup dials (a slot), the next shares that dial.
    supervisor.workers[0].alive = True
    node.on_worker_message(0, messages.Ready(worker=0, pid=200, links=True))
    b_holds(node, 5, version=2)
    loop.advance(1.0)
    new = sent(supervisor, since=3.0)
    assert [(when, worker) for when, worker, *_ in new] == [(3.3, 0), (3.3, 0)]
    assert claim_times(node.ladder) == [3.3]  # the older claims are pruned


def test_a_ready_without_links_forgets_what_the_slot_shared(loop: VirtualTimeLoop) -> None:
    node, _ = sharing_node(loop, slots=1)
    b_holds(node, 1)
    link(node, 0, "b", up=True)
    key = key_of(node, "b")
    assert not node.links.needs_slot((0, key), loop.time())
    node.on_worker_message(0, messages.Ready(worker=0, pid=300))  # a respawn by a worker that dials per pair
    assert node.links.needs_slot((0, key), loop.time())


def test_two_peers_keep_their_dials_stagger_apart(loop: VirtualTimeLoop) -> None:
    node, supervisor = sharing_node(loop)
    b_holds(node, 9)
    add(node, peer("c", 3000, holds=databases(9)))
    loop.advance(2.0)
    setups = sent(supervisor)
    assert len(setups) == 20
    times: dict[tuple[str, int], set[float]] = defaultdict(set)
    for when, worker, name, _ in setups:
        times[(name, worker)].add(when)
    # Each (peer, worker) is one dial with its streams at the same time; the four dials are `stagger` apart.
    assert all(len(at) == 1 for at in times.values())
    dials = sorted(next(iter(at)) for at in times.values())
    assert dials == [round(0.3 + STAGGER * i, 9) for i in range(4)]
    assert {name for name, _ in times} == {"b", "c"}
    assert claim_times(node.ladder) == dials


def wedged_node(loop: VirtualTimeLoop) -> tuple[Node, FakeSupervisor]:
    """Two pairs of b on worker 0, accepted and never connected, wedged once the threshold has passed."""
    node, supervisor = sharing_node(loop, slots=1)
    b_holds(node, 1)
    loop.advance(1.0)
    key = key_of(node, "b")
    for database in ("system", "db000"):
        node.on_worker_message(0, messages.SubscribeAccepted(key=key, database=database, dispatch=1))
    loop.advance_to(WEDGE + 1.0)
    return node, supervisor


def test_force_reconnects_on_a_live_link_take_no_slot(loop: VirtualTimeLoop) -> None:
    node, supervisor = wedged_node(loop)
    link(node, 0, "b", up=True, streams=2)
    claimed = node.ladder.claimed
    node.reconcile()  # one re-drive per entry, one database per firing: base 0.3 s
    loop.advance(1.0)
    assert kicks(supervisor) == [WEDGE + 1.3, WEDGE + 1.3]
    assert node.ladder.claimed == claimed


def test_force_reconnects_with_the_link_down_take_slots(loop: VirtualTimeLoop) -> None:
    node, supervisor = wedged_node(loop)
    node.reconcile()
    loop.advance(1.0)
    assert kicks(supervisor) == [WEDGE + 1.3, round(WEDGE + 1.3 + STAGGER, 9)]


def test_a_force_reconnect_armed_on_a_live_link_that_closes_takes_a_slot(loop: VirtualTimeLoop) -> None:
    node, supervisor = wedged_node(loop)
    link(node, 0, "b", up=True, streams=2)
    node.reconcile()
    link(node, 0, "b", up=False)  # before the re-drive fires
    loop.advance(1.0)
    assert kicks(supervisor) == [WEDGE + 1.3, round(WEDGE + 1.3 + STAGGER, 9)]
    assert claim_times(node.ladder)[-2:] == kicks(supervisor)


def test_a_setup_waiting_for_a_dial_that_is_cancelled_claims_its_own_slot(loop: VirtualTimeLoop) -> None:
    placed = {"x": (1, "k"), "a": (0, "k"), "b": (0, "k")}
    links = Links(lambda url, database: placed[database])
    links.sharing(0)
    links.sharing(1)
    dispatched: list[tuple[float, str]] = []
    scheduler = SetupScheduler(
        lambda url, database, payload: dispatched.append((round(loop.time(), 9), database)),
        loop=loop,
        rng=lambda: 0.5,
        stagger=STAGGER,
        links=links,
    )
    ladder = scheduler.sweep()
    scheduler.schedule("wss://p", "x", None, sweep=ladder)  # the dial of worker 1: 0.3
    scheduler.schedule("wss://p", "a", None, sweep=ladder)  # the dial of worker 0: 0.35
    scheduler.schedule("wss://p", "b", None, sweep=ladder)  # shares a's dial: no slot, due at 0.3
    loop.advance_to(0.32)
    assert dispatched == [(0.3, "x")]  # b came due before the dial it shares: it waits for it
    scheduler.cancel("wss://p", "a")
    loop.advance(1.0)
    # b dials itself on the first free slot, `stagger` after x.
    assert dispatched == [(0.3, "x"), (0.35, "b")]
    assert claim_times(ladder) == [0.3, 0.35]
