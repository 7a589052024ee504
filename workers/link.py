"""One TLS WebSocket per (peer, worker) carrying a stream for every database placed there (issue 23).

A link is a WebSocket of subprotocol `replicator.link.v1`. Each of its binary messages is one link frame: a header
of 5 bytes, the kind (u8) and the stream id (u32, big-endian), then the payload.

    OPEN    dialling end -> answering end: a new stream, the dialling end's credit for it (u32). Stream ids are the
            dialling end's, each above the one before.
    DATA    one replication frame of the stream: what a per-pair socket carries as one message.
    CLOSE   the stream ends: a close code (u16) and a UTF-8 reason. The other end sends nothing more on it.
    CREDIT  the sender may send this many more bytes of DATA on the stream (u32): its receiver took them out of its
            buffer. The answering end grants its first credit with the CREDIT that accepts an OPEN.

Each stream has its own flow control, as HTTP/2's: an end sends DATA only within the credit its peer granted, and
grants at most its own frame limit (`replication.max_frame_bytes`) ahead, so one frame of any size the protocol
allows fits, and a stream whose consumer is slow (a large apply, a full disk) holds up only itself. What a peer
makes this end buffer is bounded: at most the credit per stream, and at most MAX_STREAMS streams per link. A DATA
past its credit, a frame of an unknown kind, or an OPEN from the answering end ends the whole link (1008 or 1002):
that peer broke the protocol. So does a DATA above the frame limit (aiohttp refuses the message, 1009): each
stream's session then reads the error a socket of its own would have, "frame too large" naming the limit.

A `Stream` has the part of aiohttp's WebSocket interface the sessions use (`receive`, `send_bytes`, `close`,
`closed`, `close_code`, `exception`, `get_extra_info`, `frame_limit`), so `workers.frames`, the sender and the
subscribing session run on a stream exactly as on a socket of their own.
"""

from __future__ import annotations

import asyncio
import functools
import struct
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import WSMessage, WSMsgType

from replicator.shared import wire

SUBPROTOCOL = "replicator.link.v1"
HEADER = struct.Struct(">BI")
OPEN, DATA, CLOSE, CREDIT = 1, 2, 3, 4
_CODE = struct.Struct(">H")
_COUNT = struct.Struct(">I")
MAX_STREAMS = 4096  # open at once on one link: a peer holds at most this many of this node's streams
MAX_STREAM_ID = 2**32 - 1


class LinkViolation(Exception):
    """The peer broke the link protocol: the link ends with `code`."""

    def __init__(self, reason: str, code: int = wire.CLOSE_POLICY) -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code


