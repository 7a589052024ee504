"""A worker process: owns the TLS sessions, the inbound server and its own connections to the store.

The coordinator forks it from its worker template (coordinator.template), or starts it with the spawn context when
there is no template, and talks to it over one duplex pipe. Before the worker is ready, commands wait in the
admission gate (the latest per pair); after, they run inline. A heartbeat from inside the loop every second proves
the loop runs. A worker that cannot boot (store, certificates, port) exits with EXIT_BOOT_ERROR so the supervisor
stops respawning it.

The worker presents the TLS material the coordinator loaded and checked (`messages.WorkerBoot`, then `ReloadTls` for
each reload), never the files as they are when it starts: a worker respawned after a reload presents what the node
does. A reload swaps the contexts new handshakes use, inbound and outbound; live sessions go on with theirs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import select
import signal
import socket
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import psutil

from replicator.shared import config as config_module
from replicator.shared import messages, wire
from replicator.shared.http_errors import error_text
from replicator.shared.keys import pair_key
from replicator.shared.logs import bridge_logging, log
from replicator.shared.memory import Trimmer
from replicator.shared.notify import Doorbell
from replicator.shared.prctl import PR_SET_PDEATHSIG, prctl
from replicator.shared.store import Store
from replicator.shared.tls import (
    TlsConfigError,
    TlsMaterial,
    contexts,
    limit_read_buffers,
    peer_identity,
    read_material,
)
from replicator.workers import antientropy, blob_repair, blobs, frames, link
from replicator.workers.admission import WorkerAdmission
from replicator.workers.context import SYSTEM, WorkerContext
from replicator.workers.counters import Counters
from replicator.workers.resolver import PinnedResolver
from replicator.workers.server import ReplicationServer
from replicator.workers.session import DIAL_TIMEOUT, PeerSession, dial_socket, note_refused_row

EXIT_OK = 0
EXIT_BOOT_ERROR = 3
HEARTBEAT_INTERVAL = 1.0
REVOCATION_CHECK = 0.5
IDLE_PROGRESS_INTERVAL = 5.0
# The template's intermediate process exits right after forking the worker; longer means it is stuck.
ADOPTION_TIMEOUT = 5.0


class BootError(Exception):
    """The worker cannot start; the message says what to fix."""


def worker_entry(worker_id: int, boot: bytes, conn: Connection) -> None:
    """Process target (spawn context)."""
    _die_with_parent()
    fd = os.dup(conn.fileno())
    conn.close()
    sys.exit(run_worker(worker_id, boot, fd))


def forked_worker_entry(worker_id: int, boot: bytes, pipe_fd: int, coordinator: int) -> int:
    """Entry of a worker forked by the coordinator's template (coordinator.template); the exit code."""
    _die_with_parent(coordinator)
    return run_worker(worker_id, boot, pipe_fd)


def run_worker(worker_id: int, boot_bytes: bytes, pipe_fd: int) -> int:
    """The worker, from its start (`messages.WorkerBoot`) and its end of the pipe (owned from here on) to its exit
    code."""
    # Ctrl-C in a terminal reaches the whole process group; the coordinator drains the workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    boot = messages.decode_boot(boot_bytes)
    config = config_module.decode(boot.config)
    log.configure_from(config.log, node=config.node.name, proc="worker", worker=worker_id)
    bridge_logging(log)
    limit_read_buffers()
    worker = Worker(worker_id, config, pipe_fd, tls=boot.tls, tls_generation=boot.tls_generation)
    try:
        import uvloop  # type: ignore[import-not-found]
    except ImportError:
        return asyncio.run(worker.run())
    return int(uvloop.run(worker.run()))


def _die_with_parent(coordinator: int | None = None) -> None:
    """Ask the kernel to kill this worker when the coordinator dies, even by SIGKILL.

    The death signal fires when the parent changes, so a worker forked by the template, whose parent is first the
    template's short-lived intermediate process, asks for it only once the coordinator (a child subreaper) has
    adopted it: when the intermediate has exited. `coordinator` is None for a worker the coordinator spawned."""
    if coordinator is not None:
        intermediate = os.getppid()
        if intermediate != coordinator:
            try:
                pidfd = os.pidfd_open(intermediate)
            except ProcessLookupError:
                pass  # exited and reaped already: the worker was adopted before
            else:
                try:
                    if os.getppid() == intermediate:  # then the pidfd is the intermediate's, not a reused pid's
                        select.select([pidfd], [], [], ADOPTION_TIMEOUT)  # readable once it has exited
                finally:
                    os.close(pidfd)
    parent = os.getppid() if coordinator is None else coordinator
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)  # the coordinator is gone already (or never adopted this worker)


