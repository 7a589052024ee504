"""Reading and writing replication frames on a WebSocket, for both ends of a session.

aiohttp's client and server WebSockets share `receive()`, `send_bytes()` and `close()`; this module turns what
they report into the protocol's exceptions, split by cause: the peer closed or broke the link (`PeerClosed`), the
peer sent something we do not accept (`MalformedFrame`, `ProtocolViolation`). A `Metered` socket counts the bytes
of the frames that pass, per peer, for `replicator_bytes_sent_total` and `replicator_bytes_received_total`, and the
frames refused as too large, for `replicator_frames_refused_total`.

The frame limit, `replication.max_frame_bytes`, is inclusive at both ends: a frame of exactly that many bytes passes,
one byte more closes the session with 1009 (message too big) and a reason naming the limit, and no end sends a frame
above the limit its peer said in its Hello (`send`). aiohttp enforces the limit it is given as `max_msg_size`, before
it buffers the payload, but refuses a message of that size or more (`receive_limit` adds the byte), and closes the
socket itself with 1009 and no reason (`SenderSocket`, `SubscriberSocket` give it one).
"""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

import aiohttp
from aiohttp import WSMsgType, web

from replicator.shared import wire
from replicator.workers.counters import Counters

T = TypeVar("T")
BYTES_SENT = "replicator_bytes_sent_total"
BYTES_RECEIVED = "replicator_bytes_received_total"
FRAMES_REFUSED = "replicator_frames_refused_total"

# Keepalive: what an idle session costs, and how soon a frozen peer is seen (within 15 s, tests/integration/
# test_health.py). The subscriber pings once nothing was received for SUBSCRIBER_HEARTBEAT; aiohttp rounds a
# heartbeat above 5 s up to the loop's next whole second, which also makes the pings of a worker's idle sessions fall
# on the same ticks. A ping is due at most 7.5 s after the last frame, its pong within half the heartbeat: a frozen
# sender is seen within 10.75 s. The sending end's heartbeat is longer than the subscriber's longest ping interval,
# so while pings arrive (every frame received puts it off) it sends none: one ping and pong per 7 s or so per idle
# session. A frozen subscriber is seen within 16 s.
SUBSCRIBER_HEARTBEAT = 6.5
SENDER_HEARTBEAT = 10.0


def receive_limit(max_frame_bytes: int) -> int:
    """aiohttp's `max_msg_size` for a limit of `max_frame_bytes` inclusive: aiohttp refuses a message of
    `max_msg_size` bytes or more."""
    return max_frame_bytes + 1


def too_large(limit: int) -> str:
    """The close reason of a session refused for a frame above `limit`."""
    return f"frame too large: at most {limit} bytes (replication.max_frame_bytes)"


class _ReasonsTooLarge:
    """A WebSocket that names its frame limit when it closes with 1009: aiohttp closes a socket whose peer sent a
    message above `max_msg_size` itself, from `receive()`, with 1009 and an empty reason."""

    frame_limit = 0  # the limit the socket was opened with; set before the first receive

    async def close(self, *, code: int = wire.CLOSE_NORMAL, message: bytes = b"", **options: Any) -> bool:
        if code == wire.CLOSE_TOO_BIG and not message and self.frame_limit:
            message = wire.close_reason(too_large(self.frame_limit)).encode()
        closed: bool = await super().close(code=code, message=message, **options)  # type: ignore[misc]
        return closed


class SenderSocket(_ReasonsTooLarge, web.WebSocketResponse):
    """The sending end's WebSocket: `frame_limit` bytes at most per frame received, inclusive, no compression (a
    frame is msgpack already, and a compressed one would cost a decompression before its size is known)."""

    def __init__(self, frame_limit: int, **options: Any) -> None:
        super().__init__(max_msg_size=receive_limit(frame_limit), compress=False, **options)
        self.frame_limit = frame_limit


class SubscriberSocket(_ReasonsTooLarge, aiohttp.ClientWebSocketResponse):
    """The subscribing end's WebSocket (`aiohttp.ClientSession(ws_response_class=...)`); its dial passes
    `receive_limit(...)` as `max_msg_size` and sets `frame_limit` to the same limit."""


