"""Which protocol version a session speaks (`wire.choose_protocol`, `wire.check_choice`), and that the Hello stays
readable both ways by a node from before negotiation (commit 9aaf386, protocol 2 exactly).

The subscriber's Hello lists every version it speaks and says the oldest as `protocol`; the sender answers with the
newest version both speak. What the next protocol changes will make of it is played by patching
`wire.PROTOCOLS_SPOKEN`: (3, 2), then (4, 3).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from aiohttp import WSMessage, WSMsgType

from replicator.shared import wire
from replicator.shared.config import from_mapping
from replicator.workers.counters import Counters
from replicator.workers.sender import Sender
from tests.unit.fakeloop import VirtualTimeLoop


class OldHello(msgspec.Struct, tag="hello", kw_only=True):
    """`wire.Hello` as commit 9aaf386 has it: no `protocols`, and a node refuses any `protocol` but 2."""

    node: str
    protocol: int = 2
    capabilities: list[str] = []
    wall: float = 0.0
    max_frame: int = 0


class OldSubscribe(msgspec.Struct, tag="subscribe", kw_only=True):
    database: str


old_decoder = msgspec.msgpack.Decoder(OldHello | OldSubscribe)


def hello(protocol: int, protocols: list[int] | None = None) -> wire.Hello:
    return wire.Hello(node="p", protocol=protocol, protocols=protocols or [])


@pytest.fixture
def speaks(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Make this node speak the given versions, newest first, as a later release will."""

    def make(*versions: int) -> None:
        monkeypatch.setattr(wire, "PROTOCOLS_SPOKEN", tuple(versions))

    return make


def test_the_version_set_is_this_release_and_at_most_the_one_before() -> None:
    spoken = wire.PROTOCOLS_SPOKEN
    assert spoken == tuple(sorted(spoken, reverse=True)) and spoken[0] == wire.PROTOCOL_VERSION
    assert list(spoken) == list(range(spoken[0], spoken[0] - len(spoken), -1)) and len(spoken) <= 2


@pytest.mark.parametrize(
    ("ours", "theirs", "chosen"),
    [
        ((2,), hello(2, [2]), 2),
        ((2,), hello(2), 2),  # a dialler from before negotiation: no list, protocol 2
        ((3, 2), hello(2), 2),
        ((3, 2), hello(2, [3, 2]), 3),
        ((3, 2), hello(2, [2, 3, 3]), 3),  # the order and repeats of the peer's list do not matter
        ((4, 3), hello(2, [3, 2]), 3),
        ((3, 2), hello(3, [4, 3]), 3),
        ((2,), hello(2, [3, 2]), 2),  # the peer is the newer one
    ],
)
def test_the_sender_chooses_the_newest_version_both_speak(
    speaks: Any, ours: tuple[int, ...], theirs: wire.Hello, chosen: int
) -> None:
    speaks(*ours)
    assert wire.choose_protocol(theirs, "s") == chosen
    # The answer carries the choice, which the subscriber checks against what it speaks.
    answer = wire.decode(wire.encode(wire.answer(chosen, node="s")))
    assert isinstance(answer, wire.Hello) and answer.protocol == chosen and answer.protocols == list(ours)


@pytest.mark.parametrize(
    ("ours", "theirs", "listed"),
    [
        ((2,), hello(3, [4, 3]), "s speaks [2], p speaks [4, 3]"),
        ((4, 3), hello(2), "s speaks [4, 3], p speaks [2]"),  # a node two releases behind
        ((2,), hello(7), "s speaks [2], p speaks [7]"),
    ],
)
def test_no_version_in_common_is_refused_naming_both_lists(
    speaks: Any, ours: tuple[int, ...], theirs: wire.Hello, listed: str
) -> None:
    speaks(*ours)
    with pytest.raises(wire.Refused) as refused:
        wire.choose_protocol(theirs, "s")
    assert refused.value.reason == f"no protocol version in common: {listed}"
    assert refused.value.code == wire.CLOSE_POLICY
    # The close frame carries it whole: the peer reports the same words.
    assert wire.close_reason(refused.value.reason) == refused.value.reason


def test_the_subscriber_refuses_a_choice_it_does_not_speak(speaks: Any) -> None:
    speaks(3, 2)
    assert wire.check_choice(hello(3, [3, 2]), "n") == 3
    assert wire.check_choice(hello(2), "n") == 2  # a sender from before negotiation answers 2 and no list
    with pytest.raises(wire.Refused) as refused:
        wire.check_choice(hello(4, [5, 4]), "n")
    assert refused.value.reason == "p chose protocol 4, which n does not speak: n speaks [3, 2], p speaks [5, 4]"
    with pytest.raises(wire.Refused, match=r"p chose protocol 1, .* n speaks \[3, 2\], p speaks \[1\]$"):
        wire.check_choice(hello(1), "n")


