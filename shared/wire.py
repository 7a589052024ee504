"""The replication protocol between a subscriber and a sender: WebSocket subprotocol `replicator.v1`.

Each WebSocket binary message carries exactly one msgpack tagged struct; the WebSocket layer frames it and its
maximum message size caps it (`replication.max_frame_bytes`). One session replicates one database.

    subscriber                                sender
        Hello(node, protocol, protocols, wall) ->
                                           <-- Hello(node, protocol, protocols, wall)
        Subscribe(database, progress, exclude) ->
                                           <-- Schema(database, epoch, head_seq, yours, purged)
                                           <-- Batch(entries, marks, head_seq, caught_up) ...
        Ack(seq) -------------------------->
        Holds(progress) ------------------>         (now and then: what the subscriber holds)
                                           <-- Heads(complete)   (now and then: what the sender could serve)

Replication is by origin. `progress` says, per origin, up to which version the subscriber holds everything;
the sender serves every origin not in `exclude` from there, in version order per origin, and each Batch's
`marks` raise those versions in the subscriber's apply transaction. A first sync is the same stream from 0,
so it resumes wherever it stopped. `wall` is each end's wall clock, so both see the offset before data moves.
`protocols` in the subscriber's Hello lists the protocol versions it speaks; the sender answers with the newest one
both speak in its Hello's `protocol` (`choose_protocol`), and the session speaks that version from then on.
`Heads` lets the subscriber see that the sender is ahead of it, whatever the sender's stream is doing: a pair whose
peer is ahead and whose position does not move is stalled (invariant 21).

Close codes: 1000 normal, 1001 going away (shutdown), 1002 malformed frame, 1003 unknown message type,
1008 refused (authentication or policy), 1009 frame too large, 1011 internal error,
4000 unsubscribed, 4001 forced reconnect.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any

import msgspec

SUBPROTOCOL = "replicator.v1"
# The protocol versions this node speaks, newest first: its own and the one before, so that a cluster upgrades one
# node at a time and every pair keeps a version in common (README, "Rolling upgrades"). The next protocol change
# makes this (3, 2): version 2 stays for one release, and the release after drops it, (4, 3).
PROTOCOLS_SPOKEN: tuple[int, ...] = (2,)
PROTOCOL_VERSION = PROTOCOLS_SPOKEN[0]  # this node's own version
# The most versions a Hello may list (a node speaks two): what a peer's Hello makes this end hold and compare is
# bounded where it is decoded.
MAX_PROTOCOLS = 16
CAPABILITIES = ["origins", "exclude", "holds", "heads"]

CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_MALFORMED = 1002
CLOSE_UNSUPPORTED = 1003
CLOSE_POLICY = 1008
CLOSE_TOO_BIG = 1009
CLOSE_INTERNAL = 1011
CLOSE_UNSUBSCRIBED = 4000
CLOSE_FORCED = 4001


# Every number a peer sends is bounded where it is decoded: a sequence, version or mark fits SQLite's signed 63-bit
# integers, and a wall clock is a finite time between 1970 and the year 5138.
MAX63 = 2**63 - 1
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX63)]
Wall = Annotated[float, msgspec.Meta(ge=0.0, le=1e11)]
FrameSize = Annotated[int, msgspec.Meta(ge=0, le=2**31)]
Versions = Annotated[list[Count], msgspec.Meta(max_length=MAX_PROTOCOLS)]


class Entry(msgspec.Struct, array_like=True, frozen=True):
    """One committed record version: what the audit log holds and what travels."""

    table: str
    id: str
    value: bytes  # msgpack of the record's value; empty for a tombstone
    version: Count
    origin: str
    tombstone: bool = False


# The most msgpack adds to an entry's strings and bytes: its array's header, a header of at most 5 bytes for each of
# table, id, value and origin, the version (at most 9) and the tombstone flag (1).
ENTRY_OVERHEAD = 1 + 4 * 5 + 9 + 1


def entry_size(entry: Entry) -> int:
    """The most bytes `entry` takes in a frame: what a sender counts to keep its frames within the limit."""
    return len(entry.value) + _utf8_size(entry.id) + _utf8_size(entry.table) + _utf8_size(entry.origin) + ENTRY_OVERHEAD


def _utf8_size(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode())


class Hello(msgspec.Struct, tag="hello", kw_only=True):
    node: str
    # The subscriber's Hello: the oldest version it speaks, which is all a node from before negotiation reads (it
    # refuses any other than its own). The sender's answer: the version the session speaks, chosen from `protocols`.
    protocol: Count = PROTOCOL_VERSION
    capabilities: list[str] = []
    wall: Wall = 0.0  # the sender of this Hello's wall clock, seconds since the epoch
    # The largest frame this end accepts (its replication.max_frame_bytes; 0: not said). A sender builds no frame
    # larger than half of it.
    max_frame: FrameSize = 0
    # Every version this end speaks. A node from before negotiation sends none: it speaks `protocol` only.
    protocols: Versions = []


def offer(**fields: Any) -> Hello:
    """This node's Hello as the subscriber sends it: every version it speaks, and the oldest of them as `protocol`."""
    return Hello(protocol=min(PROTOCOLS_SPOKEN), protocols=list(PROTOCOLS_SPOKEN), **fields)


