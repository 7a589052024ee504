"""When a pair's reconnect schedule starts over (`PeerSession._run`), in virtual time: the real session, its handshake,
reader and applier, and a real store, against a scripted sender; only the dial and the certificate check are faked.

Every rng draws 0.5, so a delay is exactly halfway between the 0.5 s floor and the ceiling, which doubles from
0.5 s: 0.5, 0.75, 1.25, 2.25, 4.25 ... A schedule that started over draws 0.5 s again.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp import WSMessage, WSMsgType

from replicator.shared import messages, wire
from replicator.shared.config import from_mapping
from replicator.shared.store import Store
from replicator.shared.tls import PeerIdentity
from replicator.workers import session as session_module
from replicator.workers.context import WorkerContext
from replicator.workers.counters import Counters
from replicator.workers.session import STAYED_UP, PeerSession
from tests.unit.fakeloop import VirtualTimeLoop

PEER = "p"
WALL = 1_700_000_000.0  # the wall clock of both ends at virtual time 0
MAX_SKEW = 60.0
HOUR_AHEAD = 3600.0
FIRST_DELAYS = [0.5, 0.75, 1.25, 2.25, 4.25, 8.25]  # draws of 0.5 on a fresh schedule


class ScriptedSender:
    """One session's sending end: `script(sender)` yields the frames the subscriber receives, in order, and may wait
    (`acked`, `asyncio.sleep`) between them; once it is done the sender closes the session normally."""

    def __init__(self, loop: VirtualTimeLoop, script: Callable[[ScriptedSender], AsyncIterator[wire.Message]]):
        self.loop = loop
        self.closed = False
        self.close_code: int | None = None
        self.received: list[wire.Message] = []
        self._acks = 0
        self._acked = asyncio.Event()
        self._frames = script(self)

    def wall(self) -> float:
        return WALL + self.loop.time()

    def version(self, ahead: float = 0.0) -> int:
        return int((self.wall() + ahead) * 1_000_000)

    async def acked(self, count: int) -> None:
        while self._acks < count:
            self._acked.clear()
            await self._acked.wait()

    def get_extra_info(self, name: str) -> Any:
        return None

    def exception(self) -> BaseException | None:
        return None

    async def send_bytes(self, data: bytes) -> None:
        message = wire.decode(data)
        self.received.append(message)
        if isinstance(message, wire.Ack):
            self._acks = message.seq
            self._acked.set()

    async def receive(self) -> WSMessage:
        try:
            message = await anext(self._frames)
        except StopAsyncIteration:
            return WSMessage(WSMsgType.CLOSE, wire.CLOSE_NORMAL, "session ended")
        return WSMessage(WSMsgType.BINARY, wire.encode(message), None)

    async def close(self, code: int = wire.CLOSE_NORMAL, message: bytes = b"") -> bool:
        self.closed = True
        self.close_code = code
        return True


Script = Callable[[ScriptedSender], AsyncIterator[wire.Message]]


def batch(entries: list[wire.Entry]) -> wire.Batch:
    return wire.Batch(entries=entries, marks={PEER: max(entry.version for entry in entries)}, head_seq=1)


def record(version: int, value: bytes = b"\xa2ok") -> wire.Entry:
    return wire.Entry("t", f"r{version}", value, version, PEER)


async def accepted(sender: ScriptedSender, ahead: float = 0.0) -> AsyncIterator[wire.Message]:
    """The handshake of a sender whose wall clock runs `ahead` of the subscriber's."""
    yield wire.Hello(node=PEER, capabilities=["origins", "exclude"], wall=sender.wall() + ahead)
    yield wire.Schema(database="db", epoch="e", head_seq=1)


async def clock_ahead(sender: ScriptedSender) -> AsyncIterator[wire.Message]:
    """Its Hello says its clock is an hour ahead: refused in the handshake."""
    async for frame in accepted(sender, ahead=HOUR_AHEAD):
        yield frame


async def applied_then_ahead(sender: ScriptedSender) -> AsyncIterator[wire.Message]:
    """Its clock is right, and so is its first batch, which is applied; its second holds a version an hour ahead."""
    async for frame in accepted(sender):
        yield frame
    yield batch([record(sender.version())])
    await sender.acked(1)
    yield batch([record(sender.version(ahead=HOUR_AHEAD))])