class Worker:
    def __init__(
        self,
        worker_id: int,
        config: config_module.Config,
        pipe_fd: int,
        *,
        tls: TlsMaterial | None = None,
        tls_generation: int = 0,
    ) -> None:
        self.worker_id = worker_id
        self.config = config
        self._pipe_fd = pipe_fd
        # The TLS material to present (the latest the coordinator sent) and the generation presented now.
        self._tls = tls
        self._tls_generation = tls_generation
        self._tls_presented = -1
        self._tls_serial = ""
        self._writer: asyncio.StreamWriter | None = None
        self._outbox: list[bytes] = []  # frames reported in this turn of the loop, not written yet (`report`)
        self._sessions: dict[str, PeerSession] = {}
        self._closing: set[PeerSession] = set()
        self._session_ids = iter(range(os.getpid() * 1_000_000 + 1, sys.maxsize))
        self._booted = asyncio.Event()
        self._stop = asyncio.Event()
        self._shutdown_deadline = config.replication.shutdown_timeout
        self._rng = random.Random()
        self._process = psutil.Process()
        self.ctx: WorkerContext | None = None
        self._server: ReplicationServer | None = None
        self._http: aiohttp.ClientSession | None = None
        self._links: link.LinkPool | None = None
        self._admission: WorkerAdmission | None = None
        self._rounds: dict[tuple[str, str], asyncio.Task[None]] = {}  # anti-entropy rounds running, by pair
        # Databases being removed from this node (DropDatabase until ReleaseDatabase), and the task closing each.
        self._removing: set[str] = set()
        self._siblings: list[int] = []  # the node's other processes (messages.Siblings), for the commit doorbell
        self._closers: dict[str, asyncio.Task[None]] = {}
        self._repairs: dict[int, asyncio.Task[None]] = {}  # blob repairs running, by the coordinator's request

    # -- pipe ------------------------------------------------------------------------------------------------

    def report(self, message: msgspec.Struct) -> None:
        """Send `message` to the coordinator. The frames reported during one turn of the loop go out together at
        its end, in order, in one write: as a link comes up, its streams report thousands of connects, progress and
        clock readings, and a write of each was a system call of its own (a fifth of a worker's CPU in a restart
        with 1,000 databases)."""
        if self._writer is None or self._writer.is_closing():
            return
        self._outbox.append(messages.frame(message))
        if len(self._outbox) == 1:
            asyncio.get_running_loop().call_soon(self._flush_reports)

    def _flush_reports(self) -> None:
        frames, self._outbox = self._outbox, []
        if frames and self._writer is not None and not self._writer.is_closing():
            self._writer.write(b"".join(frames))

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        sock = socket.socket(fileno=self._pipe_fd)
        reader, self._writer = await asyncio.open_connection(sock=sock)
        loop.add_signal_handler(signal.SIGTERM, self._stop.set)
        self._admission = WorkerAdmission(self._ready, self._handle, loop=loop, rng=self._rng.random)
        pipe_task = loop.create_task(self._read_pipe(reader))
        try:
            try:
                await self._boot()
            except BootError as exc:
                log.error("worker_boot_failed", reason=str(exc))
                self.report(messages.BootFailed(worker=self.worker_id, reason=str(exc)))
                await self._drain_pipe()
                return EXIT_BOOT_ERROR
            self._booted.set()
            self.report(messages.Ready(worker=self.worker_id, pid=os.getpid(), links=True))
            log.info("worker_ready", pid=os.getpid())
            if self._tls_generation != self._tls_presented:
                self._apply_tls()  # a reload that arrived while the worker booted
            else:
                self._report_tls()
            heartbeat = loop.create_task(self._heartbeat())
            watch = loop.create_task(self._watch_revocations())
            stop = loop.create_task(self._stop.wait())
            assert self.ctx is not None
            trimmer = Trimmer(self.ctx.store.trim, loop=loop)
            trimmer.start()
            await asyncio.wait({stop, pipe_task}, return_when=asyncio.FIRST_COMPLETED)
            trimmer.close()
            heartbeat.cancel()
            watch.cancel()
            stop.cancel()
            await asyncio.gather(heartbeat, watch, stop, return_exceptions=True)
            await self._shutdown()
            return EXIT_OK
        finally:
            pipe_task.cancel()
            await asyncio.gather(pipe_task, return_exceptions=True)
            self._admission.close()
            if self._writer is not None:
                self._flush_reports()
                self._writer.close()

    async def _drain_pipe(self) -> None:
        self._flush_reports()
        if self._writer is not None:
            with contextlib.suppress(ConnectionError, TimeoutError):
                async with asyncio.timeout(2.0):  # not wait_for: see workers.frames.receive
                    await self._writer.drain()

    async def _read_pipe(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                message = await messages.read_to_worker(reader)
                self._on_message(message)
        except messages.PipeClosed:
            # The coordinator is gone: nobody owns this worker any more.
            log.warning("coordinator_gone")
            self._shutdown_deadline = min(self._shutdown_deadline, 2.0)
        except messages.PipeProtocolError as exc:
            log.error("pipe_protocol_error", error=str(exc))

    def _on_message(self, message: messages.ToWorker) -> None:
        try:
            self._dispatch(message)
        except Exception as exc:
            # One bad command must not end the pipe and with it the worker.
            log.error("command_failed", command=type(message).__name__, error=repr(exc))

    def _dispatch(self, message: messages.ToWorker) -> None:
        assert self._admission is not None
        match message:
            case messages.Subscribe(key=key, database=database):
                self._admission.submit(pair_key(key, database), "subscribe", message)
            case messages.Unsubscribe(key=key, database=database):
                self._admission.submit(pair_key(key, database), "unsubscribe", message)
            case messages.ForceReconnect(key=key, database=database):
                self._admission.submit(pair_key(key, database), "force_reconnect", message)
            case messages.AntiEntropy():
                self._start_round(message)
            case messages.Reconfigure(config=data):
                self.config = config_module.decode(data)
                if self.ctx is not None:
                    self.ctx.config = self.config
                    self.ctx.store.max_databases = self.config.data.max_databases
                log.info("worker_reconfigured")
            case messages.ReloadTls(generation=generation, material=material):
                self._tls, self._tls_generation = material, generation
                if self._booted.is_set():
                    self._apply_tls()
            case messages.Shutdown(deadline=deadline):
                self._shutdown_deadline = deadline
                self._stop.set()
            case messages.DropDatabase():
                self._drop_database(message)
            case messages.ReleaseDatabase(database=database):
                self._release_database(database)
            case messages.RepairBlobs():
                self._start_blob_repair(message)
            case messages.Siblings(pids=pids):
                self._siblings = pids
                if self.ctx is not None and self.ctx.doorbell is not None:
                    self.ctx.doorbell.set_siblings(pids)
            case messages.Holders(database=database, known=known):
                if self.ctx is not None and self.ctx.relays.update(database, known):
                    self.ctx.feeds.poke(database)  # the sessions' holds tasks wait on the feed when idle
            case messages.Confirmed():
                if self.ctx is not None:
                    self.ctx.waiters.answered(message)

    # -- boot and readiness ------------------------------------------------------------------------------------

    async def _boot(self) -> None:
        config = self.config
        try:
            directory = config_module.data_dir(config)
            directory.mkdir(parents=True, exist_ok=True)
            store = Store(
                directory,
                config.node.name,
                clock_lead=config.replication.max_clock_skew,
                holdings=True,
                max_databases=config.data.max_databases,
            )
            store.database(SYSTEM, create=True)
            for name in self._removing:
                store.block(name)
        except OSError as exc:
            raise BootError(f"data directory {config_module.data_dir(config)}: {exc.strerror or exc}") from None
        except Exception as exc:
            raise BootError(f"cannot open the store: {exc}") from None
        try:
            material = self._tls
            if material is None:  # started alone (tests): the files the config names
                tls = config.tls
                material = read_material(
                    config_module.resolve_path(config, tls.ca),
                    config_module.resolve_path(config, tls.cert),
                    config_module.resolve_path(config, tls.key),
                )
            server_ssl, client_ssl = contexts(material)
            authorities = material.authorities()
        except TlsConfigError as exc:
            store.close()
            raise BootError(str(exc)) from None
        self._tls_presented = self._tls_generation
        self._tls_serial = format(material.chain()[0].serial_number, "x")
        doorbell = self._doorbell(directory)
        self.ctx = WorkerContext(
            worker_id=self.worker_id,
            config=config,
            store=store,
            counters=Counters(),
            client_ssl=client_ssl,
            report=self.report,
            ca=authorities,
            doorbell=doorbell,
        )
        self.ctx.feeds.start(asyncio.get_running_loop())
        log.on_suppressed = lambda event, n: self.ctx.counters.inc(  # type: ignore[union-attr]
            "replicator_log_events_suppressed_total", event, value=n
        )
        self._server = ReplicationServer(self.ctx, server_ssl)
        try:
            await self._server.start()
        except OSError as exc:
            await self._server.close()
            await self.ctx.feeds.close()
            store.close()
            raise BootError(f"cannot listen on {config.listen.host}:{config.listen.port}: {exc.strerror}") from None
        rep = config.replication
        resolver = PinnedResolver(rep.hosts, use_dns=rep.resolve == "system")
        # limit=0: every replication session holds its connection for as long as it runs, and all the pairs to
        # one peer share a worker, so aiohttp's default pool of 100 left every pair past the 100th waiting for a
        # connection that never freed (issue 7: 51 of 150 databases never reached the peer).
        self._http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, resolver=resolver), ws_response_class=frames.SubscriberSocket
        )
        self._links = self._link_pool(self._http, self.ctx)

    def _link_pool(self, http: aiohttp.ClientSession, ctx: WorkerContext) -> link.LinkPool:
        """This worker's links: one per peer URL, each dialled offering a link first and per-pair sockets second,
        within the dial timeout of a session."""

        async def dial(url: str) -> Any:
            async with asyncio.timeout(DIAL_TIMEOUT):  # not wait_for: see workers.frames.receive
                return await dial_socket(http, ctx, url, [link.SUBPROTOCOL, wire.SUBPROTOCOL])

        return link.LinkPool(dial, frame_limit=ctx.config.replication.max_frame_bytes, report=self._report_link)

    def _report_link(self, dialled: link.Link, up: bool) -> None:
        """A link of this worker's pool opened or ended: logged, and told the coordinator, whose ladder spaces the
        dials of links and lets the streams on a live one go without a slot. `dial_started` is when its TLS
        setup began: the ladder's spacing, seen from outside."""
        peer, key = dialled.peer, dialled.key
        if up:
            log.info("connection_opened", peer=peer, worker=self.worker_id, dial_started=round(dialled.dial_started, 6))
        else:
            log.info("connection_closed", peer=peer, worker=self.worker_id, streams=dialled.opened)
        state = messages.LinkState(worker=self.worker_id, peer=peer, key=key, up=up, streams=dialled.opened)
        self.report(state)
        if up:
            for session in self._sessions.values():
                if session.sub.key == key:
                    session.peer_back()

    def _doorbell(self, directory: Path) -> Doorbell | None:
        """This worker's commit doorbell; without one, commits of the other processes reach its senders by the
        safety poll only (slower, never lost)."""
        try:
            doorbell = Doorbell(directory)
        except OSError as exc:
            log.warning("doorbell_unavailable", error=str(exc))
            return None
        doorbell.set_siblings(self._siblings)
        return doorbell

    async def _ready(self) -> None:
        await self._booted.wait()
        assert self.ctx is not None
        # The store answers: a worker whose files are locked or gone is not ready to take subscriptions.
        self.ctx.store.database(SYSTEM, create=True).last_seq()

    # -- TLS material (coordinator.credentials) -------------------------------------------------------------------

    def _apply_tls(self) -> None:
        """Present the material of the latest ReloadTls from the next handshake on, inbound and outbound; the
        sessions open now go on with the contexts they were made with."""
        assert self.ctx is not None and self._server is not None and self._tls is not None
        generation = self._tls_generation
        try:
            server_ssl, client_ssl = contexts(self._tls)
            authorities = self._tls.authorities()
            serial = format(self._tls.chain()[0].serial_number, "x")
        except (TlsConfigError, ValueError) as exc:
            log.error("worker_tls_reload_failed", generation=generation, error=str(exc))
            self.report(
                messages.TlsLoaded(
                    worker=self.worker_id, generation=generation, serial=self._tls_serial, error=str(exc)
                )
            )
            return
        self._server.use_tls(server_ssl)
        self.ctx.client_ssl = client_ssl
        self.ctx.trust(authorities)  # registry rows and revocations are checked against the new bundle
        self._tls_presented, self._tls_serial = generation, serial
        log.info("worker_tls_reloaded", generation=generation, serial=serial)
        self._report_tls()

    def _report_tls(self) -> None:
        self.report(messages.TlsLoaded(worker=self.worker_id, generation=self._tls_presented, serial=self._tls_serial))

    # -- commands ----------------------------------------------------------------------------------------------

    def _handle(self, action: str, message: Any) -> None:
        assert self.ctx is not None and self._http is not None
        pk = pair_key(message.key, message.database)
        session = self._sessions.get(pk)
        if action == "subscribe":
            if session is None:
                session = PeerSession(
                    self.ctx, self._http, message, self._next_session_id, self._rng.random, links=self._links
                )
                self._sessions[pk] = session
                session.start()
            else:
                session.update(message)
            self.report(
                messages.SubscribeAccepted(
                    key=message.key,
                    database=message.database,
                    dispatch=message.dispatch,
                )
            )
        elif action == "unsubscribe" and session is not None:
            del self._sessions[pk]
            self._retire(session)
        elif action == "force_reconnect" and session is not None:
            session.force_reconnect(message.session, message.reason or "forced by the coordinator")

    # -- anti-entropy --------------------------------------------------------------------------------------------

    def _start_round(self, message: messages.AntiEntropy) -> None:
        pk = pair_key(message.key, message.database)
        session = self._sessions.get(pk)
        done = messages.AntiEntropyDone(
            key=message.key, database=message.database, round=message.round, peer=session.peer if session else ""
        )
        if self.ctx is None or self._http is None or session is None or not session.connected:
            done.error = "the pair's session is not connected"
            self.report(done)
            return
        pair = (message.key, message.database)
        if pair in self._rounds:
            done.error = "a round of this pair is still running"
            self.report(done)
            return
        task = asyncio.get_running_loop().create_task(self._round(message, session), name=f"antientropy {pk}")
        self._rounds[pair] = task
        task.add_done_callback(lambda _: self._rounds.pop(pair, None))

    async def _round(self, message: messages.AntiEntropy, session: PeerSession) -> None:
        assert self.ctx is not None and self._http is not None
        ctx = self.ctx
        settings = ctx.config.replication
        done = messages.AntiEntropyDone(
            key=message.key, database=message.database, round=message.round, peer=session.peer
        )
        try:
            db = ctx.store.database(message.database)
            transport = _https_transport(self._http, session.sub.url, ctx)
            round_ = antientropy.Round(
                db,
                transport,
                rate=settings.antientropy_rate,
                ceiling=lambda: int((ctx.wall() + settings.max_clock_skew) * 1_000_000),
                ca=ctx.ca,
                verifier=ctx.verifier,
                blobs=blobs.for_round(ctx, self._http, message.database, session.sub.url, session.peer),
                limits=antientropy.Limits(seconds=message.timeout or None),
            )
            result = await round_.run()
            report_claims(ctx, session.peer, message.database, result)
        except Exception as exc:  # a round must never take the worker down; the coordinator logs the reason
            done.error = f"{type(exc).__name__}: {exc}"
        else:
            done.buckets_compared = result.buckets_compared
            done.divergent_buckets = result.divergent_buckets
            done.repaired = result.repaired
            done.bytes_exchanged = result.bytes_exchanged
            done.queries = result.queries
            done.seconds = round(result.seconds, 6)
            done.error = result.error
            done.limit = result.limit
        self.report(done)

    # -- blob repair (workers.blob_repair) -------------------------------------------------------------------------

    def _start_blob_repair(self, message: messages.RepairBlobs) -> None:
        if self.ctx is None or self._http is None:
            self.report(
                messages.BlobsRepaired(database=message.database, request=message.request, error="worker not booted")
            )
            return
        task = asyncio.get_running_loop().create_task(self._blob_repair(message), name=f"repair {message.database}")
        self._repairs[message.request] = task
        task.add_done_callback(lambda _: self._repairs.pop(message.request, None))

    async def _blob_repair(self, message: messages.RepairBlobs) -> None:
        assert self.ctx is not None and self._http is not None
        try:
            answer = await blob_repair.repair_database(self.ctx, self._http, message, self._rng.random)
        except Exception as exc:  # a repair must never take the worker down; the answer says why it stopped
            answer = messages.BlobsRepaired(
                database=message.database, request=message.request, error=f"{type(exc).__name__}: {exc}"
            )
        self.report(answer)

    # -- databases removed from this node (coordinator.drops) ---------------------------------------------------

    def _drop_database(self, message: messages.DropDatabase) -> None:
        """Stop opening the database at once; end its sessions and close it, then answer DatabaseClosed."""
        name = message.database
        self._removing.add(name)
        closed = messages.DatabaseClosed(database=name, worker=self.worker_id, pid=os.getpid(), request=message.request)
        if self.ctx is None:
            self.report(closed)  # not booted: nothing is open, and the store blocks it from the start
            return
        self.ctx.store.block(name)
        previous = self._closers.pop(name, None)
        if previous is not None:
            previous.cancel()
        task = asyncio.get_running_loop().create_task(self._close_database(name, closed), name=f"close {name}")
        self._closers[name] = task
        task.add_done_callback(lambda done: self._closers.pop(name, None) if self._closers.get(name) is done else None)

    async def _close_database(self, name: str, closed: messages.DatabaseClosed) -> None:
        assert self.ctx is not None and self._server is not None
        ctx = self.ctx
        for pk, session in list(self._sessions.items()):
            if session.database == name:
                del self._sessions[pk]
                self._retire(session)
        rounds = [task for (_, database), task in self._rounds.items() if database == name]
        for task in rounds:
            task.cancel()
        await asyncio.gather(
            *(session.wait_closed() for session in list(self._closing) if session.database == name),
            *rounds,
            self._server.close_database(name),
            return_exceptions=True,
        )
        await ctx.feeds.discard(name)
        ctx.store.forget(name)
        ctx.forget(name)
        self.report(closed)

    def _release_database(self, name: str) -> None:
        self._removing.discard(name)
        closer = self._closers.pop(name, None)
        if closer is not None:
            closer.cancel()  # the coordinator gave up waiting: nothing may close the handle in use from now on
        if self.ctx is not None:
            self.ctx.store.unblock(name)

    def _retire(self, session: PeerSession, going_away: bool = False) -> None:
        session.stop(going_away)
        self._closing.add(session)
        task = asyncio.get_running_loop().create_task(session.wait_closed())
        task.add_done_callback(lambda _: self._closing.discard(session))

    def _next_session_id(self) -> int:
        return next(self._session_ids)

    # -- heartbeat and shutdown --------------------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        assert self.ctx is not None
        loop = asyncio.get_running_loop()
        last_idle_flush = loop.time()
        while True:
            now = loop.time()
            idle_flush = now - last_idle_flush >= IDLE_PROGRESS_INTERVAL
            if idle_flush:
                last_idle_flush = now
            for session in self._sessions.values():
                if session.dirty or (idle_flush and session.connected):
                    session.flush_progress()
            for database, count in self.ctx.store.take_checksum_failures().items():
                self.ctx.counters.inc("replicator_checksum_failures_total", database, value=count)
            caught = self.ctx.feeds.take_caught_by_poll()
            if caught:
                self.ctx.counters.inc("replicator_commits_caught_by_poll_total", value=caught)
            log.flush()
            self.report(
                messages.Heartbeat(
                    worker=self.worker_id,
                    rss_bytes=self._process.memory_info().rss,
                    counters=self.ctx.counters.drain(),
                    histograms=self.ctx.counters.drain_histograms(),
                )
            )
            await asyncio.sleep(HEARTBEAT_INTERVAL)

    async def _watch_revocations(self) -> None:
        """Whenever the registry changes, end every session, inbound or outbound, whose peer's certificate is now
        revoked: within REVOCATION_CHECK of the revocation arriving here."""
        assert self.ctx is not None and self._server is not None
        seen: tuple[int, int] = (-1, -1)
        while True:
            await asyncio.sleep(REVOCATION_CHECK)
            try:
                # A new CA bundle changes which revocations verify: looked at again as a registry change is.
                version = (self.ctx.store.database(SYSTEM, create=True).data_version(), self.ctx.trust_changes)
                if version == seen:
                    continue
                seen = version
                await self._server.close_revoked()
                if self._links is not None:
                    await self._links.close_where(self._revoked_link)
                for session in list(self._sessions.values()):
                    identity = session.server_identity
                    reason = self.ctx.revoked(identity) if identity is not None and session.connected else None
                    if reason is not None:
                        log.warning("session_revoked", peer=identity.name, serial=identity.serial, reason=reason)
                        session.force_reconnect(None, f"the server's {reason}")
            except Exception as exc:  # the watch must outlive a bad registry read
                log.warning("revocation_check_failed", error=repr(exc), sample_by=())

    def _revoked_link(self, dialled: link.Link) -> str | None:
        """Why a dialled link's server may no longer be spoken to (its certificate is revoked), or None."""
        assert self.ctx is not None
        identity = peer_identity(dialled.ws.get_extra_info("ssl_object"))
        reason = self.ctx.revoked(identity) if identity is not None else None
        if reason is not None:
            log.warning("link_revoked", peer=identity.name, serial=identity.serial, reason=reason)
        return None if reason is None else f"the server's {reason}"

    async def _shutdown(self) -> None:
        """Drain: close every session with going-away, commit what is applied, stop serving, within the deadline."""
        log.info("worker_stopping", deadline_s=self._shutdown_deadline)
        if self._server is not None:
            # First: a peer whose session gets going-away below redials at once, and must not land here again.
            self._server.stop_accepting()
        for task in [*self._rounds.values(), *self._closers.values(), *self._repairs.values()]:
            task.cancel()
        for session in list(self._sessions.values()):
            self._retire(session, going_away=True)
        self._sessions.clear()
        pending = [s.wait_closed() for s in list(self._closing)]
        closers = [*pending]
        if self._server is not None:
            closers.append(self._server.close())
        try:
            async with asyncio.timeout(self._shutdown_deadline):  # not wait_for: see workers.frames.receive
                await asyncio.gather(*closers, return_exceptions=True)
        except TimeoutError:
            log.warning("worker_drain_timeout", deadline_s=self._shutdown_deadline)
        if self._links is not None:
            await self._links.close()
        if self._http is not None:
            await self._http.close()
        if self.ctx is not None:
            await self.ctx.feeds.close()
            if self.ctx.counters is not None:
                self.report(
                    messages.Heartbeat(
                        worker=self.worker_id,
                        rss_bytes=self._process.memory_info().rss,
                        counters=self.ctx.counters.drain(),
                        histograms=self.ctx.counters.drain_histograms(),
                    )
                )
            self.ctx.store.close()
        await self._drain_pipe()


