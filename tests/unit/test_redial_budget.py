"""The peer's redial budget in the worker's reconnect loop (`PeerSession._run`, `WorkerContext.redial_budget`), in
virtual time: the real sessions, loop and budget, with only the dial and the stream faked.

Every rng draws 0, so every backoff delay is the 0.5 s floor: a pair whose redial finds the budget spent asks again
0.5 s later.
"""

from __future__ import annotations

import asyncio
import io
import json
import random
import ssl
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from replicator.shared import messages
from replicator.shared.config import Config, ConfigError, from_mapping
from replicator.shared.logs import EventLog
from replicator.shared.store import Store
from replicator.workers import session as session_module
from replicator.workers.context import WorkerContext
from replicator.workers.counters import Counters
from replicator.workers.session import PeerSession, State
from tests.unit.fakeloop import VirtualTimeLoop

PEER = "p"
URL = "wss://p.internal:9925"


class FakeWebSocket:
    closed = True  # frames.close has nothing to do


class Peer:
    """The peer the sessions dial: while down every dial is refused at once; while up every subscription is accepted
    and the session lasts until the peer goes down."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        self.loop = loop
        self.up = False
        self.dials: list[tuple[float, str, bool]] = []  # (time, database, connected)
        self._gone = asyncio.Event()

    def redials(self) -> list[tuple[float, str, bool]]:
        return [dial for dial in self.dials if dial[0] > 0.0]

    def go_down(self) -> None:
        self.up = False
        self._gone.set()

    def come_up(self) -> None:
        self.up = True
        self._gone = asyncio.Event()

    def attach(self, session: PeerSession) -> None:
        async def dial() -> Any:
            self.dials.append((self.loop.time(), session.database, self.up))
            if not self.up:
                raise ConnectionRefusedError(111, "Connection refused")
            return FakeWebSocket()

        async def stream(ws: Any, session_id: int) -> None:
            gone = self._gone
            session._streaming()  # what the real _stream does once the peer accepted the subscription
            await gone.wait()
            raise ConnectionResetError(104, "Connection reset by peer")

        session._dial = dial  # type: ignore[method-assign]
        session._stream = stream  # type: ignore[method-assign]


class Node:
    def __init__(self, loop: VirtualTimeLoop, tmp_path: Path, **replication: Any) -> None:
        self.loop = loop
        self.reports: list[tuple[float, Any]] = []
        tmp_path.mkdir()
        self.ctx = WorkerContext(
            worker_id=0,
            config=config(**replication),
            store=Store(tmp_path / "data", "w"),
            counters=Counters(),
            client_ssl=ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT),
            report=lambda message: self.reports.append((loop.time(), message)),
        )
        self.peer = Peer(loop)
        self.sessions: list[PeerSession] = []
        self._ids = iter(range(1, 1_000_000))

    def start(self, pairs: int, rng: Callable[[], float] = lambda: 0.0) -> list[PeerSession]:
        async def make() -> list[PeerSession]:
            made = []
            for index in range(pairs):
                sub = messages.Subscribe(key="k", peer=PEER, url=URL, database=f"db{index}")
                session = PeerSession(self.ctx, None, sub, lambda: next(self._ids), rng=rng)  # type: ignore[arg-type]
                self.peer.attach(session)
                session.start()
                made.append(session)
            return made

        started = self.loop.run(make())
        self.sessions += started
        return started

    def budget(self) -> Any:
        return self.ctx._redial_budgets.get(PEER)

    def deferred(self) -> float:
        counts = {tuple(d.labels): d.value for d in self.ctx.counters.drain() if d.name.endswith("deferred_total")}
        return counts.get((PEER,), 0.0)

    def disconnected(self, database: str) -> list[tuple[float, messages.Disconnected]]:
        return [(t, m) for t, m in self.reports if isinstance(m, messages.Disconnected) and m.database == database]

    def close(self) -> None:
        async def stop() -> None:
            for session in self.sessions:
                session.stop()
            await asyncio.gather(*(session.wait_closed() for session in self.sessions))
            await self.ctx.feeds.close()

        self.loop.run(stop())
        self.ctx.store.close()


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch, loop: VirtualTimeLoop) -> io.StringIO:
    stream = io.StringIO()
    monkeypatch.setattr(session_module, "log", EventLog(stream, clock=loop.time))
    return stream


def lines(stream: io.StringIO, event: str) -> list[dict[str, Any]]:
    return [record for line in stream.getvalue().splitlines() if (record := json.loads(line))["event"] == event]


@pytest.fixture
def make_node(loop: VirtualTimeLoop, tmp_path: Path) -> Iterator[Callable[..., Node]]:
    made: list[Node] = []

    def make(**replication: Any) -> Node:
        made.append(Node(loop, tmp_path / str(len(made)), **replication))
        return made[-1]

    yield make
    for node in made:
        node.close()


def test_many_pairs_to_a_down_peer_spend_at_most_burst_plus_rate_t_failed_dials(
    make_node: Callable[..., Node], loop: VirtualTimeLoop, captured: io.StringIO
) -> None:
    node = make_node(redial_rate=2.0, redial_burst=5)
    node.start(20)
    loop.advance_to(30.0)
    first = [dial for dial in node.peer.dials if dial[0] == 0.0]
    assert len(first) == 20  # the first dials take no token
    redials = node.peer.redials()
    # The budget is made at the first redial, 0.5 s in (the floor): its 5 tokens go at once, then one every 0.5 s.
    times = [t for t, _, _ in redials]
    assert times[:5] == [0.5] * 5
    assert times[5:8] == [1.0, 1.5, 2.0]
    for count, when in enumerate(times, start=1):
        assert count <= 5 + 2.0 * (when - 0.5) + 1e-9, (count, when)
    assert len(redials) == 5 + 59  # every token by t = 30 (2 per second from 0.5), and no dial more
    # The others skipped their dial: each of the 60 rounds, every pair but the one that took the token.
    budget = node.budget()
    assert budget.granted == 64 and budget.deferred == 15 + 59 * 19
    assert node.deferred() == budget.deferred
    # A pair that skipped told the coordinator when it asks again: every redial is where its last report said.
    for when, database, _ in redials:
        said, report = [(t, m) for t, m in node.disconnected(database) if t < when][-1]
        assert report.reconnect_in is not None and said + report.reconnect_in == pytest.approx(when, abs=1e-9)
    # The warning is sampled per peer: 5 lines per 10 s window, the rest counted.
    deferred = lines(captured, "redial_deferred")
    assert all(set(record) >= {"peer", "database", "wait_s"} for record in deferred)
    assert {record["wait_s"] for record in deferred} == {0.5}
    assert len(deferred) == 5 * 3  # windows from 0.5, 10.5 and 20.5


def test_once_the_peer_is_back_its_accepted_dials_let_every_pair_through(
    make_node: Callable[..., Node], loop: VirtualTimeLoop
) -> None:
    """The budget is spent while the peer is down (1,000 pairs against 2 tokens a second); once it is back, each
    dial that connects hands its token back, so every pair gets through on its own schedule, within about one
    backoff cap (30 s), not pairs / rate = 500 s later. Here the schedules draw real jitter."""
    node = make_node(redial_rate=2.0, redial_burst=5)
    node.start(1000, rng=random.Random(7).random)
    loop.advance_to(300.0)  # every schedule at its 30 s cap
    budget = node.budget()
    assert budget.granted <= 5 + 2.0 * 300 and budget.deferred > budget.granted  # spent: most redials skipped
    node.peer.come_up()
    loop.advance_to(300.0 + 31.0)
    assert all(session.state is State.STREAMING for session in node.sessions)
    back = [dial for dial in node.peer.redials() if dial[0] >= 300.0]
    assert len(back) == 1000 and all(connected for _, _, connected in back)


def test_rate_zero_turns_the_budget_off(make_node: Callable[..., Node], loop: VirtualTimeLoop) -> None:
    node = make_node(redial_rate=0.0)
    node.start(20)
    loop.advance_to(30.0)
    assert len(node.peer.redials()) == 20 * 60  # every pair every 0.5 s
    assert node.budget() is None and node.deferred() == 0.0


def test_a_dial_that_connects_gives_its_token_back(make_node: Callable[..., Node], loop: VirtualTimeLoop) -> None:
    node = make_node(redial_rate=0.01, redial_burst=1)
    (session,) = node.start(1)
    loop.advance_to(0.25)
    node.peer.come_up()
    loop.advance_to(0.5)  # the redial takes the only token, and connects
    assert node.peer.redials() == [(0.5, "db0", True)] and session.state is State.STREAMING
    budget = node.budget()
    assert (budget.granted, budget.refunded, budget.tokens) == (1, 1, 1.0)
    node.peer.go_down()
    loop.advance_to(10.0)
    # The link dropped at 0.5: the redial at 1.0 finds the token it gave back; it fails, and from 1.5 on, every
    # 0.5 s, the pair finds no token and skips its dial until the next one is complete, 100 s after 1.0.
    assert node.peer.redials() == [(0.5, "db0", True), (1.0, "db0", False)]
    assert session.state is State.WAITING
    assert (budget.granted, budget.deferred) == (2, 18)
    (said, report) = node.disconnected("db0")[-1]
    assert (said, report.reconnect_in) == (10.0, 0.5)
    loop.advance_to(101.0)
    assert node.peer.redials()[-1] == (101.0, "db0", False)


def test_a_forced_reconnect_takes_no_token(make_node: Callable[..., Node], loop: VirtualTimeLoop) -> None:
    node = make_node(redial_rate=0.01, redial_burst=1)
    (session,) = node.start(1)
    loop.advance_to(2.0)  # the redial at 0.5 took the token; those after skip until 100.5
    budget = node.budget()
    assert node.peer.redials() == [(0.5, "db0", False)]
    assert (budget.granted, budget.deferred) == (1, 3)
    assert session.force_reconnect(None, "operator")
    loop.advance_to(2.0)
    assert node.peer.redials()[-1] == (2.0, "db0", False)  # at once, not at 100.5
    assert budget.granted == 1 and budget.tokens == pytest.approx(0.015)
    # It failed: the redials after the floor skip again until the token is complete at 100.5.
    loop.advance_to(100.75)
    assert [t for t, _, _ in node.peer.redials()] == [0.5, 2.0, 100.5]
    assert budget.granted == 2
    # That dial failed too and the session is in its backoff delay (until 101.0): forced, it dials without a token.
    assert session.state is State.WAITING
    session.force_reconnect(None, "operator")
    loop.advance_to(100.75)
    assert [t for t, _, _ in node.peer.redials()] == [0.5, 2.0, 100.5, 100.75]
    assert budget.granted == 2


def test_closing_a_pair_that_waits_for_the_budget_spends_nothing(
    make_node: Callable[..., Node], loop: VirtualTimeLoop
) -> None:
    node = make_node(redial_rate=0.01, redial_burst=1)
    (session,) = node.start(1)
    loop.advance_to(2.0)
    budget = node.budget()
    granted = budget.granted
    session.stop()
    loop.run(session.wait_closed())
    assert session.state is State.CLOSED and budget.granted == granted
    assert node.peer.redials() == [(0.5, "db0", False)]


def test_the_defaults_let_a_restart_cost_no_wait(make_node: Callable[..., Node], loop: VirtualTimeLoop) -> None:
    node = make_node()
    node.peer.come_up()
    node.start(40)
    loop.advance_to(1.0)
    node.peer.go_down()
    loop.advance_to(1.25)
    node.peer.come_up()
    loop.advance_to(10.0)
    # A peer restarted within the first delay: its 40 pairs (fewer than the burst of 50) all redial at 1.5 and
    # connect, and the tokens they took are all back.
    assert all(session.state is State.STREAMING for session in node.sessions)
    assert [t for t, _, _ in node.peer.redials()] == [1.5] * 40
    budget = node.budget()
    assert (budget.granted, budget.deferred, budget.refunded, budget.tokens) == (40, 0, 40, 50.0)


def config(**replication: Any) -> Config:
    return from_mapping({"node": {"name": "w", "url": "wss://127.0.0.1:9925"}, "replication": replication}, "")


def test_a_reload_replaces_a_budget_whose_rate_or_burst_changed(
    make_node: Callable[..., Node], loop: VirtualTimeLoop
) -> None:
    ctx = make_node().ctx
    first = ctx.redial_budget(PEER, loop)
    assert first is not None and (first.rate, first.burst) == (5.0, 50.0)
    assert ctx.redial_budget(PEER, loop) is first
    assert ctx.redial_budget("q", loop) is not first  # one per peer
    ctx.config = config(redial_rate=5.0, window=16)  # what Reconfigure does
    assert ctx.redial_budget(PEER, loop) is first
    ctx.config = config(redial_rate=1.0)
    second = ctx.redial_budget(PEER, loop)
    assert second is not None and second is not first and (second.rate, second.burst) == (1.0, 50.0)
    ctx.config = config(redial_burst=3)
    third = ctx.redial_budget(PEER, loop)
    assert third is not None and (third.rate, third.burst, third.tokens) == (5.0, 3.0, 3.0)
    ctx.config = config(redial_rate=0)
    assert ctx.redial_budget(PEER, loop) is None


@pytest.mark.parametrize("rate", [0.005, 1e-9])
def test_a_rate_too_slow_to_ever_redial_is_refused(rate: float) -> None:
    with pytest.raises(ConfigError, match=r"key 'replication.redial_rate': must be 0 \(no budget\) or at least 0.01"):
        config(redial_rate=rate)


class Links:
    """The worker's link pool as the sessions see it: whether a live link to the peer would carry the next attempt."""

    def __init__(self) -> None:
        self.up = False

    def live(self, url: str) -> bool:
        assert url == URL + "/replication"
        return self.up


