"""The coordinator's anti-entropy schedules in virtual time: when rounds go to which worker, what an answer (or its
absence) does, and the scrub of the node's own files.

The node runs on the virtual-time loop with the fake supervisor of test_coordinator (it records every message with
the virtual time it was sent at); the scrub runs on a real store in a temporary folder, its database calls inline.
"""

from __future__ import annotations

import io
import json
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from replicator.coordinator import antientropy as antientropy_module
from replicator.coordinator.admin import status_document
from replicator.coordinator.antientropy import AntiEntropy, Phase
from replicator.coordinator.node import Node
from replicator.coordinator.registry import NodeView
from replicator.shared import messages
from replicator.shared.keys import connection_key
from replicator.shared.logs import EventLog
from replicator.shared.store import Store
from tests.unit.fakeloop import VirtualTimeLoop
from tests.unit.test_coordinator import FakeSupervisor, add, make_node, peer
from tests.unit.test_coordinator import connect as connect_only

INTERVAL = 600.0  # the default replication.antientropy_interval
WALL = 1_700_000_000.0  # the wall clock at virtual time 0


async def inline(function: Callable[..., Any], *args: Any) -> Any:
    return function(*args)


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], list[dict[str, Any]]]]:
    """The anti-entropy module's log lines, by event name (a log of its own: no sampling left over from others)."""
    stream = io.StringIO()
    monkeypatch.setattr(antientropy_module, "log", EventLog(stream))

    def lines(event: str) -> list[dict[str, Any]]:
        found = [json.loads(line) for line in stream.getvalue().splitlines()]
        return [line for line in found if line["event"] == event]

    yield lines


def connect(node: Node, view: NodeView, database: str, worker: int, session: int, caught_up: bool = True) -> None:
    """The pair connects and (by default) its sender says it is caught up: scheduled rounds wait for both."""
    connect_only(node, view, database, worker, session)
    progress = messages.Progress(
        key=connection_key(view.url),
        database=database,
        worker=worker,
        session=session,
        last_received_seq=0,
        peer_head_seq=0,
        lag_seconds=0.0,
        applied=0,
        caught_up=caught_up,
    )
    node.on_worker_message(worker, progress)


def setup(loop: VirtualTimeLoop, draws: Callable[[], float] = lambda: 0.5) -> tuple[Node, FakeSupervisor]:
    """A node whose anti-entropy draws come from `draws` (the setup scheduler keeps its own 0.5)."""
    node, supervisor = make_node(loop)
    node.wall = lambda: WALL + loop.time()
    node.antientropy = AntiEntropy(node, loop=loop, rng=draws, to_thread=inline)
    return node, supervisor


def rounds(supervisor: FakeSupervisor, since: float = 0.0) -> list[tuple[float, int, str, int]]:
    """(time, worker, database, round) of every anti-entropy round sent at or after `since`."""
    return [
        (round(when, 9), slot, message.database, message.round)
        for when, slot, message in supervisor.of(messages.AntiEntropy)
        if when >= since
    ]


def done(node: Node, view: NodeView, database: str, number: int, slot: int = 0, **fields: Any) -> None:
    message = messages.AntiEntropyDone(
        key=connection_key(view.url), database=database, round=number, peer=view.name, **fields
    )
    node.on_worker_message(slot, message)


def sample(node: Node, name: str, **labels: str) -> float | None:
    node.metrics.render()  # creates the pair series at 0, as a scrape does
    return node.metrics.registry.get_sample_value(name, labels)


# -- the round schedule --------------------------------------------------------------------------------------------


def test_first_rounds_are_drawn_in_half_to_one_interval(loop: VirtualTimeLoop) -> None:
    draws = iter([0.0, 0.9999])
    node, supervisor = setup(loop, lambda: next(draws))
    b = peer("b", 2000)
    add(node, b)  # two pairs: system and db, one draw each
    for database in ("system", "db"):
        connect(node, b, database, worker=1, session=1)
    loop.advance(INTERVAL)
    sent = rounds(supervisor)
    # Equal jitter on a fixed ceiling: a draw of 0 is interval / 2, a draw near 1 stays below the interval.
    assert [when for when, *_ in sent] == [300.0, pytest.approx(599.97)]
    assert sorted(database for _, _, database, _ in sent) == ["db", "system"]
    assert all(slot == 1 for _, slot, _, _ in sent)  # the worker whose session carries the pair


