"""workers.link: streams multiplexed over one WebSocket, with credit per stream, on a real loopback socket."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import WSMsgType, web

from replicator.shared import wire
from replicator.workers import frames, link

LIMIT = 64 * 1024
WAIT = 5.0  # the most a test waits for what it expects to happen


async def within(what: str, waiting: Awaitable[Any]) -> None:
    """Await `waiting`; the test fails naming `what` when it has not happened within WAIT."""
    try:
        async with asyncio.timeout(WAIT):
            await waiting
    except TimeoutError:
        pytest.fail(f"{what}: not within {WAIT:g} s")


async def until(holds: Callable[[], bool]) -> None:
    """Return once `holds()` does, looking again at each turn of the loop (bound it with `within`)."""
    while not holds():  # noqa: ASYNC110 - what is looked at has no event to wait on
        await asyncio.sleep(0)


def waiting(task: asyncio.Task[Any]) -> bool:
    """The task has started and waits on something (its coroutine is suspended)."""
    return inspect.getcoroutinestate(task.get_coro()) == inspect.CORO_SUSPENDED


class Peer:
    """An answering end: every stream opened is echoed by `serve`, until its peer closes it."""

    def __init__(self, serve: Callable[[link.Stream], Any]) -> None:
        self.serve = serve
        self.links: list[link.Link] = []
        self.served: list[asyncio.Task[Any]] = []
        self._opened = asyncio.Event()

    def _open(self, stream: link.Stream) -> None:
        self.served.append(asyncio.get_running_loop().create_task(self.serve(stream)))
        self._opened.set()

    async def serving(self, count: int) -> None:
        """Return once `count` streams have been opened to this end (their OPEN has arrived)."""
        while len(self.served) < count:
            self._opened.clear()
            await self._opened.wait()

    async def handler(self, request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse(protocols=[link.SUBPROTOCOL], max_msg_size=link.receive_limit(LIMIT))
        await ws.prepare(request)
        answered = link.Link(
            ws,
            peer="client",
            frame_limit=LIMIT,
            dialled=False,
            on_open=self._open,
        )
        self.links.append(answered)
        await answered.run()
        return ws


class Reports(list[tuple[bool, int]]):
    """A pool's `report` callback: what it reported, in order, as (up, streams the link had opened)."""

    def __init__(self) -> None:
        super().__init__()
        self._changed = asyncio.Event()

    def __call__(self, dialled: link.Link, up: bool) -> None:
        self.append((up, dialled.opened))
        self._changed.set()

    async def count(self, count: int) -> None:
        """Return once `count` reports have come."""
        while len(self) < count:
            self._changed.clear()
            await self._changed.wait()


async def echo(stream: link.Stream) -> None:
    while True:
        message = await stream.receive()
        if message.type != WSMsgType.BINARY:
            return
        await stream.send_bytes(message.data)


