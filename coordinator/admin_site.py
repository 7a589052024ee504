"""The admin port's listener: at most `listen.admin_max_connections` connections, each on the request timeout.

The node port's gate (`workers.listener`) refuses a connection over its cap before any TLS work; the admin port is
plain HTTP, so its gate can say why: a connection over the cap gets a 503 with a JSON reason and is closed at once,
without reaching aiohttp. The connections it holds are aiohttp's, whose keep-alive timer (`keepalive_timeout`, set to
`listen.request_timeout` by `coordinator.admin`) closes one that has not sent a whole request head within the
timeout of connecting or of its last answer: a slow or idle client holds a slot for one timeout at most (issue 21:
300 slowloris connections were all still open after 60 s, 2,000 idle ones all held).

A crowd that keeps the cap full (from loopback, every client has the same address) still shuts the port for
everyone else while it lasts; a scrape that then fails shows as `up == 0`, and each refusal is counted
(`replicator_admin_refused_total{reason="max_connections"}`) and logged, sampled.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web

from replicator.shared.logs import log

_BUSY = msgspec.json.encode({"error": "the admin port holds listen.admin_max_connections connections; try again"})
BUSY_ANSWER = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\nRetry-After: 1\r\n"
    + f"Content-Length: {len(_BUSY)}\r\n\r\n".encode()
    + _BUSY
)


class _Gate(asyncio.Protocol):
    """One accepted connection: answered busy and closed, or passed whole to aiohttp's request handler."""

    def __init__(self, site: CappedSite) -> None:
        self._site = site
        self._handler: Any = None  # aiohttp's RequestHandler, once admitted

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        if not self._site.admit():
            peer = transport.get_extra_info("peername")
            transport.write(BUSY_ANSWER)
            transport.close()
            self._site.refused(str(peer[0]) if isinstance(peer, tuple) and peer else "")
            return
        self._handler = self._site.handler_factory()
        self._handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._handler is not None:
            self._handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self._handler.eof_received() if self._handler is not None else None

    def pause_writing(self) -> None:
        if self._handler is not None:
            self._handler.pause_writing()

    def resume_writing(self) -> None:
        if self._handler is not None:
            self._handler.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        handler, self._handler = self._handler, None
        if handler is None:
            return  # refused: never counted
        self._site.release()
        handler.connection_lost(exc)


class CappedSite(web.BaseSite):
    """A plain TCP site that holds at most `max_connections` connections at once."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        max_connections: int,
        *,
        on_refused: Callable[[], None],
        backlog: int = 128,
    ) -> None:
        super().__init__(runner, backlog=backlog)
        self._host = host
        self._port = port
        self.max_connections = max_connections
        self.open = 0
        self._on_refused = on_refused

    @property
    def name(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self._port}"

    def handler_factory(self) -> asyncio.Protocol:
        server = self._runner.server
        assert server is not None
        return server()

    def admit(self) -> bool:
        if self.open >= self.max_connections:
            return False
        self.open += 1
        return True

    def release(self) -> None:
        self.open -= 1

    def refused(self, address: str) -> None:
        self._on_refused()
        log.warning(
            "admin_connection_refused",
            limit="admin_max_connections",
            client=address,
            open=self.open,
            sample_by=("limit",),
        )

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Gate(self), self._host or None, self._port, backlog=self._backlog, reuse_address=True
        )