def test_a_round_goes_only_to_a_connected_pair_and_its_answer_is_recorded(
    loop: VirtualTimeLoop, events: Callable[[str], list[dict[str, Any]]]
) -> None:
    node, supervisor = setup(loop)
    b = peer("b", 2000)
    add(node, b)
    connect(node, b, "db", worker=1, session=1)  # system stays down
    loop.advance_to(449.0)
    assert rounds(supervisor) == []
    loop.advance_to(450.0)
    assert rounds(supervisor) == [(450.0, 1, "db", 1)]
    key = connection_key(b.url)
    assert node.antientropy.phase(key, "db") is Phase.RUNNING
    loop.advance_to(455.0)
    done(
        node, b, "db", 1, slot=1, buckets_compared=33, divergent_buckets=2, repaired=3, bytes_exchanged=900, seconds=4.5
    )
    assert node.antientropy.phase(key, "db") is Phase.WAITING
    status = status_document(node)
    (pairs,) = [c["databases"] for c in status["connections"] if c["peer"] == "b"]
    by_database = {d["database"]: d["antientropy"] for d in pairs}
    assert by_database == {
        "db": {
            "at": WALL + 455.0,
            "seconds": 4.5,
            "buckets_compared": 33,
            "divergent_buckets": 2,
            "repaired": 3,
            "bytes": 900,
            "queries": 0,
            "error": None,
            "limit": None,
        },
        "system": None,
    }
    assert sample(node, "replicator_antientropy_rounds_total", peer="b", database="db") == 1
    assert sample(node, "replicator_antientropy_failures_total", peer="b", database="db") is None
    assert sample(node, "replicator_antientropy_records_repaired_total", peer="b", database="db") == 3
    assert sample(node, "replicator_antientropy_divergent_buckets", peer="b", database="db") == 2
    assert sample(node, "replicator_antientropy_rounds_total", peer="b", database="system") == 0
    assert sample(node, "replicator_antientropy_divergent_buckets", peer="b", database="system") is None
    (repaired,) = events("divergence_repaired")
    assert (repaired["level"], repaired["peer"], repaired["database"]) == ("warning", "b", "db")
    assert (repaired["records"], repaired["buckets"]) == (3, 2)
    # The next round is drawn from the answer (455 + 450); unanswered, it fails at its timeout (600 s) and the
    # one after is drawn from there. The disconnected pair only draws again.
    loop.advance_to(2000.0)
    assert rounds(supervisor, since=451.0) == [(905.0, 1, "db", 2), (1955.0, 1, "db", 3)]


def test_a_quiet_round_logs_nothing(loop: VirtualTimeLoop, events: Callable[[str], list[dict[str, Any]]]) -> None:
    node, _ = setup(loop)
    b = peer("b", 2000, holds=())
    add(node, b)
    connect(node, b, "system", worker=0, session=1)
    loop.advance_to(450.0)
    done(node, b, "system", 1, buckets_compared=1)
    assert events("divergence_repaired") == [] and events("antientropy_failed") == []
    assert sample(node, "replicator_antientropy_rounds_total", peer="b", database="system") == 1
    assert sample(node, "replicator_antientropy_divergent_buckets", peer="b", database="system") is None


