"""workers.server at the drain: once closing starts, no new connection is accepted, and a session or link asked for
on a connection accepted before gets going-away; a link open before stays open until the drain closes it with
going-away. A real ReplicationServer on loopback, with real TLS."""

from __future__ import annotations

import asyncio
import io
import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiohttp import WSMsgType

from replicator.shared import wire
from replicator.shared.config import from_mapping
from replicator.shared.logs import EventLog
from replicator.shared.store import Store
from replicator.shared.tls import client_context, create_ca, issue_node_cert, peer_identity, server_context
from replicator.workers import link, server
from replicator.workers.context import WorkerContext
from replicator.workers.counters import Counters

WAIT = 5.0  # the most a test waits for what it expects to happen


@dataclass
class Served:
    server: server.ReplicationServer
    url: str
    client_ssl: ssl.SSLContext
    stranger_ssl: ssl.SSLContext  # node d's: a cluster certificate whose name is not registered
    events: io.StringIO


@pytest.fixture
async def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Served]:
    """Node a's replication server on a free loopback port; peer c's client TLS context, and node d's."""
    monkeypatch.setattr(server, "capture_library_logs", lambda *_: None)  # leaves this process's loggers alone
    events = io.StringIO()
    monkeypatch.setattr(server, "log", EventLog(events, level="debug"))
    create_ca(tmp_path / "ca")
    ca = tmp_path / "ca" / "ca.pem"
    a_cert, a_key = issue_node_cert(tmp_path / "ca", "a", ["127.0.0.1"], tmp_path / "tls")
    c_cert, c_key = issue_node_cert(tmp_path / "ca", "c", ["127.0.0.1"], tmp_path / "tls")
    d_cert, d_key = issue_node_cert(tmp_path / "ca", "d", ["127.0.0.1"], tmp_path / "tls")
    config = from_mapping(
        {
            "node": {"name": "a", "url": "wss://127.0.0.1:9925", "workers": 1},
            "listen": {"host": "127.0.0.1"},
            "data": {"token": "t"},
            "replication": {"max_frame_bytes": 65536},
            "peers": [{"name": "c", "url": "wss://127.0.0.1:9"}],
        },
        "",
    )
    config.listen.port = 0  # the kernel picks a free one: no config file may say so
    (tmp_path / "data").mkdir()
    ctx = WorkerContext(
        worker_id=0,
        config=config,
        store=Store(tmp_path / "data", "a"),
        counters=Counters(),
        client_ssl=client_context(ca, c_cert, c_key),
        report=lambda message: None,
    )
    replication = server.ReplicationServer(ctx, server_context(ca, a_cert, a_key))
    await replication.start()
    site = replication._site
    assert site is not None and site._server is not None
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        url = f"https://127.0.0.1:{port}/replication"
        yield Served(replication, url, ctx.client_ssl, client_context(ca, d_cert, d_key), events)
    finally:
        await replication.close()
        ctx.store.close()


async def receive(ws: aiohttp.ClientWebSocketResponse | link.Stream) -> aiohttp.WSMessage:
    async with asyncio.timeout(WAIT):
        return await ws.receive()


@pytest.mark.parametrize("subprotocol", [link.SUBPROTOCOL, wire.SUBPROTOCOL])
async def test_once_closing_starts_no_connection_is_accepted_and_one_kept_alive_gets_going_away(
    served: Served, subprotocol: str
) -> None:
    connector = aiohttp.TCPConnector(ssl=served.client_ssl, limit=1)
    async with aiohttp.ClientSession(connector=connector) as kept, aiohttp.ClientSession() as fresh:
        # A connection accepted before the drain, kept alive after its answer (405: the route takes POST only).
        async with kept.get(served.url + "/antientropy") as answer:
            assert answer.status == 405
            await answer.read()
        served.server.stop_accepting()
        with pytest.raises(aiohttp.ClientConnectorError):
            await fresh.get(served.url + "/antientropy", ssl=served.client_ssl)
        # So this dial can only go over the kept-alive connection: the session or link gets going-away at once.
        ws = await kept.ws_connect(served.url, protocols=[subprotocol])
        message = await receive(ws)
        assert (message.type, message.data, message.extra) == (
            WSMsgType.CLOSE,
            wire.CLOSE_GOING_AWAY,
            "node shutting down",
        )