@pytest.fixture
async def served() -> AsyncIterator[Callable[[Callable[[link.Stream], Any]], Any]]:
    runners: list[web.AppRunner] = []
    sessions: list[aiohttp.ClientSession] = []

    async def start(serve: Callable[[link.Stream], Any]) -> tuple[Peer, link.LinkPool, Reports]:
        peer = Peer(serve)
        app = web.Application()
        app.router.add_get("/replication", peer.handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        http = aiohttp.ClientSession()
        sessions.append(http)
        reports = Reports()

        async def dial(url: str) -> Any:
            return await http.ws_connect(
                url, protocols=[link.SUBPROTOCOL, wire.SUBPROTOCOL], max_msg_size=link.receive_limit(LIMIT)
            )

        pool = link.LinkPool(dial, frame_limit=LIMIT, report=reports, idle_grace=0.2)
        pool.url = f"http://127.0.0.1:{port}/replication"  # type: ignore[attr-defined]
        return peer, pool, reports

    yield start
    for http in sessions:
        await http.close()
    for runner in runners:
        await runner.cleanup()


async def test_many_streams_share_one_dial_and_each_echoes_its_own_frames(served: Any) -> None:
    peer, pool, reports = await served(echo)
    streams = await asyncio.gather(*(pool.open("b", "k", pool.url) for _ in range(20)))
    assert len(peer.links) == 1 and reports == [(True, 0)]
    for index, stream in enumerate(streams):
        await frames.send(stream, wire.Ack(seq=index))
    for index, stream in enumerate(streams):
        assert await frames.receive(stream, 5) == wire.Ack(seq=index)
    await asyncio.gather(*(frames.close(s, wire.CLOSE_NORMAL, "done") for s in streams))
    await pool.close()


async def hold(stream: link.Stream) -> None:
    """Never reads: what its peer sends waits in its inbox, within the credit it granted."""
    await asyncio.Event().wait()


async def test_a_stream_closed_as_soon_as_it_is_opened_leaves_the_link_and_its_other_streams_alone(served: Any) -> None:
    peer, pool, reports = await served(echo)
    other = await pool.open("b", "k", pool.url)
    await frames.send(other, wire.Ack(seq=1))
    assert await frames.receive(other, 5) == wire.Ack(seq=1)
    brief = await pool.open("b", "k", pool.url)
    # Closed before its OPEN has gone out (an unsubscribe right after a subscribe): the CLOSE follows the OPEN.
    await frames.close(brief, wire.CLOSE_NORMAL, "unsubscribed")
    await within("the brief stream served and ended at the answering end", peer.serving(2))
    await within("the brief stream's serving task", asyncio.wait({peer.served[1]}))
    await frames.send(other, wire.Ack(seq=2))
    assert await frames.receive(other, 5) == wire.Ack(seq=2)
    assert len(peer.links) == 1 and peer.links[0].alive and reports == [(True, 0)]
    await pool.close()


async def test_a_stream_whose_reader_stalls_holds_up_only_itself(served: Any) -> None:
    stalled_end: list[link.Stream] = []

    async def serve(stream: link.Stream) -> None:
        if not stalled_end:
            stalled_end.append(stream)
            await hold(stream)
        else:
            await echo(stream)

    _, pool, _ = await served(serve)
    slow = await pool.open("b", "k", pool.url)
    fast = await pool.open("b", "k", pool.url)
    chunk = b"x" * (LIMIT // 4)
    for _ in range(4):  # the whole credit the answering end granted
        await asyncio.wait_for(slow.send_bytes(chunk), 5)
    blocked = asyncio.get_running_loop().create_task(slow.send_bytes(chunk))
    for index in range(50):  # the other stream goes on meanwhile
        await frames.send(fast, wire.Ack(seq=index))
        assert await frames.receive(fast, 5) == wire.Ack(seq=index)
    assert not blocked.done()
    (stalled,) = stalled_end
    assert sum(len(m.data) for m in stalled._inbox) == LIMIT  # buffered: exactly the credit, no more
    await stalled.receive()  # a quarter of the window taken: kept, to be granted with more
    # One round trip on the same link: a CREDIT the answering end sent before its echo has arrived by now.
    await frames.send(fast, wire.Ack(seq=50))
    assert await frames.receive(fast, 5) == wire.Ack(seq=50)
    assert not blocked.done()
    await stalled.receive()  # half of it: granted back, and the blocked send goes out
    await asyncio.wait_for(blocked, 5)
    blocked.result()
    await pool.close()


async def test_data_past_the_credit_granted_ends_the_link_as_a_protocol_violation(served: Any) -> None:
    _, pool, _ = await served(hold)
    stream = await pool.open("b", "k", pool.url)
    await asyncio.wait_for(stream.send_bytes(b"x" * LIMIT), 5)
    stream._credit += 1  # a peer that ignores its credit
    await stream.send_bytes(b"y")
    message = await asyncio.wait_for(stream.receive(), 5)
    assert message.type == WSMsgType.CLOSE and message.data == wire.CLOSE_POLICY
    assert "credit" in message.extra
    await pool.close()


async def test_a_frame_above_the_limit_ends_the_link_and_each_session_reads_frame_too_large(served: Any) -> None:
    peer, pool, _ = await served(echo)
    big = await pool.open("b", "k", pool.url)
    other = await pool.open("b", "k", pool.url)
    await frames.send(other, wire.Ack(seq=1))
    assert await frames.receive(other, 5) == wire.Ack(seq=1)
    await peer.links[0].send(link.frame(link.DATA, big.id, b"z" * LIMIT))  # exactly the limit: passes
    assert len((await big.receive()).data) == LIMIT
    await peer.links[0].send(link.frame(link.DATA, big.id, b"z" * (LIMIT + 1)))
    for stream in (big, other):
        with pytest.raises(wire.ProtocolViolation, match=f"frame too large: at most {LIMIT} bytes"):
            await frames.receive(stream, 5)
    await pool.close()


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"\x02\x00", "shorter than its header"),
        (b"\x09\x00\x00\x00\x01", "unknown link frame kind 9"),
        (link.frame(link.CREDIT, 1, b"\x00"), "carries 1 bytes, not 4"),
        (link.frame(link.CLOSE, 1, b""), "without a close code"),
    ],
)
def test_a_malformed_link_frame_is_named(data: bytes, expected: str) -> None:
    with pytest.raises(link.LinkViolation, match=expected):
        link.parse(data)


