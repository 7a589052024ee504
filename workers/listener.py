"""The node port's listener: which connections get TLS at all, and how long a client may take to start a request.

Every worker accepts on the shared node port. A new connection is closed at once, before any TLS work, when the
worker holds `listen.max_connections` connections, or has `listen.max_handshakes` TLS handshakes in progress: a peer
that comes back to a crowd of redialling nodes finishes the handshakes it took within their deadline, and the rest
cost it a refused connection each, not a handshake that times out after the work was done (the fleet simulation,
`benchmarks/fleet_sim.py --max-handshakes`). Once its handshake is done, a connection without a cluster
certificate is closed when its address already holds `listen.max_connections_per_client` such connections. A peer
presents a certificate and opens a session per database (a thousand databases are a thousand sessions from one
address, dialled in a burst), so only the first cap holds it; the handshakes in flight are bounded by that cap and
by the handshake deadline below. Each refusal is counted (`replicator_connections_refused_total{limit}`) and logged,
sampled.

A client must finish its TLS handshake within `listen.request_timeout` of connecting or it is dropped here; after
the handshake aiohttp's keep-alive timer, set to the same timeout by `workers.server`, drops a connection that has not
sent a whole request head. So a slow client holds a connection for one timeout at most (issue 9: 4,000 connections
that each sent half a request held 580 MB of a worker, for good).

TLS is asyncio's own `SSLProtocol`, placed behind the gate rather than in front of it, which is where
`loop.create_server(ssl=...)` puts it: there every connection would cost a handshake before it could be refused.

Memory: a connection costs the worker about 120 KB while it is open. When a crowd of connections has gone, glibc
keeps the freed memory in its heap (a flood of 400 left 65 MB behind): once the open connections fall to a quarter
of their peak, the worker hands it back (`malloc_trim`).
"""

from __future__ import annotations

import asyncio
import enum
import resource
import ssl
from asyncio.sslproto import SSLProtocol
from collections.abc import Callable
from typing import Any

from aiohttp import web

from replicator.shared.config import ListenSection
from replicator.shared.logs import log
from replicator.shared.memory import release_free_memory

LIMIT_TOTAL = "max_connections"
LIMIT_PER_CLIENT = "max_connections_per_client"
LIMIT_HANDSHAKES = "max_handshakes"
LIMITS = (LIMIT_TOTAL, LIMIT_PER_CLIENT, LIMIT_HANDSHAKES)
# File descriptors a worker needs besides its node-port connections: outbound sessions, database files, the pipe.
SPARE_FILES = 1024
# Connections that must have closed (and the open ones fallen to a quarter of the peak) before memory is trimmed;
# the trim runs this long after the fall, once for a whole wave of closes.
TRIM_AFTER_CLOSED = 128
TRIM_DELAY = 1.0


class _TLS(SSLProtocol):
    # The most one read takes from the socket. asyncio's 256 KiB is allocated, and touched, for every connection the
    # moment it is accepted; the node port reads requests and acknowledgements, for which 64 KiB reads are plenty.
    max_size = 64 * 1024


class ConnectionLimits:
    """The connections one worker holds, and by client address those that finished TLS without a cluster
    certificate (anonymous)."""

    def __init__(self, max_connections: int, max_per_client: int, max_handshakes: int | None = None) -> None:
        self.max_connections = max_connections
        self.max_per_client = max_per_client
        self.max_handshakes = max_connections if max_handshakes is None else max_handshakes
        self.open = 0
        self.handshaking = 0
        self._anonymous: dict[str, int] = {}

    def anonymous(self, address: str) -> int:
        return self._anonymous.get(address, 0)

    @property
    def addresses(self) -> int:
        return len(self._anonymous)

    def admit(self, address: str) -> str | None:
        """Take a new connection (its handshake still to come); None, or the limit that refuses it."""
        if self.open >= self.max_connections:
            return LIMIT_TOTAL
        if self.handshaking >= self.max_handshakes:
            return LIMIT_HANDSHAKES
        self.open += 1
        self.handshaking += 1
        return None

    def handshake_over(self) -> None:
        """An admitted connection finished its handshake, or closed before it did."""
        self.handshaking -= 1

    def anonymous_done(self, address: str) -> str | None:
        """An admitted connection from `address` finished TLS without a cluster certificate: None when it counts
        against its address from now on, or the limit that refuses it (then `release` it as not anonymous)."""
        held = self._anonymous.get(address, 0)
        if held >= self.max_per_client:
            return LIMIT_PER_CLIENT
        self._anonymous[address] = held + 1
        return None

    def release(self, address: str, *, anonymous: bool) -> None:
        """An admitted connection closed."""
        self.open -= 1
        if anonymous:
            self._drop(address)

    def _drop(self, address: str) -> None:
        held = self._anonymous[address] - 1
        if held:
            self._anonymous[address] = held
        else:
            del self._anonymous[address]


