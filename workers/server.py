"""The worker's inbound server on the shared node port: `/replication` (WebSocket, mTLS) and the data API.

Every worker binds the node port with SO_REUSEPORT, so the kernel spreads connections over the workers and a
worker that dies takes only its own sessions with it.

A replication peer must present a certificate from the cluster CA (the TLS layer checks the chain); the handler
then requires that the certificate's name is a registered node (a `system.nodes` row or a configured peer) and that
its serial is not revoked. Bad input from a peer closes that session with a reason; it never ends the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from typing import Any

from aiohttp import hdrs, web

from replicator.shared import antientropy_queries as queries
from replicator.shared import wire
from replicator.shared.http_errors import error_response, json_runner
from replicator.shared.logs import capture_library_logs, log
from replicator.shared.store import UnknownDatabase
from replicator.shared.tls import PeerIdentity, peer_identity
from replicator.workers import blobs, frames, link, send_auth
from replicator.workers.context import WorkerContext
from replicator.workers.data_api import DataApi, answer_errors
from replicator.workers.listener import GuardedSite
from replicator.workers.sender import Sender

NOT_REGISTERED = "is not in the registry"
SHUTTING_DOWN = "node shutting down"


class ReplicationServer:
    def __init__(self, ctx: WorkerContext, server_ssl: ssl.SSLContext) -> None:
        self._ctx = ctx
        self._ssl = server_ssl
        self._runner: web.AppRunner | None = None
        self._site: GuardedSite | None = None
        self._sockets: dict[Any, PeerIdentity] = {}  # live replication sessions, by the peer's identity
        self._links: dict[link.Link, PeerIdentity] = {}  # live links a peer dialled, each carrying sessions
        # The sender of each live session, and an event set once it no longer uses the store.
        self._senders: dict[Any, tuple[Sender, asyncio.Event]] = {}
        self._queries = queries.Admission()  # turns to answer anti-entropy queries, per peer and in all
        # Set when the drain starts: from then on no session or link is registered, so the drain's lists are whole.
        self._closing = asyncio.Event()
        app = web.Application(client_max_size=ctx.config.replication.max_frame_bytes, middlewares=[answer_errors])
        app.router.add_get("/replication", self.replication)
        app.router.add_post("/replication/antientropy", self.antientropy)
        app.router.add_get("/replication/blobs/{database}/{hash}", self.blob)
        app.router.add_routes(DataApi(ctx).routes())
        self._app = app

    async def start(self) -> None:
        listen = self._ctx.config.listen
        # aiohttp logs a bad request with its traceback, as text: on one JSON line instead, sampled.
        capture_library_logs(log, "aiohttp", "asyncio")
        # Slow request heads are dropped after request_timeout, every error answer is JSON (`shared.http_errors`).
        self._runner = json_runner(self._app, listen.request_timeout)
        await self._runner.setup()
        counters = self._ctx.counters
        site = GuardedSite(
            self._runner,
            listen,
            self._ssl,
            on_refused=lambda limit: counters.inc("replicator_connections_refused_total", limit),
        )
        await site.start()
        self._site = site

    def use_tls(self, server_ssl: ssl.SSLContext) -> None:
        """Accept new connections with `server_ssl` (a reload); those open now keep the context they were made with."""
        self._ssl = server_ssl
        if self._site is not None:
            self._site.use_tls(server_ssl)

    def stop_accepting(self) -> None:
        """The drain begins: no new connection, and a session or link asked for from now on, on a connection
        accepted before (its handshake under way, or kept alive), is closed with going-away as it starts. The
        sessions and links open now go on until `close`."""
        self._closing.set()
        if self._site is not None:
            self._site.stop_accepting()

    async def close(self) -> None:
        """Close every replication session with going-away, then stop serving."""
        self.stop_accepting()
        # Taken after the flag: a link or session registers only while it is clear (`_link`, `_serve`), so none
        # comes after these lists.
        await asyncio.gather(
            *(answered.close(wire.CLOSE_GOING_AWAY, SHUTTING_DOWN) for answered in list(self._links)),
            return_exceptions=True,
        )
        await asyncio.gather(
            *(frames.close(ws, wire.CLOSE_GOING_AWAY, SHUTTING_DOWN) for ws in list(self._sockets)),
            return_exceptions=True,
        )
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    def _authorize(self, identity: PeerIdentity) -> str | None:
        """None when the peer may subscribe, else the reason it may not."""
        name = identity.name
        if name == self._ctx.node:
            return f"certificate name {name!r} is this node's own"
        static = any(peer.name == name for peer in self._ctx.config.peers)
        if name not in self._ctx.registry() and not static:
            return f"certificate name {name!r} {NOT_REGISTERED}"
        return self._ctx.revoked(identity)

    async def _peer(self, request: web.Request) -> PeerIdentity | web.Response:
        """The authenticated peer's identity, or the response that refuses the request. A certificate whose name
        is not registered yet is asked about again on the send-auth schedule (`workers.send_auth`): its row may
        still be on its way."""
        transport = request.transport
        ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
        identity = peer_identity(ssl_object) if ssl_object is not None else None
        if identity is None:
            log.warning("send_auth_refused", peer="", database="", reason="no client certificate")
            return error_response(401, "a client certificate from the cluster CA is required")
        budget = self._ctx.config.replication.send_auth_budget
        first = self._authorize(identity)
        if first is not None and first.endswith(NOT_REGISTERED) and budget > 0:
            log.info("send_auth_waiting", peer=identity.name, reason=first, budget_s=budget)
        # The drain ends the wait: the answer is no, and the peer dials again elsewhere or later.
        refusal, attempts = await send_auth.reprobe(
            lambda: self._authorize(identity),
            lambda reason: reason.endswith(NOT_REGISTERED) and not self._closing.is_set(),
            sleep=self._pause,
            budget=budget,
        )
        if refusal is not None:
            log.warning("send_auth_refused", peer=identity.name, database="", reason=refusal, attempts=attempts)
            return error_response(403, refusal)
        if attempts > 1:
            log.info("send_auth_admitted", peer=identity.name, attempts=attempts)
        return identity

    async def _pause(self, delay: float) -> None:
        """The reprobe's wait: `delay`, or until the drain starts."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):  # not wait_for: see workers.frames.receive
                await self._closing.wait()

    async def close_revoked(self) -> int:
        """Close every live session whose peer certificate is revoked now; returns how many."""
        closing = []
        for answered, identity in list(self._links.items()):
            reason = self._ctx.revoked(identity)
            if reason is not None:
                log.warning("link_revoked", peer=identity.name, serial=identity.serial, reason=reason)
                closing.append(answered.close(wire.CLOSE_POLICY, reason))
        for ws, identity in list(self._sockets.items()):
            reason = self._ctx.revoked(identity)
            if reason is not None:
                log.warning("session_revoked", peer=identity.name, serial=identity.serial, reason=reason)
                closing.append(frames.close(ws, wire.CLOSE_POLICY, reason))
        await asyncio.gather(*closing, return_exceptions=True)
        return len(closing)

    async def close_database(self, database: str) -> None:
        """End every live session that serves `database` (it is being removed from this node) and return once
        none of them uses the store any more."""
        serving = [(ws, done) for ws, (sender, done) in list(self._senders.items()) if sender.database == database]
        reason = f"database {database} was deleted and is removed from this node"
        await asyncio.gather(
            *(frames.close(ws, wire.CLOSE_GOING_AWAY, reason) for ws, _ in serving), return_exceptions=True
        )
        await asyncio.gather(*(done.wait() for _, done in serving))

    async def antientropy(self, request: web.Request) -> web.Response:
        """One anti-entropy query from a peer (see `workers.antientropy`): msgpack in, msgpack out. Answered in a
        thread, at most QUERIES_PER_PEER of one peer at once (`Admission`): the loop goes on meanwhile, and every
        answer is bounded by the caps `queries.answer` enforces."""
        identity = await self._peer(request)
        if isinstance(identity, web.Response):
            return identity
        peer = identity.name
        timeout = self._ctx.config.listen.request_timeout
        try:
            async with self._queries.turn(peer, timeout) as turn:
                return await self._answer(request, peer, timeout, turn)
        except queries.Busy as exc:
            log.warning("antientropy_refused", peer=peer, reason=str(exc), sample_by=("peer",))
            busy = error_response(503, str(exc))
            busy.headers["Retry-After"] = "1"
            return busy

    async def _answer(self, request: web.Request, peer: str, timeout: float, turn: queries.Turn) -> web.Response:
        try:
            async with asyncio.timeout(timeout):
                body = await request.read()
        except TimeoutError:
            return error_response(408, "the query did not arrive within listen.request_timeout")
        if len(body) > queries.MAX_QUERY_BYTES:
            return error_response(413, f"a query is at most {queries.MAX_QUERY_BYTES} bytes")
        try:
            query = queries.decode_query(body)
        except queries.BadQuery as exc:
            log.warning("antientropy_refused", peer=peer, reason=str(exc), sample_by=("peer",))
            return error_response(400, str(exc))
        if not self._ctx.replicates(query.database):
            return error_response(403, f"database {query.database!r} is not replicated here")
        try:
            db = self._ctx.store.database(query.database)
        except UnknownDatabase as exc:
            return error_response(404, str(exc))
        try:
            reply = await turn.run(queries.answer_bytes, db, query)
        except queries.BadQuery as exc:
            log.warning("antientropy_refused", peer=peer, reason=str(exc), sample_by=("peer",))
            return error_response(400, str(exc))
        return web.Response(body=reply, content_type="application/msgpack")

    async def blob(self, request: web.Request) -> web.StreamResponse:
        """One blob for a peer's download (see `workers.blobs`), from the byte its Range header names."""
        identity = await self._peer(request)
        if isinstance(identity, web.Response):
            return identity
        return await blobs.serve(self._ctx, request, identity.name)

    async def replication(self, request: web.Request) -> web.StreamResponse:
        identity = await self._peer(request)
        if isinstance(identity, web.Response):
            return identity
        limit = self._ctx.config.replication.max_frame_bytes
        offered = [p.strip() for p in request.headers.get(hdrs.SEC_WEBSOCKET_PROTOCOL, "").split(",")]
        if link.SUBPROTOCOL in offered:
            return await self._link(request, identity, limit)
        ws = frames.SenderSocket(
            limit,
            protocols=[wire.SUBPROTOCOL],
            # Longer than the subscriber's on purpose (workers.frames): while its pings arrive this end sends none.
            heartbeat=frames.SENDER_HEARTBEAT,
        )
        await ws.prepare(request)
        if ws.ws_protocol != wire.SUBPROTOCOL:
            await frames.close(ws, wire.CLOSE_POLICY, f"subprotocol {wire.SUBPROTOCOL} is required")
            return ws
        await self._serve(ws, identity)
        return ws

    async def _link(self, request: web.Request, identity: PeerIdentity, limit: int) -> web.StreamResponse:
        """A link from a peer (`workers.link`): a session for every stream it opens, until the link ends."""
        ws = frames.SenderSocket(
            limit + link.HEADER.size, protocols=[link.SUBPROTOCOL], heartbeat=frames.SENDER_HEARTBEAT
        )
        ws.frame_limit = limit
        await ws.prepare(request)
        if self._closing.is_set():
            await frames.close(ws, wire.CLOSE_GOING_AWAY, SHUTTING_DOWN)
            return ws
        serving: set[asyncio.Task[None]] = set()

        def opened(stream: link.Stream) -> None:
            task = asyncio.get_running_loop().create_task(self._serve(stream, identity))
            serving.add(task)
            task.add_done_callback(serving.discard)

        answered = link.Link(ws, peer=identity.name, frame_limit=limit, dialled=False, on_open=opened)
        self._links[answered] = identity
        try:
            code, reason = await answered.run()
            if code in (wire.CLOSE_MALFORMED, wire.CLOSE_UNSUPPORTED) or reason.startswith("link protocol"):
                log.warning("session_rejected", peer=identity.name, database="", code=code, reason=reason)
        finally:
            self._links.pop(answered, None)
            await asyncio.gather(*serving, return_exceptions=True)
            await frames.close(ws, wire.CLOSE_NORMAL, "link ended")
        return ws

    async def _serve(self, ws: Any, identity: PeerIdentity) -> None:
        """One session: a per-pair socket's, or a stream's of a link."""
        if self._closing.is_set():
            await frames.close(ws, wire.CLOSE_GOING_AWAY, SHUTTING_DOWN)
            return
        identity_name = identity.name
        self._sockets[ws] = identity
        sender = Sender(self._ctx, ws, identity_name)
        done = asyncio.Event()
        self._senders[ws] = (sender, done)
        code, reason = wire.CLOSE_NORMAL, "session ended"
        try:
            await sender.run()
        except wire.PeerClosed as exc:
            code, reason = exc.code, exc.reason
        except wire.SessionError as exc:
            code, reason = exc.code, exc.reason
            log.warning("session_rejected", peer=identity_name, database=sender.database, code=code, reason=exc.reason)
        except wire.MalformedFrame as exc:
            code, reason = exc.close_code, exc.reason
            log.warning("session_rejected", peer=identity_name, database=sender.database, code=code, reason=reason)
        except UnknownDatabase as exc:
            # The database is being removed from this node while the session starts (close_database).
            code, reason = wire.CLOSE_GOING_AWAY, str(exc)
        finally:
            self._sockets.pop(ws, None)
            self._senders.pop(ws, None)
            done.set()
            await frames.close(ws, code, reason)