async def test_an_open_from_the_answering_end_or_a_frame_for_a_stream_never_opened_ends_the_link(served: Any) -> None:
    for bad in (link.frame(link.OPEN, 7, b"\x00\x00\x01\x00"), link.frame(link.DATA, 99, b"x")):
        peer, pool, _ = await served(hold)
        stream = await pool.open("b", "k", pool.url)
        await within("the stream's OPEN at the answering end", peer.serving(1))
        await peer.links[0].send(bad)
        message = await asyncio.wait_for(stream.receive(), 5)
        assert message.type == WSMsgType.CLOSE and message.data == wire.CLOSE_POLICY
        await pool.close()


async def test_a_link_without_streams_closes_after_its_grace_and_the_next_stream_dials_again(served: Any) -> None:
    peer, pool, reports = await served(echo)
    stream = await pool.open("b", "k", pool.url)
    # Each stream's OPEN arrives before its CLOSE is sent: a CLOSE that overtook it would end the link at once.
    await within("the stream's OPEN at the answering end", peer.serving(1))
    await frames.close(stream, wire.CLOSE_NORMAL, "done")
    reopened = await pool.open("b", "k", pool.url)  # within the grace: the same link
    assert len(peer.links) == 1
    await within("the second stream's OPEN at the answering end", peer.serving(2))
    await frames.close(reopened, wire.CLOSE_NORMAL, "done")
    await within("the idle link's end reported", reports.count(2))
    assert not pool.links()
    assert reports == [(True, 0), (False, 2)]
    again = await pool.open("b", "k", pool.url)
    assert len(peer.links) == 2
    await frames.send(again, wire.Ack(seq=3))
    assert await frames.receive(again, 5) == wire.Ack(seq=3)
    await pool.close()


async def test_closing_a_link_ends_every_stream_on_it(served: Any) -> None:
    _, pool, _ = await served(hold)
    streams = [await pool.open("b", "k", pool.url) for _ in range(5)]
    closed = await pool.close_where(lambda _: "the server's certificate is revoked")
    assert closed == 1
    for stream in streams:
        with pytest.raises(wire.PeerClosed, match="revoked"):
            await frames.receive(stream, 5)


async def test_a_peer_that_answers_without_a_link_gives_each_subscription_a_socket_of_its_own() -> None:
    sockets: list[web.WebSocketResponse] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse(protocols=[wire.SUBPROTOCOL])  # the release before: no links
        await ws.prepare(request)
        sockets.append(ws)
        async for message in ws:
            await ws.send_bytes(message.data)
        return ws

    app = web.Application()
    app.router.add_get("/replication", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    url = f"http://127.0.0.1:{port}/replication"
    async with aiohttp.ClientSession() as http:

        async def dial(url: str) -> Any:
            return await http.ws_connect(url, protocols=[link.SUBPROTOCOL, wire.SUBPROTOCOL])

        pool = link.LinkPool(dial, frame_limit=LIMIT, report=lambda *_: None)
        opened = await asyncio.gather(*(pool.open("b", "k", url) for _ in range(3)))
        assert len(sockets) == 3 and len({id(ws) for ws in opened}) == 3
        assert all(ws.protocol == wire.SUBPROTOCOL for ws in opened)
        for index, ws in enumerate(opened):
            await frames.send(ws, wire.Ack(seq=index))
            assert await frames.receive(ws, 5) == wire.Ack(seq=index)
            await ws.close()
        await pool.close()
    await runner.cleanup()


async def test_closing_a_stream_from_this_end_ends_a_receive_and_a_send_waiting_on_it(served: Any) -> None:
    _, pool, _ = await served(hold)
    stream = await pool.open("b", "k", pool.url)
    await asyncio.wait_for(stream.send_bytes(b"x" * LIMIT), 5)  # the whole credit: the next send waits
    receiving = asyncio.get_running_loop().create_task(frames.receive(stream, 5))
    sending = asyncio.get_running_loop().create_task(stream.send_bytes(b"y"))
    await within(
        "the receive and the send waiting on the stream", until(lambda: waiting(receiving) and waiting(sending))
    )
    await frames.close(stream, wire.CLOSE_GOING_AWAY, "database deleted")
    with pytest.raises(wire.PeerClosed):
        await receiving
    with pytest.raises(ConnectionResetError):
        await sending
    await pool.close()
