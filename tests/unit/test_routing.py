"""Route selection in virtual time: which origin goes over which link, when it fails over, when it moves back."""

from __future__ import annotations

import itertools

import pytest

from replicator.coordinator.routing import Mode, Router
from replicator.shared import messages
from replicator.shared.keys import connection_key
from tests.unit.fakeloop import VirtualTimeLoop
from tests.unit.test_coordinator import add, connect, make_node, peer

FAILOVER = 10.0


@pytest.fixture
def loop() -> VirtualTimeLoop:
    loop = VirtualTimeLoop()
    yield loop
    loop.close()


def make_router(loop: VirtualTimeLoop) -> tuple[Router, list[tuple[float, str]]]:
    changes: list[tuple[float, str]] = []
    router = Router(FAILOVER, lambda database: changes.append((loop.time(), database)), loop=loop)
    return router, changes


def test_each_direct_origin_comes_only_over_its_own_link(loop: VirtualTimeLoop) -> None:
    router, changes = make_router(loop)
    for name in ("b", "c", "d"):
        router.track("db", name)
        router.report("db", name, up=True, caught_up=True)
    assert router.exclude("db", "b") == ["c", "d"]
    assert router.exclude("db", "c") == ["b", "d"]
    # A peer that is not a direct link (behind another node, removed, dead) is excluded nowhere.
    assert router.exclude("db", "e") == ["b", "c", "d"]
    assert router.exclude("other", "b") == []
    loop.advance(100.0)
    assert changes == []


def test_a_link_down_fails_over_after_exactly_failover_after(loop: VirtualTimeLoop) -> None:
    router, changes = make_router(loop)
    for name in ("b", "c"):
        router.track("db", name)
        router.report("db", name, up=True, caught_up=True)
    loop.advance_to(5.0)
    router.report("db", "c", up=False)
    loop.advance_to(14.999)
    assert changes == [] and router.mode("db", "c") is Mode.DIRECT
    loop.advance_to(15.0)
    assert changes == [(15.0, "db")]
    assert router.mode("db", "c") is Mode.FAILED_OVER
    assert router.exclude("db", "b") == []  # b now carries c's writes
    assert router.failed_over() == {"db": ["c"]}


def test_it_moves_back_once_the_link_has_been_up_and_caught_up_for_failover_after(loop: VirtualTimeLoop) -> None:
    router, changes = make_router(loop)
    for name in ("b", "c"):
        router.track("db", name)
        router.report("db", name, up=True, caught_up=True)
    router.report("db", "c", up=False)
    loop.advance_to(20.0)
    assert changes == [(10.0, "db")]
    router.report("db", "c", up=True)  # connected, still catching up: b keeps carrying c, and no wait starts
    loop.advance_to(21.0)
    router.report("db", "c", up=True, caught_up=False)
    assert router.exclude("db", "b") == [] and len(changes) == 1
    assert loop.pending_timers() == []
    loop.advance_to(22.5)
    router.report("db", "c", up=True, caught_up=True)  # stable from here: back at 32.5 unless it drops
    assert [timer.when() for timer in loop.pending_timers()] == [32.5]
    loop.advance_to(32.499)
    assert len(changes) == 1 and router.mode("db", "c") is Mode.FAILED_OVER
    loop.advance_to(32.5)
    assert changes == [(10.0, "db"), (32.5, "db")]
    assert router.exclude("db", "b") == ["c"]
    assert router.failed_over() == {}
    assert loop.pending_timers() == []


def test_a_link_dropping_every_two_seconds_fails_over_at_its_third_drop(loop: VirtualTimeLoop) -> None:
    router, changes = make_router(loop)
    for name in ("b", "c"):
        router.track("db", name)
        router.report("db", name, up=True, caught_up=True)
    for drop in (1.0, 3.0):
        loop.advance_to(drop)
        router.report("db", "c", up=False)
        loop.advance_to(drop + 0.5)
        router.report("db", "c", up=True, caught_up=True)
    loop.advance_to(5.0)
    assert changes == [] and router.mode("db", "c") is Mode.DIRECT
    router.report("db", "c", up=False)  # the third drop within failover_after: on the healthy path now
    assert changes == [(5.0, "db")]
    assert router.exclude("db", "b") == [] and router.failed_over() == {"db": ["c"]}
    # It keeps dropping every 2 s until 19.0: each drop restarts the wait, so the route stays put.
    for drop in range(7, 21, 2):
        loop.advance_to(drop - 1.5)
        router.report("db", "c", up=True, caught_up=True)
        loop.advance_to(drop)
        router.report("db", "c", up=False)
    loop.advance_to(19.5)
    router.report("db", "c", up=True, caught_up=True)
    # Last drop at 19.0, up and caught up at 19.5 and stable since: back exactly failover_after later.
    assert changes == [(5.0, "db")]
    loop.advance_to(29.499)
    assert router.mode("db", "c") is Mode.FAILED_OVER
    loop.advance_to(29.5)
    assert changes == [(5.0, "db"), (29.5, "db")]
    assert router.exclude("db", "b") == ["c"]
    loop.advance(100.0)
    assert len(changes) == 2 and loop.pending_timers() == []