async def credited(stream: link.Stream) -> None:
    """Return once the answering end has accepted the stream's OPEN (its CREDIT arrived)."""
    async with asyncio.timeout(WAIT):
        while stream._credit == 0:  # noqa: ASYNC110 - the credit has no event of its own to wait on
            await asyncio.sleep(0)


async def test_a_link_open_before_the_drain_stays_open_until_the_drain_closes_it_with_going_away(
    served: Served,
) -> None:
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(served.url, protocols=[link.SUBPROTOCOL], ssl=served.client_ssl)
        assert ws.protocol == link.SUBPROTOCOL
        dialled = link.Link(ws, peer="a", frame_limit=65536, dialled=True)
        reading = asyncio.get_running_loop().create_task(dialled.run())
        before = dialled.open_stream()
        await credited(before)
        served.server.stop_accepting()
        # A new session on the link is refused with going-away; the link, and the session open before, go on.
        during = dialled.open_stream()
        message = await receive(during)
        assert (message.type, message.data, message.extra) == (
            WSMsgType.CLOSE,
            wire.CLOSE_GOING_AWAY,
            "node shutting down",
        )
        assert not reading.done() and dialled.alive and before.id in dialled.streams
        await served.server.close()
        async with asyncio.timeout(WAIT):
            code, reason = await reading
        assert (code, reason) == (wire.CLOSE_GOING_AWAY, "node shutting down")
        message = await receive(before)
        assert (message.type, message.data) == (WSMsgType.CLOSE, wire.CLOSE_GOING_AWAY)


def logged(events: io.StringIO, event: str) -> list[dict[str, object]]:
    return [record for line in events.getvalue().splitlines() if (record := json.loads(line))["event"] == event]


async def test_the_drain_ends_the_wait_for_an_unregistered_peer_s_row(served: Served) -> None:
    """A dial waiting for its registry row (send-auth reprobe, a 30 s budget) is answered no once the drain starts,
    rather than holding the drain for the rest of its budget."""
    async with aiohttp.ClientSession() as http:
        dialling = asyncio.get_running_loop().create_task(
            http.ws_connect(served.url, protocols=[link.SUBPROTOCOL], ssl=served.stranger_ssl)
        )
        async with asyncio.timeout(WAIT):
            while not logged(served.events, "send_auth_waiting"):  # noqa: ASYNC110 - a log line has no event
                await asyncio.sleep(0)
        served.server.stop_accepting()
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            async with asyncio.timeout(WAIT):
                await dialling
        assert refused.value.status == 403
        assert [record["peer"] for record in logged(served.events, "send_auth_refused")] == ["d"]


async def test_a_stream_of_a_link_whose_socket_has_closed_still_names_the_peer_s_certificate(served: Served) -> None:
    """A stream opened just before its link ends (a peer's restart, a drain) still gives its session the peer's TLS
    identity: read as 'no node name', the session took the lost connection for a refusal and redialled on the
    growing backoff."""
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(served.url, protocols=[link.SUBPROTOCOL], ssl=served.client_ssl)
        dialled = link.Link(ws, peer="a", frame_limit=65536, dialled=True)
        reading = asyncio.get_running_loop().create_task(dialled.run())
        stream = dialled.open_stream()
        await served.server.close()
        async with asyncio.timeout(WAIT):
            await reading
        assert ws.get_extra_info("ssl_object") is None  # the transport has gone
        identity = peer_identity(stream.get_extra_info("ssl_object"))
        assert identity is not None and identity.name == "a"
