"""An outbound session against real sockets: an unsubscribe during the TLS handshake leaves nothing behind, and a
force reconnect schedules exactly one reconnect."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from replicator.shared import messages
from replicator.shared.config import from_mapping
from replicator.shared.keys import connection_key
from replicator.shared.store import Store
from replicator.shared.tls import client_context, create_ca, issue_node_cert
from replicator.workers.context import WorkerContext
from replicator.workers.counters import Counters
from replicator.workers.session import PeerSession, State
from tests.integration.conftest import wait_for


class Harness:
    def __init__(self, tmp_path: Path) -> None:
        create_ca(tmp_path / "ca")
        cert, key = issue_node_cert(tmp_path / "ca", "w", ["127.0.0.1"], tmp_path)
        config = from_mapping({"node": {"name": "w", "url": "wss://127.0.0.1:1"}}, "")
        self.store = Store(tmp_path / "data", "w")
        self.reports: list[Any] = []
        self.ctx = WorkerContext(
            worker_id=0,
            config=config,
            store=self.store,
            counters=Counters(),
            client_ssl=client_context(tmp_path / "ca" / "ca.pem", cert, key),
            report=self.reports.append,
        )
        self.http = aiohttp.ClientSession()
        self.ids = itertools.count(1)

    def session(self, url: str) -> PeerSession:
        sub = messages.Subscribe(key=connection_key(url), peer="p", url=url, database="db")
        session = PeerSession(self.ctx, self.http, sub, lambda: next(self.ids))
        session.start()
        return session

    def of(self, kind: type) -> list[Any]:
        return [r for r in self.reports if isinstance(r, kind)]

    async def close(self) -> None:
        await self.http.close()
        await self.ctx.feeds.close()
        self.store.close()


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    h = Harness(tmp_path)
    yield h
    await h.close()


async def test_unsubscribe_during_the_tls_handshake_leaves_no_session(harness: Harness) -> None:
    accepted: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append((reader, writer))  # never answer the ClientHello: the handshake hangs

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        session = harness.session(f"wss://127.0.0.1:{port}")
        await wait_for(lambda: accepted, 10, "the dial to reach the server")
        assert session.state is State.DIALING
        session.stop()
        await asyncio.wait_for(session.wait_closed(), 5)
        reader, writer = accepted[0]
        # The client side closed its socket: the server reads the ClientHello, then end of stream.
        while await asyncio.wait_for(reader.read(65536), 5):
            pass
        assert session.state is State.CLOSED and not session.connected
        assert harness.of(messages.Connected) == []
        assert [r.reconnect_in for r in harness.of(messages.Disconnected)] == [None]
        writer.close()
    finally:
        server.close()
        await server.wait_closed()


async def test_a_force_reconnect_schedules_exactly_one_reconnect(harness: Harness) -> None:
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()  # nothing listens there now: every dial is refused at once
    session = harness.session(f"wss://127.0.0.1:{port}")
    try:
        await wait_for(lambda: harness.of(messages.Disconnected), 10, "the first refused dial")
        first = harness.of(messages.Disconnected)[0]
        assert first.reconnect_in is not None and first.reconnect_in >= 0.5  # the floor
        for _ in range(5):
            session.force_reconnect(None, "operator")
        await wait_for(
            lambda: len(harness.of(messages.Disconnected)) >= 2 and session.state is State.WAITING,
            5,
            "the forced reconnect to fail and wait on the schedule",
        )
        reports = harness.of(messages.Disconnected)
        assert len(reports) == 2
        assert len({r.session for r in reports}) == 2
        assert session.state is State.WAITING
    finally:
        session.stop()
        await session.wait_closed()