def frame(kind: int, stream: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(kind, stream) + payload


def close_payload(code: int, reason: str) -> bytes:
    return _CODE.pack(code) + wire.close_reason(reason).encode()


def parse(data: bytes) -> tuple[int, int, bytes]:
    """(kind, stream id, payload) of a link frame; LinkViolation when it is not one."""
    if len(data) < HEADER.size:
        raise LinkViolation(f"a link frame of {len(data)} bytes is shorter than its header", wire.CLOSE_MALFORMED)
    kind, stream = HEADER.unpack_from(data)
    if kind not in (OPEN, DATA, CLOSE, CREDIT):
        raise LinkViolation(f"unknown link frame kind {kind}", wire.CLOSE_MALFORMED)
    payload = data[HEADER.size :]
    if kind in (OPEN, CREDIT) and len(payload) != _COUNT.size:
        raise LinkViolation(f"a link frame of kind {kind} carries {len(payload)} bytes, not 4", wire.CLOSE_MALFORMED)
    if kind == CLOSE and len(payload) < _CODE.size:
        raise LinkViolation("a CLOSE link frame without a close code", wire.CLOSE_MALFORMED)
    return kind, stream, payload


def receive_limit(frame_limit: int) -> int:
    """aiohttp's `max_msg_size` for a link whose replication frames are at most `frame_limit` bytes: the header
    on top, and the byte aiohttp's refusal of a message of exactly `max_msg_size` takes."""
    return frame_limit + HEADER.size + 1


class Stream:
    """One database's stream on a link: a WebSocket for the session that runs on it."""

    def __init__(self, link: Link, stream_id: int, credit: int) -> None:
        self._link = link
        self.id = stream_id
        self.frame_limit = link.frame_limit
        self._inbox: deque[WSMessage] = deque()
        self._arrived = asyncio.Event()
        self._granted = link.frame_limit  # what the peer may still send before this end grants more
        self._taken = 0  # bytes taken out of the inbox since the last grant
        self._credit = credit  # what this end may still send
        self._credit_changed = asyncio.Event()
        self.closed = False
        self.close_code: int | None = None
        self._ended = False  # the peer's CLOSE or the link's end arrived
        self.opening: asyncio.Task[None] | None = None  # the send of its OPEN (the dialling end's streams)

    # -- the WebSocket interface ---------------------------------------------------------------------

    async def receive(self) -> WSMessage:
        while not self._inbox:
            self._arrived.clear()
            await self._arrived.wait()
        message = self._inbox.popleft()
        if message.type == WSMsgType.BINARY:
            self._taken += len(message.data)
            if self._taken >= self.frame_limit // 2 or not self._inbox:
                taken, self._taken = self._taken, 0
                self._granted += taken
                await self._link.send(frame(CREDIT, self.id, _COUNT.pack(taken)), quiet=True)
        return message

    async def send_bytes(self, data: bytes) -> None:
        while True:
            if self.closed or self._ended:
                raise ConnectionResetError(f"stream {self.id} of the link to {self._link.peer} is closed")
            if len(data) <= self._credit:
                break
            self._credit_changed.clear()
            await self._credit_changed.wait()
        self._credit -= len(data)
        await self._link.send(frame(DATA, self.id, data))

    async def close(self, *, code: int = wire.CLOSE_NORMAL, message: bytes = b"", **_: Any) -> bool:
        if self.closed:
            return False
        self.closed = True
        self.close_code = code
        # As on a socket closed from this end: a receive waiting (a sender's, for the next ack) reads CLOSED and a
        # send waiting for credit fails, so the session ends now, not when the peer answers.
        self._deliver(WSMessage(WSMsgType.CLOSED, None, None))
        self._credit_changed.set()
        if not self._ended:
            if self.opening is not None:
                # A stream closed as soon as it was opened: its OPEN is still queued, and a CLOSE before it would be
                # a frame for a stream never opened, which ends the whole link and every other stream on it.
                await self.opening
            reason = message.decode(errors="replace")
            await self._link.send(frame(CLOSE, self.id, close_payload(code, reason)), quiet=True)
        self._link.forget(self)
        return True

    def exception(self) -> BaseException | None:
        return self._link.ws.exception()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "ssl_object" and self._link.ssl_object is not None:
            return self._link.ssl_object
        return self._link.ws.get_extra_info(name, default)

    # -- what the link delivers ----------------------------------------------------------------------

    def _deliver(self, message: WSMessage) -> None:
        self._inbox.append(message)
        self._arrived.set()

    def _data(self, payload: bytes) -> None:
        if len(payload) > self.frame_limit:
            error = aiohttp.WebSocketError(wire.CLOSE_TOO_BIG, f"message of {len(payload)} bytes")
            self._deliver(WSMessage(WSMsgType.ERROR, error, None))
            return
        if len(payload) > self._granted:
            raise LinkViolation(f"stream {self.id} sent {len(payload)} bytes with {self._granted} of credit left")
        self._granted -= len(payload)
        self._deliver(WSMessage(WSMsgType.BINARY, payload, None))

    def _grant(self, count: int) -> None:
        self._credit += count
        if self._credit > 2**32:
            raise LinkViolation(f"stream {self.id} was granted {self._credit} bytes of credit, above 2^32")
        self._credit_changed.set()

    def _end(self, code: int, reason: str, error: BaseException | None = None) -> None:
        """The peer closed the stream, or the link ended (broken by `error`): what the session reads next is that
        close, or that error (a frame too large for the link names the limit, as on a socket of its own)."""
        if self._ended:
            return
        self._ended = True
        if self.close_code is None:
            self.close_code = code
        ending = WSMessage(WSMsgType.CLOSE, code, reason) if error is None else WSMessage(WSMsgType.ERROR, error, None)
        self._deliver(ending)
        self._credit_changed.set()


class Link:
    """A WebSocket of `SUBPROTOCOL` and its streams: `run()` reads it until it ends. The dialling end opens streams
    (`open_stream`); the answering end is given each one the peer opens (`on_open`)."""

    def __init__(
        self,
        ws: Any,
        *,
        peer: str,
        frame_limit: int,
        dialled: bool,
        on_open: Callable[[Stream], None] | None = None,
        on_idle: Callable[[Link], None] | None = None,
    ) -> None:
        self.ws = ws
        self.peer = peer
        self.frame_limit = frame_limit
        self.dialled = dialled
        # The TLS session of the link, read once: its peer's certificate is the same for the link's life, and once
        # the socket has closed the transport no longer gives it. A stream opened as the link ends must still know
        # whom it speaks to, or its session reads "no node name" as a refusal and redials on the growing backoff
        # instead of after a lost connection.
        self.ssl_object: Any = ws.get_extra_info("ssl_object")
        self._on_open = on_open
        self._on_idle = on_idle
        self.streams: dict[int, Stream] = {}
        self._last_id = 0  # the highest stream id opened so far, by either end's count
        self._sending = asyncio.Lock()
        self.closed = False
        self.opened = 0  # streams opened over the link's life
        self.key = ""  # the coordinator's connection key of a dialled link
        self.dial_started = 0.0  # when its dial began (wall clock): the ladder spaces these

    @property
    def alive(self) -> bool:
        return not self.closed and not self.ws.closed

    def open_stream(self) -> Stream:
        """A new stream (the dialling end only). Its OPEN goes out before any other frame of it: a DATA waits for the
        credit the answer to the OPEN grants, and a CLOSE for the OPEN's send (`Stream.opening`)."""
        if not self.alive:
            raise ConnectionResetError(f"the link to {self.peer} is closed")
        if len(self.streams) >= MAX_STREAMS:
            raise ConnectionResetError(f"the link to {self.peer} carries {MAX_STREAMS} streams, its most")
        self._last_id += 1
        stream = Stream(self, self._last_id, credit=0)
        self.streams[stream.id] = stream
        self.opened += 1
        stream.opening = self.send_nowait(frame(OPEN, stream.id, _COUNT.pack(self.frame_limit)))
        return stream

    def send_nowait(self, data: bytes) -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(self.send(data, quiet=True))

    async def send(self, data: bytes, *, quiet: bool = False) -> None:
        """One link frame; `quiet`: a failure (the link is ending) is not the caller's."""
        try:
            async with self._sending:
                await self.ws.send_bytes(data)
        except (ConnectionError, RuntimeError):
            if not quiet:
                raise ConnectionResetError(f"the link to {self.peer} is closed") from None

    def forget(self, stream: Stream) -> None:
        if self.streams.get(stream.id) is stream:
            del self.streams[stream.id]
            if not self.streams and self._on_idle is not None and self.alive:
                self._on_idle(self)

    async def close(self, code: int, reason: str) -> None:
        """End the link and every stream on it."""
        self._end_streams(code, reason)
        self.closed = True
        if not self.ws.closed:
            try:
                async with asyncio.timeout(5.0):
                    await self.ws.close(code=code, message=wire.close_reason(reason).encode())
            except (TimeoutError, ConnectionError, RuntimeError):
                pass

    def _end_streams(self, code: int, reason: str, error: BaseException | None = None) -> None:
        for stream in list(self.streams.values()):
            stream._end(code, reason, error)
        self.streams.clear()

    async def run(self) -> tuple[int, str]:
        """Read the link until it ends; every stream then reads the link's close. Returns (code, reason)."""
        code, reason = wire.CLOSE_GOING_AWAY, "link closed"
        error: BaseException | None = None
        try:
            while True:
                message = await self.ws.receive()
                if message.type != WSMsgType.BINARY:
                    code, reason = self._ending(message)
                    error = message.data if message.type == WSMsgType.ERROR else None
                    break
                self._take(message.data)
        except LinkViolation as exc:
            code, reason = exc.code, f"link protocol: {exc.reason}"
            await self.close(code, reason)
        finally:
            self._end_streams(code, reason, error if isinstance(error, BaseException) else None)
            self.closed = True
        return code, reason

    def _ending(self, message: WSMessage) -> tuple[int, str]:
        if message.type == WSMsgType.TEXT:
            raise LinkViolation("text frames are not part of the link protocol", wire.CLOSE_UNSUPPORTED)
        if message.type == WSMsgType.ERROR:
            error = message.data
            return getattr(error, "code", None) or self.ws.close_code or wire.CLOSE_INTERNAL, f"link broken: {error}"
        code = message.data if isinstance(message.data, int) and message.data else self.ws.close_code
        extra = message.extra if isinstance(message.extra, str) else ""
        return code or wire.CLOSE_GOING_AWAY, extra or "link closed by the peer"

    def _take(self, data: bytes) -> None:
        kind, stream_id, payload = parse(data)
        if kind == OPEN:
            self._opened_by_peer(stream_id, _COUNT.unpack(payload)[0])
            return
        stream = self.streams.get(stream_id)
        if stream is None:
            if stream_id > self._last_id:
                raise LinkViolation(f"a frame for stream {stream_id}, which was never opened")
            return  # a stream this end closed a moment ago: what was on its way is dropped
        if kind == DATA:
            stream._data(payload)
        elif kind == CREDIT:
            stream._grant(_COUNT.unpack(payload)[0])
        else:
            (code,) = _CODE.unpack_from(payload)
            del self.streams[stream_id]
            stream._end(code, payload[_CODE.size :].decode(errors="replace"))
            if not self.streams and self._on_idle is not None and self.alive:
                self._on_idle(self)

    def _opened_by_peer(self, stream_id: int, credit: int) -> None:
        if self.dialled or self._on_open is None:
            raise LinkViolation("an OPEN from the answering end of a link")
        if stream_id <= self._last_id:
            raise LinkViolation(f"stream {stream_id} opened after stream {self._last_id}")
        self._last_id = stream_id
        if len(self.streams) >= MAX_STREAMS:
            reason = f"a link carries at most {MAX_STREAMS} streams"
            self.send_nowait(frame(CLOSE, stream_id, close_payload(wire.CLOSE_POLICY, reason)))
            return
        stream = Stream(self, stream_id, credit=credit)
        self.streams[stream_id] = stream
        self.opened += 1
        self.send_nowait(frame(CREDIT, stream_id, _COUNT.pack(self.frame_limit)))
        self._on_open(stream)


IDLE_GRACE = 5.0  # a dialled link without streams stays open this long, for the next database to take
PLAIN_MEMORY = 60.0


class LinkPool:
    """A worker's dialled links, one per peer URL: `open(...)` gives a stream on the live link, on the dial in
    flight (concurrent subscriptions share one TLS handshake), or on a new one. A peer of the release before
    (protocol 2) answers a link dial with `wire.SUBPROTOCOL`: that socket is then the one subscription's own, as
    before. `report(link, up)` is told when a link opens and ends (the coordinator's ladder spaces TLS handshakes,
    not streams)."""

    def __init__(
        self,
        dial: Callable[[str], Awaitable[Any]],
        *,
        frame_limit: int,
        report: Callable[[Link, bool], None],
        idle_grace: float = IDLE_GRACE,
    ) -> None:
        self._dial = dial  # url -> a WebSocket, dialled offering SUBPROTOCOL first
        self._frame_limit = frame_limit
        self._report = report
        self._idle_grace = idle_grace
        self._links: dict[str, Link] = {}
        self._dialling: dict[str, asyncio.Task[Any]] = {}
        self._readers: set[asyncio.Task[Any]] = set()
        self._idle: dict[str, asyncio.TimerHandle] = {}
        # URLs whose peer answered a link dial with a per-pair socket, and when: dialled per pair for PLAIN_MEMORY,
        # then offered a link again (the peer may have been upgraded meanwhile).
        self._plain: dict[str, float] = {}
        self._unclaimed: dict[asyncio.Task[Any], Any] = {}

    def links(self) -> list[Link]:
        return [link for link in self._links.values() if link.alive]

    def live(self, url: str) -> bool:
        """Whether a stream to `url` would go over a live link now, without a dial."""
        link = self._links.get(url)
        return link is not None and link.alive

    async def open(self, peer: str, key: str, url: str) -> Any:
        """A stream to `url`, or, to a peer that speaks no links, a socket of its own."""
        while True:
            link = self._links.get(url)
            if link is not None and link.alive:
                self._keep(url)
                return link.open_stream()
            loop = asyncio.get_running_loop()
            if loop.time() - self._plain.get(url, -PLAIN_MEMORY) < PLAIN_MEMORY:
                return await self._dial(url)
            dial = self._dialling.get(url)
            if dial is None:
                dial = asyncio.get_running_loop().create_task(self._connect(peer, key, url))
                self._dialling[url] = dial
                dial.add_done_callback(functools.partial(self._dialled, url))
            ws = await asyncio.shield(dial)
            if ws is not None and self._unclaimed.pop(dial, None) is ws:
                return ws  # the first waiter on a dial answered without a link takes its socket
            # the link is registered (take a stream on it next), or it ended already, or another waiter took the
            # plain socket: go round again

    async def _connect(self, peer: str, key: str, url: str) -> Any:
        """Dial `url`; a link's reader starts here, whether or not anyone still waits for it. Returns the socket
        when the peer answered without a link (`_unclaimed`), else None."""
        started = time.time()
        ws = await self._dial(url)
        if getattr(ws, "protocol", None) == SUBPROTOCOL:  # the client socket's chosen subprotocol
            self._start(peer, key, url, ws).dial_started = started
            return None
        self._plain[url] = asyncio.get_running_loop().time()
        return ws

    def _dialled(self, url: str, dial: asyncio.Task[Any]) -> None:
        if self._dialling.get(url) is dial:
            del self._dialling[url]
        if dial.cancelled() or dial.exception() is not None or dial.result() is None:
            return
        self._unclaimed[dial] = dial.result()
        # Every waiter's wakeup is queued before this runs (a timer runs after the ready callbacks): a socket that
        # no waiter took (each was cancelled) is closed, not left open.
        asyncio.get_running_loop().call_later(0, self._close_unclaimed, dial)

    def _close_unclaimed(self, dial: asyncio.Task[Any]) -> None:
        ws = self._unclaimed.pop(dial, None)
        if ws is not None:
            asyncio.get_running_loop().create_task(ws.close(code=wire.CLOSE_GOING_AWAY, message=b"unsubscribed"))

    def _start(self, peer: str, key: str, url: str, ws: Any) -> Link:
        link = Link(ws, peer=peer, frame_limit=self._frame_limit, dialled=True, on_idle=lambda _: self._idle_soon(url))
        self._links[url] = link
        link.key = key
        loop = asyncio.get_running_loop()
        loop.call_soon(self._report, link, True)  # once its dial_started is set
        reader = asyncio.get_running_loop().create_task(self._read(peer, key, url, link))
        self._readers.add(reader)
        reader.add_done_callback(self._readers.discard)
        return link

    async def _read(self, peer: str, key: str, url: str, link: Link) -> None:
        try:
            await link.run()
        finally:
            if self._links.get(url) is link:
                del self._links[url]
                self._keep(url)
            self._report(link, False)

    def _idle_soon(self, url: str) -> None:
        self._keep(url)
        loop = asyncio.get_running_loop()
        self._idle[url] = loop.call_later(self._idle_grace, self._close_idle, url)

    def _keep(self, url: str) -> None:
        handle = self._idle.pop(url, None)
        if handle is not None:
            handle.cancel()

    def _close_idle(self, url: str) -> None:
        self._idle.pop(url, None)
        link = self._links.get(url)
        if link is not None and not link.streams:
            asyncio.get_running_loop().create_task(link.close(wire.CLOSE_NORMAL, "no stream left on the link"))

    async def close_where(self, reason_of: Callable[[Link], str | None], code: int = wire.CLOSE_POLICY) -> int:
        """Close every link for which `reason_of` gives a reason (a revoked certificate); returns how many."""
        closing = [(link, reason) for link in self.links() if (reason := reason_of(link)) is not None]
        await asyncio.gather(*(link.close(code, reason) for link, reason in closing), return_exceptions=True)
        return len(closing)

    async def close(self, code: int = wire.CLOSE_GOING_AWAY, reason: str = "node shutting down") -> None:
        for handle in self._idle.values():
            handle.cancel()
        self._idle.clear()
        for dial in self._dialling.values():
            dial.cancel()
        await asyncio.gather(*(link.close(code, reason) for link in self.links()), return_exceptions=True)
        await asyncio.gather(*self._readers, return_exceptions=True)