class _State(enum.Enum):
    NEW = "new"  # accepted, not yet admitted
    REFUSED = "refused"  # over a cap: aborted before any TLS work
    HANDSHAKE = "handshake"  # admitted; the TLS handshake runs against the deadline
    OPEN = "open"  # the handshake is done: aiohttp's connection now
    CLOSED = "closed"


_TRANSITIONS = {
    _State.NEW: {_State.REFUSED, _State.HANDSHAKE},
    _State.HANDSHAKE: {_State.OPEN, _State.CLOSED},
    _State.OPEN: {_State.CLOSED},
    _State.REFUSED: set(),
    _State.CLOSED: set(),
}


class _Gate(asyncio.BufferedProtocol):
    """One accepted connection: refused at once, or TLS in front of aiohttp's request handler until it closes."""

    def __init__(self, site: GuardedSite) -> None:
        self._site = site
        self._state = _State.NEW
        self._transport: asyncio.Transport | None = None
        self._tls: _TLS | None = None
        self._handler: Any = None
        self._address = ""
        self._anonymous = False
        self._deadline: asyncio.TimerHandle | None = None  # owned by HANDSHAKE

    def _set_state(self, state: _State) -> None:
        assert state in _TRANSITIONS[self._state], (self._state, state)
        if self._state is _State.HANDSHAKE:
            self._site.limits.handshake_over()
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
        self._state = state

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        site = self._site
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        refused = site.limits.admit(address)
        if refused is not None:
            self._set_state(_State.REFUSED)
            transport.abort()
            site.refused(refused, address)
            return
        self._set_state(_State.HANDSHAKE)
        site.admitted()
        loop = site.loop
        self._transport, self._address, self._anonymous = transport, address, False
        site.gates.add(self)
        handshake: asyncio.Future[None] = loop.create_future()
        handshake.add_done_callback(self._handshake_done)
        self._handler = site.handler_factory()
        self._tls = _TLS(loop, self._handler, site.ssl_context, handshake, server_side=True)
        self._deadline = loop.call_later(site.timeout, self.abort)
        self._tls.connection_made(transport)

    def _handshake_done(self, handshake: asyncio.Future[None]) -> None:
        failed = handshake.cancelled() or handshake.exception() is not None  # retrieved, so never reported
        app_transport = getattr(self._handler, "transport", None)
        if failed or self._state is not _State.HANDSHAKE or app_transport is None:
            return  # the TLS layer closes a connection whose handshake failed
        self._set_state(_State.OPEN)
        ssl_object = app_transport.get_extra_info("ssl_object")
        if ssl_object is not None and ssl_object.getpeercert(binary_form=True):
            return  # a cluster certificate: only the worker's cap holds it
        refused = self._site.limits.anonymous_done(self._address)
        if refused is None:
            self._anonymous = True
            return
        self._site.refused(refused, self._address)
        app_transport.abort()

    def abort(self) -> None:
        """Drop the connection if its TLS handshake has not finished (an open one belongs to aiohttp)."""
        if self._state is _State.HANDSHAKE and self._transport is not None:
            self._transport.abort()

    def get_buffer(self, sizehint: int) -> Any:
        assert self._tls is not None
        return self._tls.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        assert self._tls is not None
        self._tls.buffer_updated(nbytes)

    def eof_received(self) -> bool | None:
        return self._tls.eof_received() if self._tls is not None else None

    def pause_writing(self) -> None:
        if self._tls is not None:
            self._tls.pause_writing()

    def resume_writing(self) -> None:
        if self._tls is not None:
            self._tls.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._state not in (_State.HANDSHAKE, _State.OPEN):
            return  # refused
        self._set_state(_State.CLOSED)
        tls, self._tls, self._transport = self._tls, None, None
        self._site.gates.discard(self)
        self._site.limits.release(self._address, anonymous=self._anonymous)
        self._site.released()
        assert tls is not None
        tls.connection_lost(exc)