def test_stale_and_late_answers_are_ignored_and_a_silent_round_fails_at_its_timeout(
    loop: VirtualTimeLoop, events: Callable[[str], list[dict[str, Any]]]
) -> None:
    node, supervisor = setup(loop)
    b = peer("b", 2000, holds=())
    add(node, b)
    connect(node, b, "system", worker=0, session=1)
    key = connection_key(b.url)
    loop.advance_to(450.0)
    assert rounds(supervisor) == [(450.0, 0, "system", 1)]
    done(node, b, "system", 7, repaired=5)  # not the round in flight
    assert node.antientropy.last_round(key, "system") is None
    assert node.antientropy.phase(key, "system") is Phase.RUNNING
    # No answer: the round fails after max(60 s, interval) and the schedule goes on from there.
    loop.advance_to(450.0 + INTERVAL)
    last = node.antientropy.last_round(key, "system")
    assert last is not None and last.at == WALL + 1050.0
    assert last.error == "no answer from worker 0 within 600 s"
    assert sample(node, "replicator_antientropy_failures_total", peer="b", database="system") == 1
    (failed,) = events("antientropy_failed")
    assert (failed["peer"], failed["database"], failed["error"]) == ("b", "system", last.error)
    loop.advance_to(1100.0)
    done(node, b, "system", 1, repaired=4)  # the timed-out round answers late: stale
    assert node.antientropy.last_round(key, "system") is last
    assert sample(node, "replicator_antientropy_records_repaired_total", peer="b", database="system") is None
    loop.advance_to(1500.0)
    assert rounds(supervisor, since=451.0) == [(1500.0, 0, "system", 2)]


def test_a_round_that_ends_with_an_error_counts_as_a_failure(
    loop: VirtualTimeLoop, events: Callable[[str], list[dict[str, Any]]]
) -> None:
    node, _ = setup(loop)
    b = peer("b", 2000, holds=())
    add(node, b)
    connect(node, b, "system", worker=0, session=1)
    loop.advance_to(450.0)
    done(node, b, "system", 1, repaired=2, error="peer unreachable")
    assert sample(node, "replicator_antientropy_failures_total", peer="b", database="system") == 1
    assert sample(node, "replicator_antientropy_rounds_total", peer="b", database="system") == 0
    # Records changed before the error count all the same; the gauge keeps the last completed round (none).
    assert sample(node, "replicator_antientropy_records_repaired_total", peer="b", database="system") == 2
    assert sample(node, "replicator_antientropy_divergent_buckets", peer="b", database="system") is None
    assert [e["error"] for e in events("antientropy_failed")] == ["peer unreachable"]


def test_a_round_that_failed_on_a_limit_is_counted_logged_and_backed_off(
    loop: VirtualTimeLoop, events: Callable[[str], list[dict[str, Any]]]
) -> None:
    node, supervisor = setup(loop)
    b = peer("b", 2000, holds=())
    add(node, b)
    connect(node, b, "system", worker=0, session=1)
    key = connection_key(b.url)
    loop.advance_to(450.0)
    ((_, _, sent),) = supervisor.of(messages.AntiEntropy)
    assert sent.timeout == 540.0  # the worker ends its round before the coordinator stops waiting (600 s)
    assert (
        sample(node, "replicator_antientropy_limits_exceeded_total", peer="b", database="system", limit="time") is None
    )
    cut = "the peer's digests leave 131088 tree nodes of one table pending; at most 131072"
    done(node, b, "system", 1, error=cut, limit="frontier", queries=4115)
    assert (
        sample(node, "replicator_antientropy_limits_exceeded_total", peer="b", database="system", limit="frontier") == 1
    )
    assert sample(node, "replicator_antientropy_failures_total", peer="b", database="system") == 1
    (failed,) = events("antientropy_failed")
    assert (failed["error"], failed["limit"], failed["queries"]) == (cut, "frontier", 4115)
    assert status_document(node)["connections"][0]["databases"][0]["antientropy"]["limit"] == "frontier"
    # A peer that asks for rounds (a purge it claims this node is behind) gets none while the pair backs off.
    assert not node.antientropy.run_soon(key, "system", reason="behind the peer's purge of b")
    assert events("antientropy_requested")[-1]["backing_off"] is True
    # The next rounds come after a doubling delay (equal jitter, draws of 0.5): 450, 900, 1,800 s.
    for number, when in ((2, 900.0), (3, 1800.0), (4, 3600.0)):
        loop.advance_to(when)
        assert rounds(supervisor)[-1] == (when, 0, "system", number)
        if number < 4:
            done(node, b, "system", number, error=cut, limit="frontier")
    done(node, b, "system", 4)  # a round that ends well puts the pair back on the interval
    loop.advance_to(4050.0)
    assert rounds(supervisor)[-1] == (4050.0, 0, "system", 5)
    done(node, b, "system", 5)
    assert node.antientropy.run_soon(key, "system", reason="behind the peer's purge of b")
    counted = sample(
        node, "replicator_antientropy_limits_exceeded_total", peer="b", database="system", limit="frontier"
    )
    assert counted == 3