def _linked(node: Node, pairs: int) -> tuple[list[PeerSession], Links]:
    links = Links()
    sessions = node.start(pairs, rng=random.Random(7).random)
    for session in sessions:
        session._links = links  # type: ignore[assignment]
    return sessions, links


def test_when_a_link_to_the_peer_comes_up_every_waiting_pair_tries_at_once_without_a_token(
    make_node: Callable[..., Node], loop: VirtualTimeLoop
) -> None:
    """The worker tells each pair of the peer when its link comes up (`peer_back`): over the live link a new session
    is a stream, so the pairs waiting out delays of up to the 30 s cap, their budget spent, all try now."""
    node = make_node(redial_rate=0.01, redial_burst=1)
    sessions, links = _linked(node, 200)
    loop.advance_to(300.0)
    budget = node.budget()
    granted = budget.granted
    node.peer.come_up()
    links.up = True
    for session in sessions:
        session.peer_back()
    loop.advance(0.001)
    assert all(session.state is State.STREAMING for session in sessions)
    back = [dial for dial in node.peer.redials() if dial[0] >= 300.0]
    assert sorted(database for _, database, _ in back) == sorted(s.database for s in sessions)
    assert all(when == 300.0 and connected for when, _, connected in back)
    assert budget.granted == granted  # no token taken: none was a dial


def test_a_redial_due_while_the_link_is_up_takes_no_token(
    make_node: Callable[..., Node], loop: VirtualTimeLoop
) -> None:
    node = make_node(redial_rate=0.01, redial_burst=1)
    sessions, links = _linked(node, 50)
    loop.advance_to(300.0)
    budget = node.budget()
    granted, deferred = budget.granted, budget.deferred
    node.peer.come_up()
    links.up = True  # up, but no pair was told: each goes at its own time, within one cap
    loop.advance_to(331.0)
    assert all(session.state is State.STREAMING for session in sessions)
    assert (budget.granted, budget.deferred) == (granted, deferred)


def test_peer_back_leaves_a_streaming_pair_alone(make_node: Callable[..., Node], loop: VirtualTimeLoop) -> None:
    node = make_node()
    node.peer.come_up()
    (session,), links = _linked(node, 1)
    links.up = True
    loop.advance(1.0)
    assert session.state is State.STREAMING
    session.peer_back()
    loop.advance(1.0)
    assert session.state is State.STREAMING and len(node.peer.dials) == 1
