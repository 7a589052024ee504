"""The sending end at rest (issue 12, a thousand pairs on a node): an idle session reads nothing and wakes for
nothing until a commit; a commit made while it told the subscriber it had caught up is served at once; the holds a
subscriber acknowledges are reported on timers of the session's own (PROMPT_INTERVAL, the state HOLDS_INTERVAL); the
subscriber's own holds report wakes on commits, not on a timer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from replicator.shared import messages, wire
from replicator.shared.config import from_mapping
from replicator.shared.store import Database, Store
from replicator.workers.changes import ChangeFeeds
from replicator.workers.confirm import Relays
from replicator.workers.counters import Counters
from replicator.workers.sender import HOLDS_INTERVAL, MAX_RELAYED_NODES, PROMPT_INTERVAL, OriginPlan, Sender
from replicator.workers.session import HOLDS_RECHECK, PeerSession
from tests.unit.fakeloop import VirtualTimeLoop


class Socket:
    """The sender's WebSocket: every frame it sends, decoded. `during_send` runs once, inside the next send."""

    def __init__(self) -> None:
        self.sent: list[wire.Message] = []
        self.during_send: Callable[[], object] | None = None

    async def send_bytes(self, data: bytes) -> None:
        self.sent.append(wire.decode(data))
        during, self.during_send = self.during_send, None
        if during is not None:
            during()
        await asyncio.sleep(0)

    def ids(self) -> list[str]:
        return [entry.id for batch in self.sent if isinstance(batch, wire.Batch) for entry in batch.entries]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(tmp_path, "n") as opened:
        yield opened


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """When the sender read the file for its next batch."""
    found: list[float] = []
    real = OriginPlan.next_batch

    def counted(plan: OriginPlan, db: Any, limit: int) -> Any:
        found.append(asyncio.get_running_loop().time())
        return real(plan, db, limit)

    monkeypatch.setattr(OriginPlan, "next_batch", counted)
    return found


def _sender(store: Store, loop: VirtualTimeLoop, reports: list[Any]) -> tuple[Sender, Socket, ChangeFeeds]:
    feeds = ChangeFeeds(lambda name: store.database(name), safety_interval=None)
    store.on_commit = feeds.committed
    feeds.start(loop)
    config = from_mapping({"node": {"name": "n", "url": "wss://127.0.0.1:1"}}, "")
    ctx = SimpleNamespace(config=config, counters=Counters(), feeds=feeds, report=reports.append, node="n", worker_id=0)
    ws = Socket()
    return Sender(ctx, ws, "p"), ws, feeds  # type: ignore[arg-type]


def _value(n: int) -> bytes:
    return msgspec.msgpack.encode(n)


def test_an_idle_session_reads_nothing_until_a_commit(store: Store, loop: VirtualTimeLoop, reads: list[float]) -> None:
    db = store.database("db", create=True)
    db.put("t", "a", _value(1))
    sender, ws, feeds = _sender(store, loop, [])
    serving = loop.create_task(sender._serve(db, OriginPlan({}, frozenset(), {"p": 0})))
    loop.advance(0.0)
    assert ws.ids() == ["a"] and reads == [0.0, 0.0]  # the record, then nothing more: caught up
    loop.advance_to(600.0)
    assert reads == [0.0, 0.0]  # ten minutes at rest: not one read, not one wake-up
    db.put("t", "b", _value(2))
    loop.advance(0.0)
    assert ws.ids() == ["a", "b"] and reads == [0.0, 0.0, 600.0, 600.0]
    serving.cancel()
    loop.run(asyncio.gather(serving, return_exceptions=True))
    loop.run(feeds.close())


def test_a_commit_made_while_telling_the_subscriber_it_caught_up_is_served_at_once(
    store: Store, loop: VirtualTimeLoop, reads: list[float]
) -> None:
    db = store.database("db", create=True)
    sender, ws, feeds = _sender(store, loop, [])
    # The commit lands during the send of the empty caught-up batch: its wake-up came before the sender waited.
    ws.during_send = lambda: db.put("t", "late", _value(1))
    serving = loop.create_task(sender._serve(db, OriginPlan({}, frozenset(), {"p": 0})))
    loop.advance(0.0)
    first = ws.sent[0]
    assert isinstance(first, wire.Batch) and first.caught_up and not first.entries
    assert ws.ids() == ["late"] and loop.time() == 0.0
    serving.cancel()
    loop.run(asyncio.gather(serving, return_exceptions=True))
    loop.run(feeds.close())


def test_acknowledged_holds_are_reported_promptly_and_the_state_once_per_interval_by_the_sessions_own_timers(
    store: Store, loop: VirtualTimeLoop
) -> None:
    """What the subscriber holds goes to the coordinator at most every PROMPT_INTERVAL (a write waiting for its
    confirmations hears of them that soon), the pair's state for /status at most every HOLDS_INTERVAL; each on a
    timer of the session's own, so the last acknowledgement is reported and nothing runs at rest."""
    reports: list[Any] = []
    sender, _, feeds = _sender(store, loop, reports)
    sender._database = "db"

    def acknowledge(batch: int, mark: int) -> None:
        sender._unacked.append((batch, {"q": mark}))
        sender._confirm(batch)

    def seen() -> tuple[list[tuple[float, dict[str, int]]], list[float]]:
        holds = [(at, r.complete) for at, r in reports if isinstance(r, messages.PeerHolds)]
        return holds, [at for at, r in reports if isinstance(r, messages.Sending)]

    sender._ctx.report = lambda message: reports.append((loop.time(), message))
    loop.call_at(0.0, sender._report_holds, True)  # what the session reports as it starts
    loop.call_at(1.0, acknowledge, 1, 9)
    loop.call_at(1.01, acknowledge, 2, 11)
    loop.advance_to(HOLDS_INTERVAL - 0.001)
    holds, states = seen()
    assert holds == [(0.0, {}), (1.0, {"q": 9}), (pytest.approx(1.0 + PROMPT_INTERVAL), {"q": 11})]
    assert states == [0.0]
    loop.advance_to(HOLDS_INTERVAL)
    assert seen()[1] == [0.0, HOLDS_INTERVAL]  # the state of the last acknowledged batch, once the interval is over
    loop.advance_to(600.0)
    assert [len(kind) for kind in seen()] == [3, 2]  # at rest: nothing more
    loop.run(feeds.close())