def test_a_dropped_pair_takes_its_timer_along(loop: VirtualTimeLoop) -> None:
    node, supervisor = setup(loop)
    b = peer("b", 2000)
    add(node, b)
    for database in ("system", "db"):
        connect(node, b, database, worker=0, session=1)
    loop.advance_to(100.0)
    add(node, peer("b", 2000, holds=(), version=2))  # db no longer wanted
    key = connection_key(b.url)
    assert node.antientropy.phase(key, "db") is None
    loop.advance_to(1000.0)
    assert [database for _, _, database, _ in rounds(supervisor)] == ["system"]


def test_a_round_in_flight_when_its_pair_is_dropped_answers_stale(loop: VirtualTimeLoop) -> None:
    node, _ = setup(loop)
    b = peer("b", 2000)
    add(node, b)
    connect(node, b, "db", worker=0, session=1)
    loop.advance_to(450.0)
    add(node, peer("b", 2000, holds=(), version=2))
    add(node, peer("b", 2000, version=3))  # wanted again: a new schedule, nothing in flight
    done(node, b, "db", 1, repaired=9)
    assert node.antientropy.last_round(connection_key(b.url), "db") is None
    assert sample(node, "replicator_antientropy_records_repaired_total", peer="b", database="db") is None


def test_close_cancels_every_timer(loop: VirtualTimeLoop) -> None:
    node, supervisor = setup(loop)
    b = peer("b", 2000)
    add(node, b)
    for database in ("system", "db"):
        connect(node, b, database, worker=0, session=1)
    loop.advance_to(10.0)
    before = len(loop.pending_timers())
    loop.run(node.antientropy.close())
    assert len(loop.pending_timers()) == before - 2
    loop.advance_to(5000.0)
    assert rounds(supervisor) == []


def test_a_reload_with_a_new_interval_redraws_the_waiting_timers(loop: VirtualTimeLoop) -> None:
    node, supervisor = setup(loop)
    b = peer("b", 2000, holds=())
    add(node, b)
    connect(node, b, "system", worker=0, session=1)
    loop.advance_to(100.0)
    node.antientropy.reconfigure()  # same interval: nothing moves
    node.config.replication.antientropy_interval = 60.0
    node.antientropy.reconfigure()
    # Drawn again from the reload: 100 + 45 (the old draw, 450, is gone). Answered at 150, the next is at 195;
    # that one is left unanswered and times out after max(60 s, interval) = 60 s, at 255, and the next is at 300.
    loop.advance_to(150.0)
    assert rounds(supervisor) == [(145.0, 0, "system", 1)]
    done(node, b, "system", 1)
    loop.advance_to(300.0)
    assert rounds(supervisor) == [(145.0, 0, "system", 1), (195.0, 0, "system", 2), (300.0, 0, "system", 3)]


def test_a_worker_exit_fails_its_rounds_at_once(loop: VirtualTimeLoop) -> None:
    node, supervisor = setup(loop)
    b = peer("b", 2000, holds=())
    add(node, b)
    connect(node, b, "system", worker=1, session=1)
    loop.advance_to(450.0)
    supervisor.workers[1].alive = False
    node.on_worker_exit(supervisor.workers[1])  # type: ignore[arg-type]
    last = node.antientropy.last_round(connection_key(b.url), "system")
    assert last is not None and last.error == "worker 1 exited during the round"
    assert node.antientropy.phase(connection_key(b.url), "system") is Phase.WAITING


# -- run now ----------------------------------------------------------------------------------------------------