async def up_then_ahead(sender: ScriptedSender) -> AsyncIterator[wire.Message]:
    """The session is up past STAYED_UP before its first batch, which holds a version an hour ahead."""
    async for frame in accepted(sender):
        yield frame
    await asyncio.sleep(STAYED_UP + 1.0)
    yield batch([record(sender.version(ahead=HOUR_AHEAD))])


async def applied_then_poisoned(sender: ScriptedSender) -> AsyncIterator[wire.Message]:
    """A batch applied, then one whose value is not msgpack: refused whole."""
    async for frame in accepted(sender):
        yield frame
    yield batch([record(sender.version())])
    await sender.acked(1)
    yield batch([record(sender.version(), value=b"\xc1\xc1")])


async def applied_then_gone(sender: ScriptedSender) -> AsyncIterator[wire.Message]:
    """A batch applied, then the sender closes the session: real progress, and nothing refused."""
    async for frame in accepted(sender):
        yield frame
    yield batch([record(sender.version())])
    await sender.acked(1)


async def up_then_gone(sender: ScriptedSender) -> AsyncIterator[wire.Message]:
    """Up past STAYED_UP without a batch, then closed by the sender."""
    async for frame in accepted(sender):
        yield frame
    await asyncio.sleep(STAYED_UP + 1.0)


class Subscriber:
    """One pair of a node, dialling a peer that plays `scripts` in turn, one per session (the last one again once
    they run out)."""

    def __init__(self, loop: VirtualTimeLoop, tmp_path: Path, scripts: list[Script]) -> None:
        self.loop = loop
        self.reports: list[tuple[float, msgspec.Struct]] = []
        self.ctx = WorkerContext(
            worker_id=0,
            config=from_mapping(
                {
                    "node": {"name": "w", "url": "wss://127.0.0.1:9925"},
                    "replication": {"max_clock_skew": MAX_SKEW, "reconnect_jitter": "full"},
                },
                "",
            ),
            store=Store(tmp_path / "data", "w"),
            counters=Counters(),
            client_ssl=ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT),
            report=lambda message: self.reports.append((loop.time(), message)),
            wall=lambda: WALL + loop.time(),
        )
        self.scripts = scripts
        self.senders: list[ScriptedSender] = []
        ids = iter(range(1, 1_000_000))
        sub = messages.Subscribe(key="k", peer=PEER, url="wss://p.internal:9925", database="db")

        async def make() -> PeerSession:
            return PeerSession(self.ctx, None, sub, lambda: next(ids), rng=lambda: 0.5)  # type: ignore[arg-type]

        self.session = loop.run_until_complete(make())

        async def dial() -> Any:
            script = self.scripts[min(len(self.senders), len(self.scripts) - 1)]
            self.senders.append(ScriptedSender(loop, script))
            return self.senders[-1]

        self.session._dial = dial  # type: ignore[method-assign]

    def delays(self) -> list[tuple[float, str]]:
        """(reconnect_in, error) of every session that ended, in order."""
        return [
            (m.reconnect_in, m.error)
            for _, m in self.reports
            if isinstance(m, messages.Disconnected) and m.reconnect_in is not None
        ]

    def refusals(self) -> float:
        drained = self.ctx.counters.drain()
        return sum(d.value for d in drained if d.name == "replicator_clock_skew_refusals_total")

    def close(self) -> None:
        async def stop() -> None:
            self.session.stop()
            await self.session.wait_closed()
            await self.ctx.feeds.close()

        self.loop.run_until_complete(stop())
        self.ctx.store.close()


@pytest.fixture
def make_subscriber(
    loop: VirtualTimeLoop, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[list[Script]], Subscriber]]:
    # The TLS layer is faked away: the scripted sender presents the peer's certificate.
    monkeypatch.setattr(session_module, "peer_identity", lambda ssl_object: PeerIdentity(name=PEER, serial="01"))
    made: list[Subscriber] = []

    def make(scripts: list[Script]) -> Subscriber:
        made.append(Subscriber(loop, tmp_path / str(len(made)), scripts))
        made[-1].session.start()
        return made[-1]

    yield make
    for subscriber in made:
        subscriber.close()