@pytest.mark.parametrize("ours", [(2,), (3, 2)])
def test_a_node_from_before_negotiation_reads_our_hello_as_protocol_2(speaks: Any, ours: tuple[int, ...]) -> None:
    """As the subscriber, this node's Hello says 2 to an old sender (which compares `protocol` with its own and
    never sees `protocols`) for as long as it speaks 2."""
    speaks(*ours)
    offered = wire.offer(node="n", capabilities=wire.CAPABILITIES, wall=1.0, max_frame=1024)
    assert offered.protocols == list(ours) and offered.protocol == 2
    old = old_decoder.decode(wire.encode(offered))
    assert isinstance(old, OldHello) and old.protocol == 2 and old.node == "n" and old.max_frame == 1024


@pytest.mark.parametrize(("ours", "chosen"), [((2,), 2), ((3, 2), 2)])
def test_an_old_subscribers_hello_is_answered_in_protocol_2(speaks: Any, ours: tuple[int, ...], chosen: int) -> None:
    """As the sender, this node reads an old subscriber's Hello (no list) as speaking 2, and answers 2, which is what
    the old subscriber checks."""
    speaks(*ours)
    theirs = wire.decode(msgspec.msgpack.encode(OldHello(node="old", capabilities=wire.CAPABILITIES)))
    assert isinstance(theirs, wire.Hello) and theirs.protocols == [] and wire.spoken_by(theirs) == [2]
    assert wire.choose_protocol(theirs, "s") == chosen
    old = old_decoder.decode(wire.encode(wire.answer(chosen, node="s")))
    assert isinstance(old, OldHello) and old.protocol == 2


def test_a_hostile_list_is_refused_where_it_is_decoded() -> None:
    longest = [2] * wire.MAX_PROTOCOLS
    decoded = wire.decode(wire.encode(wire.Hello(node="p", protocols=longest)))
    assert isinstance(decoded, wire.Hello) and wire.spoken_by(decoded) == [2]
    for protocols in ([2] * (wire.MAX_PROTOCOLS + 1), [2] * 1_000_000, [2, 2**63], [2, -1], [2, "3"]):
        frame = msgspec.msgpack.encode({"type": "hello", "node": "p", "protocols": protocols})
        with pytest.raises(wire.MalformedFrame) as refused:
            wire.decode(frame)
        assert refused.value.close_code == wire.CLOSE_MALFORMED and "protocols" in refused.value.reason


class Socket:
    """The sender's WebSocket: the subscriber's frames in, then a close; what the sender sends, decoded."""

    def __init__(self, *frames: bytes) -> None:
        self.frames = list(frames)
        self.sent: list[wire.Message] = []

    async def receive(self) -> WSMessage:
        if self.frames:
            return WSMessage(WSMsgType.BINARY, self.frames.pop(0), None)
        return WSMessage(WSMsgType.CLOSE, wire.CLOSE_NORMAL, "")

    async def send_bytes(self, data: bytes) -> None:
        self.sent.append(wire.decode(data))


def handshake(loop: VirtualTimeLoop, frame: bytes) -> tuple[Sender, Socket, BaseException]:
    """A sender's session whose subscriber sends `frame` as its Hello and closes after the answer."""
    config = from_mapping({"node": {"name": "n", "url": "wss://127.0.0.1:1"}}, "")
    ctx = SimpleNamespace(config=config, counters=Counters(), report=lambda _: None, node="n", wall=lambda: 0.0)
    ws = Socket(frame)
    sender = Sender(ctx, ws, "p")  # type: ignore[arg-type]
    with pytest.raises(wire.SessionError) as ended:
        loop.run(sender.run())
    return sender, ws, ended.value


@pytest.mark.parametrize(
    ("ours", "theirs", "chosen"),
    [
        ((2,), OldHello(node="p"), 2),
        ((2,), wire.Hello(node="p", protocols=[2]), 2),
        ((3, 2), OldHello(node="p"), 2),
        ((3, 2), wire.Hello(node="p", protocol=2, protocols=[3, 2]), 3),
    ],
)
def test_the_sender_answers_with_its_choice_and_keeps_it(
    speaks: Any, loop: VirtualTimeLoop, ours: tuple[int, ...], theirs: msgspec.Struct, chosen: int
) -> None:
    speaks(*ours)
    sender, ws, ended = handshake(loop, msgspec.msgpack.encode(theirs))
    assert isinstance(ended, wire.PeerClosed)  # the subscriber closed after the answer
    (answer,) = ws.sent
    assert isinstance(answer, wire.Hello) and answer.protocol == chosen and answer.protocols == list(ours)
    assert sender.protocol == chosen


def test_the_sender_refuses_a_subscriber_it_shares_no_version_with_before_it_answers(
    speaks: Any, loop: VirtualTimeLoop
) -> None:
    speaks(3, 2)
    sender, ws, ended = handshake(loop, wire.encode(wire.Hello(node="p", protocol=4, protocols=[5, 4])))
    assert isinstance(ended, wire.Refused) and ended.code == wire.CLOSE_POLICY
    assert ended.reason == "no protocol version in common: n speaks [3, 2], p speaks [5, 4]"
    assert ws.sent == [] and sender.protocol == 0