def answer(protocol: int, **fields: Any) -> Hello:
    """This node's Hello as the sender answers: the version chosen (`choose_protocol`), and every version it speaks."""
    return Hello(protocol=protocol, protocols=list(PROTOCOLS_SPOKEN), **fields)


def spoken_by(hello: Hello) -> list[int]:
    """The versions the end that sent `hello` speaks, newest first."""
    return sorted(set(hello.protocols), reverse=True) if hello.protocols else [hello.protocol]


def choose_protocol(hello: Hello, own: str) -> int:
    """The sender's choice for the session the subscriber's `hello` opens: the newest version both ends speak.

    Raises Refused naming both nodes (this one is `own`) and what each speaks when they share none."""
    theirs = spoken_by(hello)
    shared = set(theirs) & set(PROTOCOLS_SPOKEN)
    if not shared:
        peer = hello.node[:64]
        raise Refused(
            f"no protocol version in common: {own} speaks {_listed(PROTOCOLS_SPOKEN)}, {peer} speaks {_listed(theirs)}"
        )
    return max(shared)


def check_choice(hello: Hello, own: str) -> int:
    """The subscriber's check of the sender's answer: the version it chose must be one this node (`own`) speaks.

    Raises Refused naming both nodes and what each speaks when it is not."""
    if hello.protocol not in PROTOCOLS_SPOKEN:
        peer = hello.node[:64]
        raise Refused(
            f"{peer} chose protocol {hello.protocol}, which {own} does not speak: {own} speaks"
            f" {_listed(PROTOCOLS_SPOKEN)}, {peer} speaks {_listed(spoken_by(hello))}"
        )
    return hello.protocol


def _listed(versions: Iterable[int]) -> str:
    return "[" + ", ".join(str(version) for version in sorted(set(versions), reverse=True)) + "]"


class Subscribe(msgspec.Struct, tag="subscribe", kw_only=True):
    database: str
    # Per origin, the version up to which the subscriber holds every write; origins absent start at 0.
    progress: dict[str, Count] = {}
    # Origins the subscriber receives over other links: the sender does not serve them on this session.
    exclude: list[str] = []
    # The subscriber's own origin is served only up to this version (0: not at all). A node has everything it
    # wrote into its file; only a file that lost its history (recovering) asks for its older writes back.
    own_upto: Count = 0


class Schema(msgspec.Struct, tag="schema", kw_only=True):
    database: str
    epoch: str
    head_seq: Count  # the sender's audit sequence, for the subscriber's progress figures
    # Records the sender will serve before it is caught up, counted when the session starts (at most
    # BACKLOG_COUNT_CAP): the subscriber's copy progress and time left.
    backlog: Count = 0
    # What the sender holds complete of the subscriber's own origin: above what the subscriber's file accounts for,
    # the subscriber's file went back in time or lost its own writes (`shared.own_writes`).
    yours: Count = 0
    # By origin, how far the sender has purged tombstones: a subscriber whose progress for one is below it may hold
    # records whose deletions it will never be sent, and reconciles with anti-entropy at once.
    purged: dict[str, Count] = {}