class Metered:
    """A session's WebSocket whose replication frames are counted as they pass: the bytes of each binary frame's
    payload (WebSocket and TLS framing not included), as increments of the peer's byte counters. Everything else is
    the socket's own."""

    def __init__(self, ws: Any, counters: Counters, peer: str) -> None:
        self._ws = ws
        self._counters = counters
        self._peer = peer

    async def receive(self) -> Any:
        msg = await self._ws.receive()
        if msg.type == WSMsgType.BINARY:
            limit = getattr(self._ws, "frame_limit", 0)
            if limit and len(msg.data) > limit:  # a socket dialled offering a link takes a link's header more
                self._counters.inc(FRAMES_REFUSED, self._peer)
            else:
                self._counters.inc(BYTES_RECEIVED, self._peer, value=len(msg.data))
        elif msg.type == WSMsgType.ERROR and getattr(msg.data, "code", None) == wire.CLOSE_TOO_BIG:
            self._counters.inc(FRAMES_REFUSED, self._peer)
        return msg

    async def send_bytes(self, data: bytes) -> None:
        await self._ws.send_bytes(data)
        self._counters.inc(BYTES_SENT, self._peer, value=len(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ws, name)


async def receive(ws: Any, timeout: float | None = None) -> wire.Message:
    try:
        # asyncio.timeout, never wait_for, anywhere a task may be cancelled: on Python 3.11 wait_for drops a
        # cancellation that lands as what it waits for completes, and the task runs on (a session that never ends).
        async with asyncio.timeout(timeout):
            msg = await ws.receive()
    except TimeoutError:
        raise wire.PeerClosed(f"no frame from the peer in {timeout:g} s", wire.CLOSE_GOING_AWAY) from None
    if msg.type == WSMsgType.BINARY:
        limit = getattr(ws, "frame_limit", 0)
        if limit and len(msg.data) > limit:
            # aiohttp enforces the limit it was given; a socket dialled offering a link (workers.link) was given a
            # link frame's header more, and a peer that answered per pair is held to the limit here.
            raise wire.ProtocolViolation(too_large(limit), wire.CLOSE_TOO_BIG)
        return wire.decode(msg.data)
    if msg.type == WSMsgType.TEXT:
        raise wire.MalformedFrame("text frames are not part of replicator.v1", unknown_type=True)
    if msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
        code = msg.data if isinstance(msg.data, int) and msg.data else ws.close_code or wire.CLOSE_GOING_AWAY
        extra = f": {msg.extra}" if isinstance(msg.extra, str) and msg.extra else ""
        raise wire.PeerClosed(f"closed by the peer ({code}{extra})", code)
    if msg.type == WSMsgType.ERROR:
        # The error is the message's data; `exception()` holds only errors that were not the peer's input, and the
        # close code is the one aiohttp's own close ended with (1006 once it had closed the socket).
        exc = msg.data if isinstance(msg.data, BaseException) else ws.exception()
        code = getattr(exc, "code", None) or ws.close_code or wire.CLOSE_INTERNAL
        if code == wire.CLOSE_TOO_BIG:
            limit = getattr(ws, "frame_limit", 0)
            raise wire.ProtocolViolation(too_large(limit) if limit else f"frame too large: {exc}", wire.CLOSE_TOO_BIG)
        raise wire.PeerClosed(f"connection broken: {exc}", code)
    raise wire.ProtocolViolation(f"unexpected WebSocket message {msg.type!r}")


async def expect(ws: Any, kind: type[T], timeout: float | None = None) -> T:
    message = await receive(ws, timeout)
    if not isinstance(message, kind):
        raise wire.ProtocolViolation(f"expected {kind.__name__}, got {type(message).__name__}")
    return message


async def send(ws: Any, message: wire.Message, limit: int = 0) -> None:
    """Send one frame; `limit`: the largest frame the peer takes (its Hello's `max_frame`; 0 when it did not say)."""
    data = wire.encode(message)
    if limit and len(data) > limit:
        raise wire.Refused(
            f"a {type(message).__name__} frame of {len(data)} bytes does not fit the peer's frame limit ({limit}"
            " bytes): raise its replication.max_frame_bytes",
            wire.CLOSE_TOO_BIG,
        )
    try:
        await ws.send_bytes(data)
    except (ConnectionError, RuntimeError) as exc:
        # aiohttp raises ConnectionResetError or RuntimeError once the transport is closing.
        raise wire.PeerClosed(f"send failed: {exc}", wire.CLOSE_GOING_AWAY) from None


async def close(ws: Any, code: int, reason: str) -> None:
    if ws.closed:
        return
    try:
        async with asyncio.timeout(5.0):  # not wait_for: see receive
            await ws.close(code=code, message=wire.close_reason(reason).encode())
    except (TimeoutError, ConnectionError, RuntimeError):
        pass