def test_run_now_asks_every_pair_of_the_database_and_waits_for_all(loop: VirtualTimeLoop) -> None:
    node, supervisor = setup(loop)
    b, c = peer("b", 2000), peer("c", 3000)
    node.holds = {"system", "db"}
    for view in (b, c):
        add(node, view)
        connect(node, view, "db", worker=0, session=1)
    loop.advance_to(10.0)
    task = loop.create_task(node.antientropy.run_now("db"))
    loop.advance_to(11.0)
    assert [(when, database) for when, _, database, _ in rounds(supervisor)] == [(10.0, "db"), (10.0, "db")]
    numbers = {message.key: message.round for _, _, message in supervisor.of(messages.AntiEntropy)}
    done(node, c, "db", numbers[connection_key(c.url)], repaired=2, divergent_buckets=1)
    assert not task.done()
    loop.advance_to(12.5)
    done(node, b, "db", numbers[connection_key(b.url)], seconds=1.5)
    loop.advance_to(13.0)
    reports = task.result()
    assert [(r.peer, r.database, r.repaired, r.error) for r in reports] == [("b", "db", 0, ""), ("c", "db", 2, "")]
    assert reports[1].summary() == {
        "peer": "c",
        "database": "db",
        "buckets_compared": 0,
        "divergent_buckets": 1,
        "repaired": 2,
        "bytes": 0,
        "queries": 0,
        "seconds": 0.0,
        "error": None,
        "limit": None,
    }
    # Each pair's schedule goes on from its answer.
    loop.advance_to(600.0)
    assert sorted(when for when, *_ in rounds(supervisor, since=14.0)) == [461.0, 462.5]


def test_run_now_joins_a_running_round_reports_the_disconnected_and_the_silent(loop: VirtualTimeLoop) -> None:
    node, supervisor = setup(loop)
    b, c = peer("b", 2000, holds=()), peer("c", 3000, holds=())
    node.holds = {"system"}
    for view in (b, c):
        add(node, view)
    connect(node, b, "system", worker=0, session=1)
    loop.advance_to(450.0)  # b's round is running
    assert rounds(supervisor) == [(450.0, 0, "system", 1)]
    task = loop.create_task(node.antientropy.run_now(None, timeout=5.0))
    loop.advance_to(456.0)
    assert rounds(supervisor) == [(450.0, 0, "system", 1)]  # joined, not asked twice
    reports = task.result()
    assert [(r.peer, r.error) for r in reports] == [
        ("b", "no answer within 5 s; the round goes on"),
        ("c", "the pair is not connected"),
    ]
    done(node, b, "system", 1, repaired=1)  # the round itself finishes on its schedule
    last = node.antientropy.last_round(connection_key(b.url), "system")
    assert last is not None and last.repaired == 1
    # The disconnected pair was only reported, never recorded or counted.
    assert node.antientropy.last_round(connection_key(c.url), "system") is None
    assert sample(node, "replicator_antientropy_failures_total", peer="c", database="system") is None


# -- scrub ------------------------------------------------------------------------------------------------------


def _damage(path: Path, statement: str, *args: Any) -> None:
    conn = sqlite3.connect(path)
    try:
        with conn:
            conn.execute(statement, args)
    finally:
        conn.close()