def test_a_single_short_flap_changes_nothing(loop: VirtualTimeLoop) -> None:
    router, changes = make_router(loop)
    router.track("db", "c")
    router.report("db", "c", up=True, caught_up=True)
    loop.advance_to(1.0)
    router.report("db", "c", up=False)
    assert [timer.when() for timer in loop.pending_timers()] == [11.0]
    loop.advance_to(1.5)
    router.report("db", "c", up=True, caught_up=True)
    assert loop.pending_timers() == []
    loop.advance(100.0)
    assert changes == [] and router.mode("db", "c") is Mode.DIRECT


def test_flapping_counts_the_drops_of_the_last_failover_after_only(loop: VirtualTimeLoop) -> None:
    router, changes = make_router(loop)
    for name in ("c", "d"):
        router.track("db", name)
        router.report("db", name, up=True, caught_up=True)
    # c: its third drop 10.001 s after the first finds two in the window; d: exactly 10 s after, three.
    for name, drops in (("c", (1.0, 3.0, 11.001)), ("d", (21.0, 23.0, 31.0))):
        for drop in drops:
            loop.advance_to(drop)
            router.report("db", name, up=False)
            loop.advance_to(drop + 0.5)
            router.report("db", name, up=True, caught_up=True)
    assert changes == [(31.0, "db")]
    assert router.failed_over() == {"db": ["d"]}


def test_a_drop_while_waiting_to_move_back_restarts_the_wait(loop: VirtualTimeLoop) -> None:
    router, changes = make_router(loop)
    router.track("db", "c")
    loop.advance_to(10.0)
    assert changes == [(10.0, "db")]  # never connected
    loop.advance_to(12.0)
    router.report("db", "c", up=True, caught_up=True)
    assert [timer.when() for timer in loop.pending_timers()] == [22.0]
    loop.advance_to(20.0)
    router.report("db", "c", up=False)
    assert loop.pending_timers() == []  # down and failed over: nothing to wait for
    loop.advance_to(20.5)
    router.report("db", "c", up=True, caught_up=False)
    assert loop.pending_timers() == []
    loop.advance_to(21.0)
    router.report("db", "c", up=True, caught_up=True)
    assert [timer.when() for timer in loop.pending_timers()] == [31.0]
    loop.advance_to(25.0)
    router.report("db", "c", up=True, caught_up=False)  # behind again, still up: the wait goes on
    loop.advance_to(30.999)
    assert changes == [(10.0, "db")] and router.mode("db", "c") is Mode.FAILED_OVER
    loop.advance_to(31.0)
    assert changes == [(10.0, "db"), (31.0, "db")]
    assert router.mode("db", "c") is Mode.DIRECT


def test_a_flap_shorter_than_failover_after_changes_nothing(loop: VirtualTimeLoop) -> None:
    router, changes = make_router(loop)
    router.track("db", "c")
    router.report("db", "c", up=True, caught_up=True)
    for start in range(0, 100, 10):
        loop.advance_to(start + 1.0)
        router.report("db", "c", up=False)
        loop.advance_to(start + 9.0)
        router.report("db", "c", up=True, caught_up=True)
    loop.advance(100.0)
    assert changes == []


def test_a_link_that_never_connects_fails_over_from_when_it_was_tracked(loop: VirtualTimeLoop) -> None:
    router, changes = make_router(loop)
    loop.advance_to(3.0)
    router.track("db", "c")
    router.track("db", "c")  # tracking again changes nothing, the timer included
    loop.advance_to(20.0)
    assert changes == [(13.0, "db")]


def test_forget_and_close_cancel_every_timer(loop: VirtualTimeLoop) -> None:
    router, changes = make_router(loop)
    router.track("db", "b")
    router.track("db", "c")
    router.track("db2", "c")
    router.forget("db", "c")
    assert changes == [(0.0, "db")]
    assert router.exclude("db", "x") == ["b"]
    router.close()
    assert loop.pending_timers() == []
    loop.advance(60.0)
    assert changes == [(0.0, "db")]
    assert router.mode("db", "b") is None and router.mode("db2", "c") is None


