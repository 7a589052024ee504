"""The sending end at rest (issue 12, a thousand pairs on a node): an idle session reads nothing and wakes for
nothing until a commit; a commit made while it told the subscriber it had caught up is served at once; the holds a
subscriber acknowledges are reported on a timer of the session's own, at most once per HOLDS_INTERVAL."""

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
from replicator.shared.store import Store
from replicator.workers.changes import ChangeFeeds
from replicator.workers.counters import Counters
from replicator.workers.sender import HOLDS_INTERVAL, OriginPlan, Sender
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
    ctx = SimpleNamespace(config=config, counters=Counters(), feeds=feeds, report=reports.append, node="n")
    ws = Socket()
    return Sender(ctx, ws, "p"), ws, feeds  # type: ignore[arg-type]


def _value(n: int) -> bytes:
    return msgspec.msgpack.encode(n)


def test_an_idle_session_reads_nothing_until_a_commit(store: Store, loop: VirtualTimeLoop, reads: list[float]) -> None:
    db = store.database("db", create=True)
    db.put("t", "a", _value(1))
    sender, ws, feeds = _sender(store, loop, [])
    serving = loop.create_task(sender._serve(db, {}, frozenset(), {"p": 0}))
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
    serving = loop.create_task(sender._serve(db, {}, frozenset(), {"p": 0}))
    loop.advance(0.0)
    first = ws.sent[0]
    assert isinstance(first, wire.Batch) and first.caught_up and not first.entries
    assert ws.ids() == ["late"] and loop.time() == 0.0
    serving.cancel()
    loop.run(asyncio.gather(serving, return_exceptions=True))
    loop.run(feeds.close())


def test_acknowledged_holds_are_reported_once_per_interval_by_the_sessions_own_timer(
    store: Store, loop: VirtualTimeLoop
) -> None:
    reports: list[Any] = []
    sender, _, feeds = _sender(store, loop, reports)
    sender._database = "db"

    def acknowledge(batch: int, mark: int) -> None:
        sender._unacked.append((batch, {"q": mark}))
        sender._confirm(batch)

    loop.call_at(0.0, sender._report_holds, True)  # what the session reports as it starts
    loop.call_at(1.0, acknowledge, 1, 9)
    loop.call_at(2.0, acknowledge, 2, 11)
    loop.advance_to(HOLDS_INTERVAL - 0.001)
    holds = [r for r in reports if isinstance(r, messages.PeerHolds)]
    assert [h.complete for h in holds] == [{}]
    loop.advance_to(HOLDS_INTERVAL)
    holds = [r for r in reports if isinstance(r, messages.PeerHolds)]
    assert [h.complete for h in holds] == [{}, {"q": 11}]
    loop.advance_to(600.0)
    assert len([r for r in reports if isinstance(r, messages.PeerHolds)]) == 2  # at rest: nothing more
    loop.run(feeds.close())
