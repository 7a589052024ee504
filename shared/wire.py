"""The replication protocol between a subscriber and a sender: WebSocket subprotocol `replicator.v1`.

Each WebSocket binary message carries exactly one msgpack tagged struct; the WebSocket layer frames it and its
maximum message size caps it (`replication.max_frame_bytes`). One session replicates one database.

    subscriber                                sender
        Hello(node, protocol, capabilities) -->
                                           <-- Hello
        Subscribe(database, resume, exclude) ->
                                           <-- Schema(database, epoch, head_seq, copy)
      [ copy:                              <-- CopyStart(snapshot_seq)
                                           <-- CopyBatch(table, records, last_id) ...
                                           <-- CopyComplete(snapshot_seq)        ]
      [ self-catchup:                      <-- Batch(entries, last_seq=None) ... ]
                                           <-- Batch(entries, last_seq, head_seq) ...
        Ack(seq) -------------------------->

Close codes: 1000 normal, 1001 going away (shutdown), 1002 malformed frame, 1003 unknown message type,
1008 refused (authentication or policy), 1009 frame too large, 1011 internal error,
4000 unsubscribed, 4001 forced reconnect.
"""

from __future__ import annotations

import msgspec

SUBPROTOCOL = "replicator.v1"
PROTOCOL_VERSION = 1
CAPABILITIES = ["copy", "catchup", "exclude"]

CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_MALFORMED = 1002
CLOSE_UNSUPPORTED = 1003
CLOSE_POLICY = 1008
CLOSE_TOO_BIG = 1009
CLOSE_INTERNAL = 1011
CLOSE_UNSUBSCRIBED = 4000
CLOSE_FORCED = 4001


class Entry(msgspec.Struct, array_like=True, frozen=True):
    """One committed record version: what the audit log holds and what travels."""

    table: str
    id: str
    value: bytes  # msgpack of the record's value; empty for a tombstone
    version: int
    origin: str
    tombstone: bool = False


class Hello(msgspec.Struct, tag="hello", kw_only=True):
    node: str
    protocol: int = PROTOCOL_VERSION
    capabilities: list[str] = []


class Subscribe(msgspec.Struct, tag="subscribe", kw_only=True):
    database: str
    # Resume after this sequence of the sender's audit log; None asks for a bulk copy first.
    resume_seq: int | None = None
    # The version of the entry at resume_seq as the subscriber received it, so the sender can tell a log that was
    # replaced (restored from a backup) from the one the cursor points into.
    resume_version: int = 0
    epoch: str = ""
    exclude: list[str] = []
    # Self-catchup: send the records originated by the subscriber itself with a version above this first.
    catchup_after: int | None = None


class Schema(msgspec.Struct, tag="schema", kw_only=True):
    database: str
    epoch: str
    head_seq: int
    copy: bool  # a bulk copy follows


class CopyStart(msgspec.Struct, tag="copy_start", kw_only=True):
    snapshot_seq: int


class CopyBatch(msgspec.Struct, tag="copy_batch", kw_only=True):
    table: str
    records: list[Entry]
    last_id: str


class CopyComplete(msgspec.Struct, tag="copy_complete", kw_only=True):
    snapshot_seq: int
    snapshot_version: int = 0  # the version of the entry at snapshot_seq, for the resume check


class Batch(msgspec.Struct, tag="batch", kw_only=True):
    entries: list[Entry]
    # The sender's audit sequence this batch brings the subscriber to (excluded entries included); None for a
    # self-catchup batch, which does not move the cursor.
    last_seq: int | None
    last_version: int = 0
    head_seq: int = 0


class Ack(msgspec.Struct, tag="ack", kw_only=True):
    seq: int  # the subscriber's durable cursor


Message = Hello | Subscribe | Schema | CopyStart | CopyBatch | CopyComplete | Batch | Ack

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


def close_reason(text: str) -> str:
    """A WebSocket close reason must fit in 123 bytes of UTF-8."""
    data = text.encode()
    if len(data) <= 120:
        return text
    return data[:117].decode(errors="ignore") + "..."