def test_a_clock_skew_refusal_never_starts_the_schedule_over(
    make_subscriber: Callable[[list[Script]], Subscriber], loop: VirtualTimeLoop
) -> None:
    """Refused in the handshake, refused after a batch was applied, refused after the session was up past
    STAYED_UP: each waits the next, longer delay of one schedule. A session that applied a batch, or stayed up, and
    ended without a refusal starts it over."""
    scripts = [clock_ahead, clock_ahead, applied_then_ahead, up_then_ahead, applied_then_ahead, applied_then_gone]
    subscriber = make_subscriber([*scripts, clock_ahead, clock_ahead, up_then_gone, clock_ahead])
    loop.advance(60.0)
    delays = subscriber.delays()
    assert [delay for delay, _ in delays[:11]] == [*FIRST_DELAYS[:5], 0.5, 0.75, 1.25, 0.5, 0.75, 1.25]
    skewed = [error for _, error in delays if "ahead of our clock" in error or "ahead of ours" in error]
    assert [error for _, error in delays[:5]] == skewed[:5]
    assert delays[5][1] == delays[8][1] == "closed by the peer (1000: session ended)"
    assert subscriber.refusals() == len(skewed)
    # The first batch of each session refused after one was applied was acknowledged; the one ahead never was.
    for sender in (subscriber.senders[2], subscriber.senders[4]):
        assert [type(m).__name__ for m in sender.received] == ["Hello", "Subscribe", "Ack"]
        assert sender.close_code == wire.CLOSE_POLICY
    (top,) = subscriber.ctx.store.database("db").progress().values()
    assert top < int((WALL + 60.0) * 1_000_000)  # nothing from the future was applied


def test_a_refused_batch_after_an_applied_one_does_not_start_the_schedule_over(
    make_subscriber: Callable[[list[Script]], Subscriber], loop: VirtualTimeLoop
) -> None:
    subscriber = make_subscriber([applied_then_poisoned])
    loop.advance(40.0)
    delays = subscriber.delays()
    assert all("not msgpack" in error for _, error in delays), delays
    assert [delay for delay, _ in delays[:6]] == FIRST_DELAYS
    assert all(sender.close_code == wire.CLOSE_MALFORMED for sender in subscriber.senders)


async def answers_protocol_9(sender: ScriptedSender) -> AsyncIterator[wire.Message]:
    """A sender that chose a protocol version this node does not speak."""
    yield wire.Hello(node=PEER, protocol=9, protocols=[9, 8], capabilities=["origins", "exclude"], wall=sender.wall())


def test_a_sender_choosing_a_version_this_node_does_not_speak_is_refused_before_the_subscription(
    make_subscriber: Callable[[list[Script]], Subscriber], loop: VirtualTimeLoop
) -> None:
    subscriber = make_subscriber([answers_protocol_9])
    loop.advance(2.0)
    spoken = ", ".join(str(version) for version in wire.PROTOCOLS_SPOKEN)
    reason = f"p chose protocol 9, which w does not speak: w speaks [{spoken}], p speaks [9, 8]"
    assert [error for _, error in subscriber.delays()] == [reason] * len(subscriber.delays())
    assert subscriber.session.last_error == reason and not subscriber.session.connected
    for sender in subscriber.senders:
        (offered,) = sender.received  # no Subscribe follows the Hello
        assert isinstance(offered, wire.Hello) and offered.protocols == list(wire.PROTOCOLS_SPOKEN)
        assert sender.close_code == wire.CLOSE_POLICY
    assert [delay for delay, _ in subscriber.delays()[:3]] == FIRST_DELAYS[:3]  # refused: the schedule grows


async def answers_as_before_negotiation(sender: ScriptedSender) -> AsyncIterator[wire.Message]:
    """A sender from before negotiation (commit 9aaf386): protocol 2 and no list; then a batch, and gone."""
    yield wire.Hello(node=PEER, protocol=2, capabilities=["origins", "exclude"], wall=sender.wall())
    yield wire.Schema(database="db", epoch="e", head_seq=1)
    yield batch([record(sender.version())])
    await sender.acked(1)


def test_the_session_speaks_what_a_sender_from_before_negotiation_answers(
    make_subscriber: Callable[[list[Script]], Subscriber], loop: VirtualTimeLoop
) -> None:
    subscriber = make_subscriber([answers_as_before_negotiation])
    loop.advance(0.1)
    (connected,) = [m for _, m in subscriber.reports if isinstance(m, messages.Connected)]
    assert connected.protocol == subscriber.session.protocol == 2
    offered = subscriber.senders[0].received[0]
    assert isinstance(offered, wire.Hello) and offered.protocol == min(wire.PROTOCOLS_SPOKEN)