def test_the_subscribers_holds_wake_on_commits_and_read_nothing_at_rest(
    store: Store, loop: VirtualTimeLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The receiving end's holds report: sent when a commit moved what the node holds, at most once per
    HOLDS_INTERVAL, with no read of the file while nothing is committed but one check per HOLDS_RECHECK, which
    finds a commit whose notification was lost."""
    versions: list[float] = []
    real = Database.data_version

    def counted(db: Database) -> int:
        versions.append(loop.time())
        return real(db)

    monkeypatch.setattr(Database, "data_version", counted)
    db = store.database("db", create=True)
    feeds = ChangeFeeds(lambda name: store.database(name), safety_interval=1.0)
    store.on_commit = feeds.committed
    feeds.start(loop)
    session = object.__new__(PeerSession)
    session._ctx = SimpleNamespace(feeds=feeds, relays=Relays())  # type: ignore[assignment]
    session._loop = loop  # type: ignore[assignment]
    session.sub = SimpleNamespace(peer="p")  # type: ignore[assignment]
    session._peer_heads, session.ahead = {}, {}  # no Heads from this peer
    ws = Socket()
    holds = loop.create_task(session._send_holds(ws, db, {}, asyncio.Lock(), 0))
    db.apply_batch([], {"q": 1})  # what a session applies from a peer moves the holds
    loop.advance_to(HOLDS_INTERVAL)
    assert [m.progress for m in ws.sent if isinstance(m, wire.Holds)] == [{"q": 1}]
    versions.clear()
    loop.advance_to(100.0)
    # At rest: one look, then asleep on the feed (which the safety poll does not read for it), one look a recheck.
    assert versions == [2 * HOLDS_INTERVAL, 2 * HOLDS_INTERVAL + HOLDS_RECHECK]
    db.apply_batch([], {"q": 2})
    loop.advance(0.0)
    assert [m.progress for m in ws.sent if isinstance(m, wire.Holds)] == [{"q": 1}, {"q": 2}]  # woken at once
    db.apply_batch([], {"q": 3})
    loop.advance_to(100.0 + HOLDS_INTERVAL - 0.001)
    assert len([m for m in ws.sent if isinstance(m, wire.Holds)]) == 2  # at most one report per HOLDS_INTERVAL
    loop.advance_to(100.0 + HOLDS_INTERVAL)
    assert [m.progress for m in ws.sent if isinstance(m, wire.Holds)][-1] == {"q": 3}
    # A commit no notification announced (a tool writing the file): found at the next recheck, not before.
    loop.advance_to(200.0)
    store.on_commit = None
    db.apply_batch([], {"q": 4})
    asleep = 100.0 + 2 * HOLDS_INTERVAL + HOLDS_RECHECK  # its last look found nothing new
    loop.advance_to(asleep + HOLDS_RECHECK - 0.001)
    assert len([m for m in ws.sent if isinstance(m, wire.Holds)]) == 3
    loop.advance_to(asleep + HOLDS_RECHECK)
    assert [m.progress for m in ws.sent if isinstance(m, wire.Holds)][-1] == {"q": 4}
    holds.cancel()
    loop.run(asyncio.gather(holds, return_exceptions=True))
    loop.run(feeds.close())


def test_what_a_subscriber_relays_is_bounded_merged_and_reported_promptly(store: Store, loop: VirtualTimeLoop) -> None:
    """`wire.Holds.others`: what the subscriber's node says other nodes hold, for this node's confirmations. The
    highest of each is kept and reported; the subscriber's own entry and this node's are not taken from it; past
    the caps, or with a bad name, the session ends as a protocol violation before anything is kept."""
    reports: list[Any] = []
    sender, _, feeds = _sender(store, loop, reports)
    sender._database = "db"
    sender._peer = "p"

    def take(others: dict[str, dict[str, int]]) -> None:
        sender._take_holds({}, others)

    loop.call_at(0.0, take, {"c": {"n": 5}, "p": {"n": 99}, "n": {"n": 99}})
    loop.call_at(1.0, take, {"c": {"n": 3, "q": 1}})
    loop.advance_to(2.0)
    relayed = [r.others for r in reports if isinstance(r, messages.PeerHolds)]
    assert relayed == [{"c": {"n": 5}}, {"c": {"n": 5, "q": 1}}]
    for others, reason in (
        ({f"x{i}": {} for i in range(MAX_RELAYED_NODES + 1)}, "at most 256 nodes"),
        ({"bad name": {"n": 1}}, "bad Holds node"),
        ({"c": {"n": -1}}, "bad Holds entry"),
    ):
        with pytest.raises(wire.ProtocolViolation, match=reason):
            take(others)
    assert sender._others == {"c": {"n": 5, "q": 1}}
    loop.run(feeds.close())
