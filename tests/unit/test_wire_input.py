"""The wire decoder against any input: a frame is a message of the protocol or MalformedFrame, nothing else.

Numbers a peer sends are bounded where they are decoded (63 bits for sequences, versions and marks; a finite wall
clock), so no later code meets a value SQLite or the clock arithmetic cannot hold.
"""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from replicator.shared import wire

MESSAGES = (wire.Hello, wire.Subscribe, wire.Schema, wire.Batch, wire.Ack, wire.Holds)
TAGS = ["hello", "subscribe", "schema", "batch", "ack", "holds", "teleport", "", None, 7]

leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.binary(max_size=20),
)
values = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=5),
        st.dictionaries(st.text(max_size=10), children, max_size=5),
    ),
    max_leaves=30,
)
fields = st.sampled_from(
    ["type", "node", "protocol", "wall", "max_frame", "database", "progress", "exclude", "own_upto", "epoch",
     "head_seq", "entries", "marks", "caught_up", "seq", "capabilities", "protocols"]
)  # fmt: skip
frames = st.dictionaries(fields, values, max_size=8).flatmap(
    lambda body: st.sampled_from(TAGS).map(lambda tag: {**body, "type": tag})
)


def _check(data: bytes) -> None:
    try:
        message = wire.decode(data)
    except wire.MalformedFrame as exc:
        assert exc.close_code in (wire.CLOSE_MALFORMED, wire.CLOSE_UNSUPPORTED)
        return
    assert isinstance(message, MESSAGES)
    for number in _numbers(message):
        assert -(2**63) <= number < 2**63


def _numbers(message: Any) -> list[int]:
    found: list[int] = []
    for value in msgspec.structs.asdict(message).values():
        if isinstance(value, int) and not isinstance(value, bool):
            found.append(value)
        elif isinstance(value, dict):
            found.extend(v for v in value.values() if isinstance(v, int))
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, wire.Entry):
                    found.append(item.version)
                elif isinstance(item, int) and not isinstance(item, bool):
                    found.append(item)  # Hello.protocols
    return found


@settings(max_examples=400, deadline=None)
@given(frames)
def test_any_structured_frame_decodes_or_is_refused(body: dict[str, Any]) -> None:
    _check(msgspec.msgpack.encode(body))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_decode_or_are_refused(data: bytes) -> None:
    _check(data)


def test_out_of_range_numbers_are_refused_where_decoded() -> None:
    for body in [
        {"type": "ack", "seq": 2**63},
        {"type": "schema", "database": "d", "epoch": "e", "head_seq": -1},
        {"type": "batch", "entries": [], "marks": {"a": 2**64 - 1}},
        {"type": "hello", "node": "a", "wall": float("nan")},
        {"type": "hello", "node": "a", "wall": float("inf")},
        {"type": "subscribe", "database": "d", "progress": {"a": 2**63}},
    ]:
        try:
            wire.decode(msgspec.msgpack.encode(body))
        except wire.MalformedFrame as exc:
            assert exc.close_code == wire.CLOSE_MALFORMED
        else:
            raise AssertionError(f"{body} was accepted")
    nan_wall = b"\x83\xa4type\xa5hello\xa4node\xa1a\xa4wall\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00"
    try:
        wire.decode(nan_wall)
    except wire.MalformedFrame:
        pass
    else:
        raise AssertionError("a NaN wall clock was accepted")


def test_bad_value_names_the_record() -> None:
    entries = [wire.Entry("t", "ok", msgspec.msgpack.encode({"v": 1}), 5, "a"), wire.Entry("t", "bad", b"\xc1", 6, "a")]
    assert "t/bad" in (wire.bad_value(entries) or "")
    assert wire.bad_value([wire.Entry("t", "gone", b"", 7, "a", True)]) is None