def test_forget_and_close_leave_no_timer_in_either_waiting_state(loop: VirtualTimeLoop) -> None:
    router, changes = make_router(loop)
    for name in ("b", "c", "d"):
        router.track("db", name)
    loop.advance_to(10.0)  # none connected: all three fail over
    assert changes == [(10.0, "db")] * 3
    for name in ("c", "d"):
        router.report("db", name, up=True, caught_up=True)  # c and d wait to move back, b stays down
    router.report("db", "b", up=True)
    loop.advance_to(11.0)
    router.report("db", "b", up=False)
    router.track("db2", "b")  # DIRECT and down: waits to fail over
    assert sorted(timer.when() for timer in loop.pending_timers()) == [20.0, 20.0, 21.0]
    router.forget("db", "c")
    assert sorted(timer.when() for timer in loop.pending_timers()) == [20.0, 21.0]
    router.forget("db", "b")  # a failed-over link that is down owns no timer
    assert sorted(timer.when() for timer in loop.pending_timers()) == [20.0, 21.0]
    router.close()
    assert loop.pending_timers() == []
    loop.advance(60.0)
    assert changes == [(10.0, "db")] * 3 + [(11.0, "db")] * 2


# -- through the node: route changes become subscriptions, on the stagger ---------------------------------------------


def _progress(view_url: str, database: str, worker: int, session: int, caught_up: bool) -> messages.Progress:
    return messages.Progress(
        key=connection_key(view_url),
        database=database,
        worker=worker,
        session=session,
        last_received_seq=1,
        peer_head_seq=1,
        lag_seconds=0.0,
        applied=0,
        caught_up=caught_up,
    )


def test_the_node_resubscribes_the_other_pairs_when_an_origin_fails_over_and_back(loop: VirtualTimeLoop) -> None:
    node, supervisor = make_node(loop)
    views = {name: peer(name, port) for name, port in (("b", 2000), ("c", 3000), ("d", 4000))}
    for view in views.values():
        add(node, view)
    loop.advance(2.0)
    for view in views.values():
        entry = node.map.by_peer(view.name)
        assert entry is not None
        for database in ("system", "db"):
            slot = entry.pairs[database].placed
            connect(node, view, database, worker=slot, session=1)
            node.on_worker_message(slot, _progress(view.url, database, slot, 1, True))
    supervisor.sent.clear()
    c_entry = node.map.by_peer("c")
    assert c_entry is not None
    c_worker = c_entry.pairs["db"].placed
    node.on_worker_message(
        c_worker,
        messages.Disconnected(key=c_entry.key, database="db", worker=c_worker, session=1, reconnect_in=1.0),
    )
    loop.advance(FAILOVER + 2.0)
    subs = [(t, m) for t, _, m in supervisor.of(messages.Subscribe)]
    # b and d now carry c's writes; c's own pair keeps excluding b and d; the two dispatches keep the stagger.
    assert sorted((m.peer, tuple(m.exclude)) for _, m in subs) == [("b", ("d",)), ("d", ("b",))]
    times = sorted(t for t, _ in subs)
    assert all(later - earlier >= 0.05 - 1e-9 for earlier, later in itertools.pairwise(times))
    assert node.router.failed_over() == {"db": ["c"]}

    supervisor.sent.clear()
    connect(node, views["c"], "db", worker=c_worker, session=2)
    node.on_worker_message(c_worker, _progress(views["c"].url, "db", c_worker, 2, False))
    loop.advance(5.0)
    assert supervisor.of(messages.Subscribe) == []  # up but not caught up: the route stays
    caught_up_at = loop.time()
    node.on_worker_message(c_worker, _progress(views["c"].url, "db", c_worker, 2, True))
    loop.advance_to(caught_up_at + FAILOVER - 0.001)
    assert supervisor.of(messages.Subscribe) == []  # caught up, not yet stable for failover_after
    loop.advance(5.0)
    back = sorted((m.peer, tuple(m.exclude)) for _, _, m in supervisor.of(messages.Subscribe))
    assert back == [("b", ("c", "d")), ("d", ("b", "c"))]
    assert node.router.failed_over() == {}


def test_links_tracked_a_moment_apart_fail_over_together(loop: VirtualTimeLoop) -> None:
    """A registry pass adds its links over the pass's own duration: their failovers come at the first one's time,
    in one turn of the loop, so the node renews every pair of the database once (issue 21), not once per link."""
    from replicator.coordinator.routing import SIMULTANEOUS

    router, changes = make_router(loop)
    ghosts = [f"g{i:03d}" for i in range(100)]
    for index, name in enumerate(ghosts):
        loop.advance_to(index * SIMULTANEOUS / 200)  # 100 links over a quarter of SIMULTANEOUS
        router.track("db", name)
    loop.advance_to(1.0)
    router.track("db", "late")
    loop.advance_to(FAILOVER + 0.999)
    assert {when for when, _ in changes} == {FAILOVER}
    assert len(changes) == len(ghosts) and router.failed_over() == {"db": ghosts}
    loop.advance_to(FAILOVER + 1.0)
    assert changes[-1] == (FAILOVER + 1.0, "db")  # a link due later than that switches on its own time
    assert router.mode("db", "late") is Mode.FAILED_OVER
    assert loop.pending_timers() == []