class Batch(msgspec.Struct, tag="batch", kw_only=True):
    entries: list[Entry]
    # Per origin: once the subscriber holds this batch it holds every version of the origin up to the mark.
    marks: dict[str, Count] = {}
    head_seq: Count = 0
    caught_up: bool = False  # the sender had nothing more to serve when it made this batch
    # The sender's own file of the database is recovering (it lost it, or it went back in time): caught up with
    # it, a subscriber holds what it holds, which may be less than it will (`coordinator.recovery`).
    recovering: bool = False


class Ack(msgspec.Struct, tag="ack", kw_only=True):
    seq: Count  # how many batches the subscriber has applied on this session


class Holds(msgspec.Struct, tag="holds", kw_only=True):
    """Subscriber -> sender, now and then (capability "holds"): what the subscriber holds complete of every origin,
    those it gets over other links included. The sender's node purges a tombstone only once every holder has it."""

    progress: dict[str, Count]
    # What the subscriber's node knows other nodes hold complete of the database (node -> origin -> complete): a
    # node confirms a write held by a node it has no session with through the nodes between (issue 22,
    # `coordinator.confirmations`). An older peer sends none.
    others: dict[str, dict[str, Count]] = {}


class Heads(msgspec.Struct, tag="heads", kw_only=True):
    """Sender -> subscriber, when it changes and at most every few seconds (capability "heads"): per origin this
    session serves, the mark the sender could give the subscriber now (what it holds complete, within the
    subscription's limits). An origin whose stream waits at a damaged record is left out: it is held back on purpose."""

    complete: dict[str, Count]


Message = Hello | Subscribe | Schema | Batch | Ack | Holds | Heads

_validate = msgspec.msgpack.Decoder().decode


def bad_value(entries: list[Entry]) -> str | None:
    """Why a peer's entries must be refused, if one's value is not msgpack (the data API stores every value so; one
    that is not would be stored, relayed, and then fail every read on every node)."""
    for entry in entries:
        if entry.tombstone:
            continue
        try:
            _validate(entry.value)
        except msgspec.DecodeError as exc:
            return f"record {entry.table[:64]}/{entry.id[:200]}: the value is not msgpack ({exc})"
    return None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class MalformedFrame(Exception):
    """The frame does not decode; `unknown_type` tells a well-formed frame of a type we do not speak."""

    def __init__(self, reason: str, unknown_type: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.unknown_type = unknown_type

    @property
    def close_code(self) -> int:
        return CLOSE_UNSUPPORTED if self.unknown_type else CLOSE_MALFORMED


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> Message:
    try:
        return _decoder.decode(data)
    except msgspec.ValidationError as exc:
        text = str(exc)
        unknown = "`$.type`" in text and ("Invalid value" in text or "missing required field" not in text)
        return _raise(f"unknown message type: {text}" if unknown else f"invalid message: {text}", unknown)
    except msgspec.DecodeError as exc:
        return _raise(f"malformed frame: {exc}", False)


def _raise(reason: str, unknown: bool) -> Message:
    raise MalformedFrame(reason, unknown)


class SessionError(Exception):
    """Base of why a replication session ended; `code` is the WebSocket close code to send or that was received."""

    code = CLOSE_INTERNAL

    def __init__(self, reason: str, code: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        if code is not None:
            self.code = code


class PeerClosed(SessionError):
    """The peer closed the session or the connection broke."""


class ProtocolViolation(SessionError):
    """The peer sent something the protocol does not allow here (rejected input)."""

    code = CLOSE_MALFORMED


class Refused(SessionError):
    """The peer refused us, or we refuse the peer (authentication, policy)."""

    code = CLOSE_POLICY


class ClockSkew(Refused):
    """The peer's clock, or a version it sent, lies further ahead of ours than `replication.max_clock_skew`."""

    def __init__(self, reason: str, skew_s: float) -> None:
        super().__init__(reason)
        self.skew_s = skew_s


def close_reason(text: str) -> str:
    """A WebSocket close reason must fit in 123 bytes of UTF-8."""
    data = text.encode()
    if len(data) <= 120:
        return text
    return data[:117].decode(errors="ignore") + "..."