MAX_REPLY_BYTES = 64 * 1024 * 1024
ROUND_REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=60)


def _https_transport(http: aiohttp.ClientSession, url: str, ctx: WorkerContext) -> antientropy.Transport:
    """Anti-entropy queries to the peer at `url` (its wss:// URL), over HTTPS with this node's certificate."""
    scheme, _, rest = url.partition("://")
    endpoint = f"{'http' if scheme == 'ws' else 'https'}://{rest.rstrip('/')}/replication/antientropy"

    async def transport(body: bytes) -> bytes:
        try:
            async with http.post(
                endpoint,
                data=body,
                ssl=ctx.client_ssl,
                timeout=ROUND_REQUEST_TIMEOUT,
                headers={"Content-Type": "application/msgpack"},
            ) as response:
                chunks: list[bytes] = []
                size = 0
                async for chunk in response.content.iter_chunked(1 << 16):
                    size += len(chunk)
                    if size > MAX_REPLY_BYTES:
                        raise antientropy.PeerError(f"{endpoint}: an answer over {MAX_REPLY_BYTES} bytes")
                    chunks.append(chunk)
                data = b"".join(chunks)
                if response.status != 200:
                    raise antientropy.PeerError(f"{endpoint} answered {response.status}: {error_text(data[:1024])}")
                return data
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise antientropy.PeerError(f"{endpoint}: {exc or type(exc).__name__}") from None

    return transport


def report_claims(ctx: WorkerContext, peer: str, database: str, result: antientropy.RoundResult) -> None:
    """Log and count what a round refused: registry rows that do not verify, records under our origin that we
    never wrote (and how many we wrote again as our own)."""
    for name, reason, limit in result.refused_rows:
        note_refused_row(ctx, peer, name, reason, limit)
    if result.foreign:
        ctx.counters.inc("replicator_foreign_origin_refusals_total", peer, database, value=result.foreign)
        log.warning(
            "foreign_origin_refused",
            peer=peer,
            database=database,
            records=result.foreign,
            reasserted=result.reasserted,
            reason="the peer holds records under this node's origin at versions it never wrote",
            sample_by=("peer", "database"),
        )
