"""Reading and writing replication frames on a WebSocket, for both ends of a session.

aiohttp's client and server WebSockets share `receive()`, `send_bytes()` and `close()`; this module turns what
they report into the protocol's exceptions, split by cause: the peer closed or broke the link (`PeerClosed`), the
peer sent something we do not accept (`MalformedFrame`, `ProtocolViolation`). A `Metered` socket counts the bytes
of the frames that pass, per peer, for `replicator_bytes_sent_total` and `replicator_bytes_received_total`.
"""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

from aiohttp import WSMsgType

from replicator.shared import wire
from replicator.workers.counters import Counters

T = TypeVar("T")
BYTES_SENT = "replicator_bytes_sent_total"
BYTES_RECEIVED = "replicator_bytes_received_total"

# Keepalive: what an idle session costs, and how soon a frozen peer is seen (within 15 s, tests/integration/
# test_health.py). The subscriber pings once nothing was received for SUBSCRIBER_HEARTBEAT; aiohttp rounds a
# heartbeat above 5 s up to the loop's next whole second, which also makes the pings of a worker's idle sessions fall
# on the same ticks. A ping is due at most 7.5 s after the last frame, its pong within half the heartbeat: a frozen
# sender is seen within 10.75 s. The sending end's heartbeat is longer than the subscriber's longest ping interval,
# so while pings arrive (every frame received puts it off) it sends none: one ping and pong per 7 s or so per idle
# session. A frozen subscriber is seen within 16 s.
SUBSCRIBER_HEARTBEAT = 6.5
SENDER_HEARTBEAT = 10.0


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
            self._counters.inc(BYTES_RECEIVED, self._peer, value=len(msg.data))
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
        return wire.decode(msg.data)
    if msg.type == WSMsgType.TEXT:
        raise wire.MalformedFrame("text frames are not part of replicator.v1", unknown_type=True)
    if msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
        code = msg.data if isinstance(msg.data, int) and msg.data else ws.close_code or wire.CLOSE_GOING_AWAY
        extra = f": {msg.extra}" if isinstance(msg.extra, str) and msg.extra else ""
        raise wire.PeerClosed(f"closed by the peer ({code}{extra})", code)
    if msg.type == WSMsgType.ERROR:
        exc = ws.exception()
        code = getattr(exc, "code", None) or ws.close_code or wire.CLOSE_INTERNAL
        if code == wire.CLOSE_TOO_BIG:
            raise wire.ProtocolViolation(f"frame too large: {exc}", wire.CLOSE_TOO_BIG)
        raise wire.PeerClosed(f"connection broken: {exc}", code)
    raise wire.ProtocolViolation(f"unexpected WebSocket message {msg.type!r}")


async def expect(ws: Any, kind: type[T], timeout: float | None = None) -> T:
    message = await receive(ws, timeout)
    if not isinstance(message, kind):
        raise wire.ProtocolViolation(f"expected {kind.__name__}, got {type(message).__name__}")
    return message


async def send(ws: Any, message: wire.Message) -> None:
    try:
        await ws.send_bytes(wire.encode(message))
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