def test_the_scrub_counts_damage_once_and_fixes_digests(
    loop: VirtualTimeLoop, tmp_path: Path, events: Callable[[str], list[dict[str, Any]]]
) -> None:
    node, _ = setup(loop)
    node.store = Store(tmp_path, "self")
    try:
        orders = node.store.database("orders", create=True)
        orders.put_many("items", [(f"r{i:04}", b"value %d" % i) for i in range(1500)])
        node.system()
        node.holds = {"system", "orders"}
        _damage(orders.path, "UPDATE records SET value = X'00' WHERE id = 'r0007'")
        node.antientropy.start()
        loop.advance_to(0.99)
        assert node.antientropy.scrubs() == {}
        # 1 s after the node is ready: orders (two chunks of 1,000 rows, 1000 / 20000 = 0.05 s apart), then system.
        loop.advance_to(1.05)
        scrubs = node.antientropy.scrubs()
        assert scrubs["orders"].status() == {"at": WALL + 1.05, "rows": 1500, "damaged": 1, "digests_fixed": 0}
        assert scrubs["system"].at == WALL + 1.05 and scrubs["system"].damaged == 0
        assert sample(node, "replicator_checksum_failures_total", database="orders") == 1
        assert sample(node, "replicator_checksum_failures_total", database="system") is None
        # The next pass, a draw later, sees the row again (still damaged) but does not count it twice; a digest
        # edited behind the node's back is recounted.
        _damage(
            orders.path,
            "UPDATE digests SET xor = xor + 1 WHERE tbl = 'items'"
            " AND bucket = (SELECT min(bucket) FROM digests WHERE tbl = 'items' AND bucket >= 0)",
        )
        loop.advance_to(1.05 + 450.0 + 0.05)
        again = node.antientropy.scrubs()["orders"]
        assert (again.at, again.damaged, again.digests_fixed) == (WALL + 451.1, 1, 1)
        assert sample(node, "replicator_checksum_failures_total", database="orders") == 1
        assert orders.check_digests() == 0
        assert status_document(node)["scrub"]["orders"] == again.status()
        assert events("scrub_failed") == []
        loop.run(node.antientropy.close())
    finally:
        node.store.close()


def test_a_database_that_cannot_be_opened_is_logged_once_and_the_loop_goes_on(
    loop: VirtualTimeLoop, tmp_path: Path, events: Callable[[str], list[dict[str, Any]]]
) -> None:
    node, _ = setup(loop)
    node.store = Store(tmp_path, "self")
    try:
        node.system()
        node.holds = {"system", "ghost"}  # ghost has no file
        node.antientropy.start()
        loop.advance_to(1.0 + 2 * INTERVAL)
        (failed,) = events("scrub_failed")
        assert failed["database"] == "ghost" and "ghost" in failed["reason"]
        assert "ghost" not in node.antientropy.scrubs()
        system = node.antientropy.scrubs()["system"]
        assert system.at == WALL + 901.0  # 1, then 451, then 901: every pass ran
        loop.run(node.antientropy.close())
    finally:
        node.store.close()


def test_a_database_opened_at_run_time_is_scrubbed_on_the_schedule(loop: VirtualTimeLoop, tmp_path: Path) -> None:
    node, _ = setup(loop)
    node.store = Store(tmp_path, "self")
    try:
        node.system()
        node.holds = {"system"}
        node.antientropy.start()
        loop.advance_to(10.0)
        node.store.database("late", create=True).put("t", "a", b"1")
        node.on_worker_message(0, messages.DatabaseOpened(name="late"))
        loop.advance_to(459.9)
        assert "late" not in node.antientropy.scrubs()
        loop.advance_to(460.0)
        assert node.antientropy.scrubs()["late"].rows == 1
        loop.run(node.antientropy.close())
    finally:
        node.store.close()


def test_a_scheduled_round_waits_for_the_stream_to_catch_up(loop: VirtualTimeLoop) -> None:
    node, supervisor = setup(loop)
    b = peer("b", 2000)
    add(node, b)
    connect(node, b, "db", worker=1, session=1, caught_up=False)
    loop.advance_to(900.0)
    # Due at 450 s and at 900 s, while the stream was still delivering: each time the next draw, 450 s on.
    assert rounds(supervisor) == []
    connect(node, b, "db", worker=1, session=1, caught_up=True)
    loop.advance_to(1350.0)
    assert rounds(supervisor) == [(1350.0, 1, "db", 1)]
    done(node, b, "db", 1, slot=1)
    connect(node, b, "db", worker=1, session=1, caught_up=False)
    task = loop.create_task(node.antientropy.run_now("db", timeout=5.0))
    loop.advance(0.0)
    assert rounds(supervisor, since=1350.0)[-1] == (1350.0, 1, "db", 2)  # an operator's round does not wait
    done(node, b, "db", 2, slot=1)
    loop.advance(0.0)
    assert [report.error for report in task.result()] == [""]
