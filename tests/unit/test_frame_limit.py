"""The frame limit (`replication.max_frame_bytes`) at both ends of a session: a sender never builds a frame above the
limit its peer said, whatever the entries' names hold; a frame refused as too large ends the session with 1009, a
reason naming the limit, and a count. That a frame of exactly the limit passes is aiohttp's to show:
tests/integration/test_hostile_peer.py, both ways."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from aiohttp import WebSocketError, WSMsgType
from hypothesis import given, settings
from hypothesis import strategies as st

from replicator.shared import wire
from replicator.workers import frames
from replicator.workers.counters import Counters
from replicator.workers.sender import Sender

MAX63 = 2**63 - 1
names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_-", min_size=1, max_size=64)
entries = st.builds(
    wire.Entry,
    table=names,
    id=st.text(min_size=1, max_size=1024),  # any Unicode: up to 4 bytes a character
    value=st.binary(max_size=2048),
    version=st.integers(min_value=0, max_value=MAX63),
    origin=names,
    tombstone=st.booleans(),
)

# Where a frame's bytes are mostly names: long tables and origins, ids beyond ASCII, small values.
long_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz", min_size=48, max_size=64)
crowded = st.builds(
    wire.Entry,
    table=long_names,
    id=st.text(alphabet=st.characters(min_codepoint=0x800, exclude_categories=["Cs"]), min_size=32, max_size=64),
    value=st.binary(max_size=16),
    version=st.integers(min_value=0, max_value=MAX63),
    origin=long_names,
)


def sender(limit: int) -> Any:
    made: Any = Sender.__new__(Sender)
    made._send_limit = limit
    made._frame_budget = limit // 2
    return made


def frame(chunk: list[wire.Entry]) -> bytes:
    """The largest batch frame a chunk can go out in: every field at its widest, a mark for each of its origins."""
    marks = {entry.origin: MAX63 for entry in chunk}
    return wire.encode(wire.Batch(entries=chunk, marks=marks, head_seq=MAX63, caught_up=True, recovering=True))


@settings(max_examples=300, deadline=None)
@given(entries)
def test_entry_size_bounds_the_encoded_entry(entry: wire.Entry) -> None:
    assert len(msgspec.msgpack.encode(entry)) <= wire.entry_size(entry)


def test_small_records_with_long_names_are_cut_into_frames_within_the_limit() -> None:
    """Tiny values under 64-character tables and origins: each record's frame bytes are mostly its names."""
    limit = 64 * 1024
    batch = [wire.Entry("t" * 64, f"r{n}", b"\xa1x", 1_700_000_000_000_000 + n, "o" * 64) for n in range(1000)]
    chunks = sender(limit)._chunks(batch)
    assert [entry for chunk in chunks for entry in chunk] == batch
    assert all(len(frame(chunk)) <= limit for chunk in chunks), [len(frame(chunk)) for chunk in chunks]


def test_ids_beyond_ascii_are_counted_in_bytes() -> None:
    limit = 64 * 1024
    batch = [wire.Entry("t", "\U0001f600" * 1024 + str(n), b"\xa1x", n + 1, "o") for n in range(64)]
    chunks = sender(limit)._chunks(batch)
    assert len(chunks) > 1 and all(len(frame(chunk)) <= limit for chunk in chunks)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(crowded, entries), min_size=20, max_size=60))
def test_no_chunk_of_any_batch_makes_a_frame_above_the_limit(batch: list[wire.Entry]) -> None:
    limit = 4096  # far below the configurable least (64 KiB): a few entries fill a frame
    try:
        chunks = sender(limit)._chunks(batch)
    except wire.Refused as exc:
        assert exc.code == wire.CLOSE_TOO_BIG
        assert any(wire.entry_size(entry) > limit // 2 for entry in batch)  # a record no frame can carry
        return
    assert [entry for chunk in chunks for entry in chunk] == batch
    assert all(len(frame(chunk)) <= limit for chunk in chunks)


class FakeSocket:
    """What `frames` needs of an aiohttp WebSocket; `close_code` is what aiohttp's own close leaves behind."""

    def __init__(self, incoming: list[Any], frame_limit: int = 0) -> None:
        self.incoming = incoming
        self.sent: list[bytes] = []
        self.close_code = 1006
        self.frame_limit = frame_limit

    async def receive(self) -> Any:
        return self.incoming.pop(0)

    async def send_bytes(self, data: bytes) -> None:
        self.sent.append(data)

    def exception(self) -> BaseException | None:
        return None  # aiohttp keeps a refused frame's error in the message, not here


async def test_a_frame_above_the_limit_ends_the_session_with_1009_naming_the_limit() -> None:
    error = WebSocketError(wire.CLOSE_TOO_BIG, "Message size 65537 exceeds limit 65537")
    counters = Counters()
    ws = frames.Metered(
        FakeSocket([SimpleNamespace(type=WSMsgType.ERROR, data=error, extra=None)], 65536), counters, "b"
    )
    with pytest.raises(wire.ProtocolViolation) as refused:
        await frames.receive(ws)
    assert refused.value.code == wire.CLOSE_TOO_BIG
    assert refused.value.reason == "frame too large: at most 65536 bytes (replication.max_frame_bytes)"
    deltas = {(d.name, tuple(d.labels)): d.value for d in counters.drain()}
    assert deltas == {(frames.FRAMES_REFUSED, ("b",)): 1.0}


async def test_a_broken_connection_is_still_the_peer_going_away() -> None:
    broken = ConnectionResetError(104, "Connection reset by peer")
    ws = FakeSocket([SimpleNamespace(type=WSMsgType.ERROR, data=broken, extra=None)])
    with pytest.raises(wire.PeerClosed) as closed:
        await frames.receive(ws)
    assert closed.value.code == 1006 and "reset by peer" in closed.value.reason


async def test_no_frame_above_the_peers_limit_is_sent() -> None:
    ws = FakeSocket([])
    holds = wire.Holds(progress={f"node{n:04d}": MAX63 for n in range(1024)})
    size = len(wire.encode(holds))
    await frames.send(ws, holds, size)  # exactly the limit: sent
    with pytest.raises(wire.Refused) as refused:
        await frames.send(ws, holds, size - 1)
    assert refused.value.code == wire.CLOSE_TOO_BIG and f"{size} bytes" in refused.value.reason
    assert [len(data) for data in ws.sent] == [size]
