"""What a TLS connection keeps while it is open (issue 12): one read buffer per thread for all connections, and no
session tickets from the node port. Real handshakes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ssl
from asyncio import sslproto
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from replicator.shared.tls import client_context, create_ca, issue_node_cert, limit_read_buffers, server_context

DEADLINE = 20.0


@pytest.fixture
def contexts(tmp_path: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client): node a's port and node b dialling it."""
    create_ca(tmp_path / "ca")
    for name in ("a", "b"):
        issue_node_cert(tmp_path / "ca", name, ["127.0.0.1"], tmp_path / "certs")
    ca, certs = tmp_path / "ca" / "ca.pem", tmp_path / "certs"
    return server_context(ca, certs / "a.pem", certs / "a.key"), client_context(ca, certs / "b.pem", certs / "b.key")


@pytest.fixture
def restored_sslproto(monkeypatch: pytest.MonkeyPatch) -> None:
    """`limit_read_buffers` changes asyncio's class for the process: put it back after the test."""
    monkeypatch.setattr(sslproto.SSLProtocol, "max_size", sslproto.SSLProtocol.max_size)
    monkeypatch.setattr(sslproto.SSLProtocol, "__init__", sslproto.SSLProtocol.__init__)


@contextlib.asynccontextmanager
async def _digest_server(context: ssl.SSLContext, protocols: list[sslproto.SSLProtocol]) -> AsyncIterator[int]:
    """A TLS server answering each connection's 8-byte length and payload with the payload's SHA-256."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        protocols.append(writer.transport._ssl_protocol)  # type: ignore[attr-defined]
        try:
            size = int.from_bytes(await reader.readexactly(8), "big")
            writer.write(hashlib.sha256(await reader.readexactly(size)).digest())
            await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=context)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


async def test_connections_of_one_loop_read_through_one_buffer_and_keep_their_bytes_apart(
    contexts: tuple[ssl.SSLContext, ssl.SSLContext], restored_sslproto: None
) -> None:
    server_ssl, client_ssl = contexts
    limit_read_buffers(4096)  # small, so that every payload takes many reads, interleaved between the connections
    limit_read_buffers(4096)  # a second call changes nothing
    server_side: list[sslproto.SSLProtocol] = []
    client_side: list[sslproto.SSLProtocol] = []

    async def exchange(port: int, index: int) -> tuple[bytes, bytes]:
        payload = bytes([index]) * 50_000 + index.to_bytes(4, "big") * 20_000
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_ssl)
        client_side.append(writer.transport._ssl_protocol)  # type: ignore[attr-defined]
        try:
            writer.write(len(payload).to_bytes(8, "big") + payload)
            await writer.drain()
            return await reader.readexactly(32), hashlib.sha256(payload).digest()
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                await writer.wait_closed()

    async with asyncio.timeout(DEADLINE), _digest_server(server_ssl, server_side) as port:
        answers = await asyncio.gather(*(exchange(port, index) for index in range(1, 9)))

    assert all(answer == expected for answer, expected in answers)
    protocols = server_side + client_side
    assert len(protocols) == 16
    assert len({id(protocol._ssl_buffer) for protocol in protocols}) == 1  # type: ignore[attr-defined]
    assert len(protocols[0]._ssl_buffer) == 4096  # type: ignore[attr-defined]


async def test_a_subclass_reading_more_shares_a_buffer_of_its_own_size(restored_sslproto: None) -> None:
    class Larger(sslproto.SSLProtocol):
        max_size = 8192

    limit_read_buffers(4096)
    loop = asyncio.get_running_loop()
    context = ssl.create_default_context()
    made = [
        kind(loop, asyncio.Protocol(), context, None, server_hostname="a")
        for kind in (sslproto.SSLProtocol, Larger, sslproto.SSLProtocol, Larger)
    ]
    buffers = [protocol._ssl_buffer for protocol in made]  # type: ignore[attr-defined]
    for protocol in made:
        protocol.connection_lost(None)  # never connected: closes the transport each made for its protocol
    assert [len(buffer) for buffer in buffers] == [4096, 8192, 4096, 8192]
    assert buffers[0] is buffers[2] and buffers[1] is buffers[3] and buffers[0] is not buffers[1]
    assert bytes(made[1].get_buffer(-1)[:1]) == b"\0" and made[1].get_buffer(-1).obj is buffers[1]


@pytest.mark.parametrize("tickets", [None, 2])
async def test_the_node_port_sends_no_session_tickets(
    contexts: tuple[ssl.SSLContext, ssl.SSLContext], tickets: int | None
) -> None:
    """None of our clients resumes a session; a client holding tickets pays for them with every connection."""
    server_ssl, client_ssl = contexts
    if tickets is not None:
        server_ssl.num_tickets = tickets  # the control: OpenSSL's default
    held: list[bool] = []

    async with asyncio.timeout(DEADLINE), _digest_server(server_ssl, []) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_ssl)
        try:
            writer.write((1).to_bytes(8, "big") + b"x")
            await reader.readexactly(32)  # the tickets come before the answer
            ssl_object = writer.get_extra_info("ssl_object")
            assert ssl_object.version() == "TLSv1.3"
            held.append(ssl_object.session.has_ticket)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                await writer.wait_closed()

    assert held == [tickets is not None]