class GuardedSite(web.BaseSite):
    """The node port: a TCP site whose connections pass `ConnectionLimits` before TLS (see the module docstring)."""

    def __init__(
        self,
        runner: web.BaseRunner,
        listen: ListenSection,
        ssl_context: ssl.SSLContext,
        *,
        on_refused: Callable[[str], None],
        backlog: int = 128,
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context, backlog=backlog)
        self.ssl_context = ssl_context
        self._host = listen.host
        self._port = listen.port
        self.timeout = listen.request_timeout
        self.limits = ConnectionLimits(listen.max_connections, listen.max_connections_per_client, listen.max_handshakes)
        self.gates: set[_Gate] = set()
        self._on_refused = on_refused
        self._loop: asyncio.AbstractEventLoop | None = None
        self._peak = 0  # the most connections open at once since memory was last trimmed
        self._trim: asyncio.TimerHandle | None = None

    def use_tls(self, ssl_context: ssl.SSLContext) -> None:
        """New connections handshake with `ssl_context` (`_Gate` reads it as each one is accepted); a connection
        accepted before keeps its TLS object, and with it the context it was made with."""
        self.ssl_context = ssl_context
        self._ssl_context = ssl_context

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "the site has not started"
        return self._loop

    def handler_factory(self) -> asyncio.Protocol:
        """aiohttp's request handler for a new connection."""
        server = self._runner.server
        assert server is not None
        return server()

    @property
    def name(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"https://{host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        self._loop = asyncio.get_running_loop()
        _raise_file_limit(self.limits.max_connections + SPARE_FILES)
        self._server = await self.loop.create_server(
            lambda: _Gate(self), self._host, self._port, backlog=self._backlog, reuse_port=True
        )

    def stop_accepting(self) -> None:
        """Close the listening socket: new connections go to the node's other workers (SO_REUSEPORT), or are
        refused when none listens, and those still in this socket's accept queue are reset. The connections open
        now stay open; `stop` drops them."""
        if self._server is not None:
            self._server.close()

    async def stop(self) -> None:
        await super().stop()
        if self._trim is not None:
            self._trim.cancel()
            self._trim = None
        for gate in list(self.gates):
            gate.abort()

    def refused(self, limit: str, address: str) -> None:
        self._on_refused(limit)
        log.warning("connection_refused", limit=limit, client=address, open=self.limits.open, sample_by=("limit",))

    def admitted(self) -> None:
        self._peak = max(self._peak, self.limits.open)

    def released(self) -> None:
        now_open = self.limits.open
        if self._trim is None and self._peak - now_open >= TRIM_AFTER_CLOSED and now_open <= self._peak // 4:
            self._trim = self.loop.call_later(TRIM_DELAY, self._return_memory)

    def _return_memory(self) -> None:
        self._trim = None
        self._peak = self.limits.open
        release_free_memory()  # it walks the heap: a few ms


def _raise_file_limit(wanted: int) -> None:
    """Lift the soft limit on open files towards `wanted` (never past the hard limit): a worker that runs out of
    descriptors stops accepting altogether, which is worse than any cap."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass  # the limit stays; accept errors are logged by the loop, and the caps still hold
