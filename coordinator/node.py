"""The coordinator: one per node. Decides who is connected to whom, on which worker and when; never touches data.

    boot: data directory, store, certificates, port probe, admin HTTP, workers
    registry watcher -> on_node_update -> on_database -> setup scheduler -> dispatch (subscribe on a worker)
    worker reports (connected, disconnected, progress) -> replication map
    reconcile loop: truth pass, stale workers, wedged pairs, stalled receivers
    anti-entropy: a round per pair on its schedule (on the pair's worker), a scrub per held database
    signals: SIGTERM/SIGINT drain and exit; SIGHUP reloads peers, thresholds, the worker count and the TLS files

Exit codes: 0 after a clean shutdown, 3 when the node cannot boot (or a worker cannot).
"""

from __future__ import annotations

import asyncio
import errno
import functools
import random
import signal
import socket
import time
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from replicator.coordinator import credentials, filecheck, registry, scaling
from replicator.coordinator.admin import AdminServer
from replicator.coordinator.antientropy import AntiEntropy
from replicator.coordinator.blob_repairs import BlobRepairs
from replicator.coordinator.confirmations import Confirmations
from replicator.coordinator.credentials import Credentials
from replicator.coordinator.database_limit import DatabaseLimit
from replicator.coordinator.drops import Drops
from replicator.coordinator.links import Link, Links
from replicator.coordinator.metrics import Metrics
from replicator.coordinator.reachability import unreachable_from_peers
from replicator.coordinator.recovery import Recoveries
from replicator.coordinator.registry import SYSTEM, NodeView
from replicator.coordinator.reload_health import ReloadHealth
from replicator.coordinator.replication_map import Entry, PairState, ReplicationMap, StallWatch, should_fire_stall_kick
from replicator.coordinator.retention import Retention
from replicator.coordinator.routing import Router
from replicator.coordinator.sd_notify import Notifier, StartExtension, status_text
from replicator.coordinator.setup_scheduler import SetupScheduler
from replicator.coordinator.supervisor import RESPAWN_HEALTHY_UPTIME, PauseMonitor, Supervisor, WorkerHandle
from replicator.coordinator.template import WorkerTemplate
from replicator.shared import config as config_module
from replicator.shared import membership, messages, revocation
from replicator.shared.backoff import Backoff
from replicator.shared.config import Config, ConfigError, PeerSection
from replicator.shared.data_lock import DataDirInUse, DataLock
from replicator.shared.keys import connection_key, normalize_url
from replicator.shared.logs import LOGGED_NAMES, log
from replicator.shared.memory import Trimmer
from replicator.shared.notify import Doorbell
from replicator.shared.store import Database, NodeRow, Store, UnknownDatabase
from replicator.shared.tls import PeerIdentity, TlsConfigError

EXIT_OK = 0
EXIT_BOOT_ERROR = 3
BOOT_TIMEOUT = 60.0
REGISTRY_POLL = 0.2
WATCHER_HEALTHY_UPTIME = 10.0
# A copy slower than this (MB/s) after SLOW_COPY_AFTER seconds, with more than that left, is logged (`copy_slow`).
SLOW_COPY_MB_S = 10.0
SLOW_COPY_AFTER = 30.0


class BootError(Exception):
    """The node cannot start; the message says what to fix."""


class Node:
    def __init__(
        self,
        config: Config,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        rng: Callable[[], float] | None = None,
        cli_workers: int | None = None,
        supervisor: Supervisor | None = None,
        check_integrity: bool = False,
        routes: list[PeerSection] | None = None,
        worker_template: WorkerTemplate | None = None,
    ) -> None:
        # Static routes for this run only (`replicator clone` dials its leader), on top of the file's [[peers]]:
        # kept across reloads, and given up for a route of the same name the file gains.
        self._run_routes = list(routes or [])
        config.peers = _with_routes(config.peers, self._run_routes)
        self.config = config
        # `run --check-integrity`: the boot check of the database files runs integrity_check, not quick_check.
        self._check_integrity = check_integrity
        # `run --workers N` wins over the file until the file's own node.workers changes.
        self._cli_workers = cli_workers
        self._file_workers = config.node.workers
        self.loop = loop or asyncio.get_event_loop()
        self.rng = rng or random.Random().random
        self.wall = time.time
        self.map = ReplicationMap()
        self.metrics = Metrics(self)
        self.notifier = Notifier.from_environment()
        self._announced_ready = False  # READY=1 was sent: a reload is announced (RELOADING=1, then READY=1)
        self.store: Store | None = None
        self.doorbell: Doorbell | None = None
        # The TLS material the node presents and trusts, as loaded at boot or by the latest reload (never the files
        # as they are now), and what each worker reported presenting (coordinator.credentials).
        self.credentials: Credentials | None = None
        self.worker_tls: dict[int, messages.TlsLoaded] = {}
        self.reload_health = ReloadHealth(self.wall())
        self.supervisor = supervisor or Supervisor(
            self._worker_boot,
            self.on_worker_message,
            self.on_worker_exit,
            self._on_boot_error,
            loop=self.loop,
            rng=self.rng,
            template=worker_template,
        )
        # Per (worker, connection key): whether the worker's link is up and when a dial last went out to it; which
        # setups take a ladder slot (`Links.needs_slot`).
        self.links = Links(self._link_of)
        self.scheduler = self._new_scheduler()
        # One sweep for every path that dispatches (registry, stale workers, wedge re-drives, scaling): any two
        # dispatches keep `stagger` apart, whichever paths they come from (invariant 2).
        self.ladder = self.scheduler.sweep()
        self.views: dict[str, NodeView] = {}
        self.holds: set[str] = set()
        # The databases peers' rows may make this node create: data.max_databases, held and planned together.
        self.database_limit = DatabaseLimit()
        # Registry rows are signed (shared.membership): ours with our key, each checked against the cluster CA.
        self.signer: membership.Signer | None = None
        self.verifier = membership.Verifier(None)
        self._revocations: list[revocation.Revocation] = []
        self._revocations_seen = -1
        self._own_revoked: str | None = None  # why this node's certificate is revoked, once logged
        self.antientropy = AntiEntropy(self, loop=self.loop, rng=self.rng)
        self.blob_repairs = BlobRepairs(self.supervisor, loop=self.loop)  # admin POST /repair/blobs, run by workers
        self.drops = Drops(self, loop=self.loop)  # databases deleted cluster-wide, applied to this node's files
        self.retention = Retention(self)  # audit pruning and tombstone purges (coordinator.retention)
        self.router = Router(config.replication.failover_after, self._on_route_change, loop=self.loop)
        # Databases whose routes changed this turn of the loop, and the callback that renews their pairs once for
        # all of them (`_on_route_change`).
        self._rerouted: dict[str, None] = {}  # in the order their routes changed
        self._reroute: asyncio.Handle | None = None
        # A respawned worker's share of the pairs comes back once it has stayed up (`_on_respawned`), by slot.
        self._rebalances: dict[int, asyncio.TimerHandle] = {}
        # Databases whose file may lack this node's own writes (lost, adopted, gone back in time), until every peer
        # has served them back (coordinator.recovery).
        self.recoveries = Recoveries()
        self.peer_clock: dict[str, float] = {}  # peer -> its wall clock minus ours, from the last handshake
        # peer -> when (loop time) a session with it was last seen up, either way (`GET /nodes`, `replicator node list`)
        self.peer_seen: dict[str, float] = {}
        # (database, peer) -> what the peer holds complete of each origin, as our senders last saw it acknowledged:
        # a tombstone is purged only once every holder has it.
        self.peer_holds: dict[tuple[str, str], dict[str, int]] = {}
        # What every other node holds complete, directly and relayed, and the writes waiting for confirmations.
        self.confirmations = Confirmations(
            self.name, self.loop, send=self.supervisor.send, slots=lambda: list(self.supervisor.workers)
        )
        # (peer, database) -> the sending end of the pair, as this node's sender last reported it (`/status`).
        self.sending: dict[tuple[str, str], messages.Sending] = {}
        self._registry_synced = False
        # The next registry pass looks at every node again, not only at those whose view changed (sync_registry).
        self._sync_all = True
        # A database was opened: the own row (which lists what the node holds) is written on the registry loop's
        # next turn, so a burst of new databases is one row, not one row (and one registry change) each.
        self._own_row_stale = False
        # The views were built from a registry this node holds whole (its system database is not recovering):
        # only then can "no peer holds this database" be believed.
        self._registry_trusted = False
        self._dispatches = 0
        self._placements = 0
        self.reassignments = 0
        self.redrives = {"wedge": 0, "stall": 0}
        self.stalls: dict[str, int] = {}  # peer -> pairs found stalled and renewed (replicator_pair_stalls_total)
        self.exit_code = EXIT_OK
        self.boot_error = ""
        self._stop = asyncio.Event()
        self._registry_poke = asyncio.Event()
        self._ready = asyncio.Event()
        self.worker_ready = asyncio.Event()  # set on every worker's Ready; scaling waits on it
        self._closing = False
        self._tasks: list[asyncio.Task[Any]] = []
        # Databases opened only to read their recovering flag (`_note_database`), closed again off the loop.
        self._to_release: set[str] = set()
        self._releasing: asyncio.Task[None] | None = None
        self._admin: AdminServer | None = None
        self._data_lock: DataLock | None = None  # held from the boot on: no restore or second node on the directory
        # Time this process itself did not run is not time the workers were silent (the heartbeat watchdog).
        self.pauses = PauseMonitor(self.loop)
        # Idle databases' page caches and the allocator's free pages go back to the OS (shared.memory).
        self.trimmer = Trimmer(lambda: self.store.trim() if self.store is not None else 0, loop=self.loop)

    def _new_scheduler(self) -> SetupScheduler:
        rep = self.config.replication
        return SetupScheduler(
            self._dispatch,
            loop=self.loop,
            rng=self.rng,
            floor=0.2,
            initial=0.4,
            maximum=30.0,
            stagger=rep.stagger,
            on_armed=self._on_setup_armed,
            links=self.links,
        )

    def _link_of(self, peer_url: str, database: str) -> Link | None:
        """The link a setup of the pair would go over now: its placed worker and the peer's key (`Links`)."""
        key = connection_key(peer_url)
        entry = self.map.get(key)
        pair = entry.pairs.get(database) if entry is not None else None
        if pair is None or not self.supervisor.is_live(pair.placed):
            return None
        return (pair.placed, key)

    def _at_slot_unless_linked(
        self, link: Link | None, delay: float, callback: Callable[..., object], *args: Any
    ) -> Any:
        """A timer for a force-reconnect over `link`: on a live link (`Links.needs_slot`) a plain one, else a slot of
        the ladder. The callback gets `slotted` (whether it holds a slot) after `args`."""
        if self.links.needs_slot(link, self.loop.time()):
            return self.scheduler.call_at_slot(self.ladder, delay, callback, *args, True)
        return self.loop.call_later(delay, callback, *args, False)

    @property
    def name(self) -> str:
        return self.config.node.name

    def system(self) -> Database:
        assert self.store is not None
        return self.store.database(SYSTEM, create=True)

    # -- run ----------------------------------------------------------------------------------------------------

    async def run(self) -> int:
        try:
            await self._boot()
        except BootError as exc:
            log.error("boot_failed", reason=str(exc))
            await self._close_boot()
            return EXIT_BOOT_ERROR
        for sig, action in (
            (signal.SIGTERM, self.request_stop),
            (signal.SIGINT, self.request_stop),
            (signal.SIGHUP, self.request_reload),
        ):
            self.loop.add_signal_handler(sig, action)
        self._tasks.append(self.loop.create_task(self._await_ready(), name="await ready"))
        self._tasks.append(self.loop.create_task(self.notifier.status_loop(self.status_text), name="sd status"))
        await self._stop.wait()
        await self._shutdown()
        # Drained: a second SIGTERM between here and the exit must not turn a clean stop into a kill.
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.remove_signal_handler(sig)
            signal.signal(sig, signal.SIG_IGN)
        return self.exit_code

    async def _boot(self) -> None:
        config = self.config
        directory = config_module.data_dir(config)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            probe = directory / ".write-probe"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise BootError(f"data directory {directory} is not writable: {exc.strerror or exc}") from None
        try:
            self._data_lock = DataLock.take(directory)
        except DataDirInUse as exc:
            raise BootError(str(exc)) from None
        try:
            loaded = Credentials(credentials.read(config), generation=1, loaded_at=self.wall())
        except TlsConfigError as exc:
            raise BootError(str(exc)) from None
        readable = config_module.readable_secrets(config.source) if config.source else None
        if readable is not None:
            log.warning("config_readable", path=readable.path, mode=readable.octal, keys=list(readable.keys))
        try:
            self.signer = loaded.signer(self.name)
        except (ValueError, TypeError) as exc:
            raise BootError(f"cannot load the certificate that signs this node's registry row: {exc}") from None
        self.credentials = loaded
        self.verifier = membership.Verifier(loaded.cas)
        _probe_port(config.listen.host, config.listen.port)
        # Before any process opens a database: a damaged file halts the boot here, naming it, or is moved aside.
        # A check of many files (or of large ones with --check-integrity) may outlast the unit's TimeoutStartSec:
        # systemd is asked for more time while it makes progress.
        extension = StartExtension(self.notifier)
        extending = self.loop.create_task(extension.run(), name="extend start timeout")
        try:
            checked, moved = await asyncio.to_thread(
                filecheck.check_databases,
                directory,
                full=self._check_integrity,
                recover=config.replication.recover_damaged,
                wall=self.wall,
                progress=extension.step,
            )
        except (filecheck.DamagedFiles, filecheck.Unreadable, OSError) as exc:
            raise BootError(str(exc)) from None
        finally:
            extending.cancel()
            await asyncio.gather(extending, return_exceptions=True)
        log.info("database_files_checked", files=checked, check="integrity" if self._check_integrity else "quick")
        try:
            self.store = Store(directory, self.name, clock_lead=config.replication.max_clock_skew, holdings=True)
            # Registry rows and drops committed here wake the workers' senders (shared.notify).
            self.doorbell = Doorbell(directory, hears=False)
            self.store.on_commit = self.doorbell.ring
            self.supervisor.doorbell = self.doorbell
            system = self.system()
            # Every file here is one this node holds (a damaged one moved aside included): a file of the name made
            # later, the one that replaces it now included, is a lost one to recover, not a new database.
            self.store.note_held(sorted(set(self.store.names()) | {damage.database for damage in moved}))
            for damage in moved:
                # Created empty, it starts recovering: the peers serve it back.
                self.store.database(damage.database, create=True)
            self.holds = set(self.store.names()) | {SYSTEM}
            open_before = self.store.opened()
            for database in sorted(self.holds):
                self.database_limit.held(database)
                self._note_database(database, open_before)
        except Exception as exc:
            raise BootError(f"cannot open the store in {directory}: {exc}") from None
        self._adopt_introductions(system)
        self._write_own_row(system)
        self._admin = AdminServer(self)
        try:
            await self._admin.start()
        except OSError as exc:
            listen = config.listen
            raise BootError(
                f"cannot listen on the admin port {listen.admin_host}:{listen.admin_port}: {exc.strerror}"
            ) from None
        if unreachable_from_peers(config.listen.host, config.node.url) is not None:
            log.warning("listen_unreachable", listen_host=config.listen.host, url=config.node.url)
        log.info(
            "node_starting",
            node=self.name,
            url=config.node.url,
            workers=config.worker_count,
            port=config.listen.port,
            admin_port=config.listen.admin_port,
        )
        self.supervisor.start(config.worker_count)

    async def _close_boot(self) -> None:
        if self._admin is not None:
            await self._admin.close()
        if self.store is not None:
            self.store.close()
        if self.doorbell is not None:
            self.doorbell.close()
        if self._data_lock is not None:
            self._data_lock.release()

    async def _await_ready(self) -> None:
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancellation (SIGTERM's) that lands as
            # the event is set, and the node would never stop.
            async with asyncio.timeout(BOOT_TIMEOUT):
                await self._ready.wait()
        except TimeoutError:
            log.error("boot_timeout", waited_s=BOOT_TIMEOUT)
            self.exit_code = EXIT_BOOT_ERROR
            self.request_stop()
            return
        if self._closing:
            return  # stopped while the workers came up: nothing more starts
        log.info("node_ready", node=self.name, workers=len(self.supervisor.live()))
        self.notifier.status(self.status_text(), "READY=1")
        self._announced_ready = True
        self._tasks.append(self.loop.create_task(self._registry_loop(), name="registry watcher"))
        self._tasks.append(self.loop.create_task(self._reconcile_loop(), name="reconcile"))
        self._tasks.append(self.loop.create_task(self.notifier.watchdog_loop(), name="watchdog"))
        self._tasks.append(self.loop.create_task(self.retention.run(), name="retention"))
        self.antientropy.start()
        self.drops.start()
        self.pauses.start()
        self.trimmer.start()

    def status_text(self) -> str:
        """systemd's STATUS= line: workers ready of those wanted, pairs connected of those wanted."""
        pairs = [pair for entry in self.map for pair in entry.pairs.values()]
        return status_text(
            ready=self._ready.is_set(),
            workers_ready=len(self.supervisor.live()),
            workers=self.config.worker_count,
            pairs_connected=sum(1 for pair in pairs if pair.connected),
            pairs=len(pairs),
        )

    def _worker_boot(self) -> bytes:
        """What a worker starts from: the config, and the TLS material the node loaded (`messages.WorkerBoot`)."""
        config = config_module.encode(self.config)
        if self.credentials is None:
            return messages.encode_boot(messages.WorkerBoot(config=config))
        return self.credentials.boot(config)

    def request_stop(self) -> None:
        self._stop.set()

    def request_reload(self) -> None:
        self._tasks.append(self.loop.create_task(self._reload(), name="reload"))

    async def _shutdown(self) -> None:
        self._closing = True
        deadline = self.config.replication.shutdown_timeout
        log.info("node_stopping", deadline_s=deadline)
        self.notifier.notify("STOPPING=1")
        self.pauses.close()
        self.trimmer.close()
        # A task started while the others stopped (the readiness wait's, say) is cancelled too.
        while self._tasks:
            tasks, self._tasks = self._tasks, []
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await self.antientropy.close()
        await self.drops.close()
        for entry in self.map:
            entry.disarm()
        if self._reroute is not None:
            self._reroute.cancel()
            self._reroute = None
        for timer in self._rebalances.values():
            timer.cancel()
        self._rebalances.clear()
        self.router.close()
        self.confirmations.close()
        await self.supervisor.stop(max(1.0, deadline - 1.0))
        if self._admin is not None:
            await self._admin.close()
        if self.store is not None:
            self.store.close()
        if self.doorbell is not None:
            self.doorbell.close()
        if self._data_lock is not None:
            self._data_lock.release()  # the workers are gone: a restore may replace the files now
        log.info("node_stopped", code=self.exit_code)

    # -- own row and registry -----------------------------------------------------------------------------------

    def _write_own_row(self, system: Database) -> None:
        """Sign and write this node's own row when it is missing, not signed with our current certificate, or
        says something else than the config and the databases we hold."""
        self._own_row_stale = False
        if self.signer is None:
            return
        # A certificate the cluster revoked writes nothing: every node ignores the rows it signs, and a row written
        # again after `node remove --revoke` deleted it would only linger as a revoked row on the nodes it reached.
        identity = self.signer.identity
        if identity is not None and (reason := self.revoked(identity)) is not None:
            if self._own_revoked != reason:
                log.error("own_certificate_revoked", reason=reason, serial=identity.serial)
            self._own_revoked = reason
            return
        self._own_revoked = None
        current = self.verifier.own_row(system, self.name)
        wanted = NodeRow(
            name=self.name,
            url=self.config.node.url,
            databases=list(self.config.replication.databases),
            replicates=self.config.replication.mesh,
            leader=current[0].leader if current else False,
            holds=sorted(self.holds),
        )
        if current is not None and current[1] == self.signer.cert_der:
            row = current[0]
            if (row.url, sorted(row.holds), row.replicates, list(row.databases)) == (
                wanted.url,
                wanted.holds,
                wanted.replicates,
                wanted.databases,
            ):
                return
        membership.write(system, self.signer, membership.NODES, wanted)

    def _adopt_introductions(self, system: Database) -> None:
        """Rows an operator wrote through this node before registry rows were signed (unsigned rows of other
        nodes under our origin) become this node's signed introductions, so the nodes they name stay known."""
        if self.signer is None:
            return
        introduced = {entry.id for entry in system.scan(membership.INTRODUCTIONS, None, 100_000, skip_damaged=True)}
        for entry in system.scan(membership.NODES, None, 100_000, skip_damaged=True):
            if entry.origin != self.name or entry.id == self.name or entry.id in introduced:
                continue
            row = membership.legacy_row(entry)
            if row is not None:
                membership.write(system, self.signer, membership.INTRODUCTIONS, row)
                log.info("introduction_adopted", name=entry.id)

    def revoked(self, identity: PeerIdentity) -> str | None:
        """Why a certificate may not be used, if a revocation the cluster CA signed revokes it."""
        return revocation.revoked_by(self.revocations(), identity)

    def revocations(self) -> list[revocation.Revocation]:
        """Every revocation the cluster CA signed that the registry holds."""
        system = self.system()
        seen = system.data_version()
        if seen != self._revocations_seen:
            ca = self.verifier.ca
            self._revocations = revocation.stored(system, ca) if ca is not None else []
            self._revocations_seen = seen
        return self._revocations

    def poke_registry(self, full: bool = True) -> None:
        """Run a registry pass now; `full`: over every node, not only those whose view changed (sync_registry)."""
        if full:
            self._sync_all = True
        self._registry_poke.set()

    async def _registry_loop(self) -> None:
        backoff = Backoff(initial=1.0, maximum=30.0, jitter="full", rng=self.rng, clock=self.loop.time)
        while True:
            came_up_at: float | None = None
            try:
                system = self.system()
                last_version: int | None = None
                self._sync_all = True
                while True:
                    version = system.data_version()
                    if version != last_version or self._registry_poke.is_set() or self._own_row_stale:
                        self._registry_poke.clear()
                        last_version = version
                        self.sync_registry(system)
                        self.drops.poke()
                    if came_up_at is None:
                        came_up_at = self.loop.time()
                    elif self.loop.time() - came_up_at >= WATCHER_HEALTHY_UPTIME:
                        backoff.reset()
                    try:
                        async with asyncio.timeout(REGISTRY_POLL):  # not wait_for: see _await_ready
                            await self._registry_poke.wait()
                    except TimeoutError:
                        pass
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # Progress is an iteration that stayed live after it came up; one that came up and threw at
                # once is a failure like any other.
                if came_up_at is not None and self.loop.time() - came_up_at >= WATCHER_HEALTHY_UPTIME:
                    backoff.reset()
                delay = backoff.next_delay()
                assert delay is not None
                log.warning("registry_watcher_failed", error=repr(exc), retry_in_s=round(delay, 3))
                await asyncio.sleep(delay)

    def sync_registry(self, system: Database) -> None:
        """Bring the pairs in line with the registry. Only the nodes whose view changed are looked at, unless the
        registry was poked (or the watcher started): what else an unchanged view's pairs depend on has its own path
        that pokes (a reload, a database removed or kept, the system database recovered) or sets the pairs up
        itself (routes, regressions, workers). A pass over every pair on each registry change would cost
        O(pairs) per new row, and new rows come with every database a peer opens."""
        full, self._sync_all = self._sync_all, False
        self._write_own_row(system)
        rows, versions = self.verifier.read(system, self.revoked)
        views = registry.merge(rows, versions, self.config)
        previous = self.views
        self.views = views
        changed = {name for name, view in views.items() if previous.get(name) != view}
        for name in sorted(set(previous) - set(views)):
            self.on_node_removed(name)
        for name in sorted(views):
            if name != self.name and (full or name in changed):
                self.on_node_update(views[name], event=name in changed)
        self._registry_synced = True
        self._registry_trusted = SYSTEM not in self.recoveries
        self.check_recoveries()

    def _direct_peers(self, database: str) -> list[str]:
        return sorted(
            name
            for name, view in self.views.items()
            if registry.dials(self.config, view) and database in registry.databases_for(self.config, view)
        )

    def on_node_update(self, view: NodeView, event: bool = True) -> None:
        entry = self.map.by_peer(view.name)
        if not registry.dials(self.config, view):
            self.database_limit.forget_peer(view.name)
            if entry is not None:
                self._drop_entry(entry, "not replicated with")
            return
        if entry is not None and entry.url != view.url:
            # Same name, new address: nothing of the old connection may survive, its timers included.
            log.info("peer_url_migrated", peer=view.name, old_url=entry.url, url=view.url)
            self._drop_entry(entry, "url migrated")
            entry = None
        # Not a database being removed here: its pairs come back, if the peer still holds it, once that is over.
        wanted = [d for d in registry.databases_for(self.config, view) if d not in self.drops.removing]
        limit = self.config.data.max_databases
        wanted, changed = self.database_limit.admit(view.name, wanted, limit)
        left_out = self.database_limit.left_out_of(view.name)
        if changed and left_out:
            log.warning(
                "database_limit_reached",
                peer=view.name,
                left_out=len(left_out),
                databases=list(left_out[:LOGGED_NAMES]),
                taken=self.database_limit.count,
                limit=limit,
                sample_by=("peer",),
            )
        for database in wanted:
            self.on_database(view, database, event)
        entry = self.map.by_peer(view.name)
        if entry is not None:
            for database in [d for d in entry.pairs if d not in wanted]:
                self._drop_pair(entry, database)

    def on_node_removed(self, name: str) -> None:
        self.database_limit.forget_peer(name)
        self.confirmations.forget_node(name)
        # What is shown of it goes with it (coordinator.metrics drops its counted series at the next scrape).
        self.stalls.pop(name, None)
        self.peer_clock.pop(name, None)
        for key in [key for key in self.peer_holds if key[1] == name]:
            del self.peer_holds[key]
        for key in [key for key in self.sending if key[0] == name]:
            del self.sending[key]
        self.peer_seen.pop(name, None)
        entry = self.map.by_peer(name)
        if entry is not None:
            self._drop_entry(entry, "node removed")

    def _payload(self, view: NodeView, key: str, database: str) -> messages.Subscribe:
        # A recovering database takes every origin from every peer: the node's own writes that only another link
        # carries must reach it before its recovery may end (coordinator.recovery).
        exclude = [] if database in self.recoveries else self.router.exclude(database, view.name)
        # Leadership comes from the latest node state on every update, never from a cached flag.
        return messages.Subscribe(
            key=key,
            peer=view.name,
            url=view.url,
            database=database,
            exclude=exclude,
            leader=view.leader,
            recovery=self.recoveries.floor(database),
        )

    def on_database(self, view: NodeView, database: str, event: bool = True) -> None:
        now = self.loop.time()
        key = connection_key(view.url)
        entry = self.map.get(key)
        if entry is None:
            entry = Entry(key=key, peer=view.name, url=view.url)
            self.map.put(entry)
        elif database in entry.pairs and not self.supervisor.is_live(entry.pairs[database].placed):
            # The stale-worker path goes through the one sweep, so its dispatches keep the stagger spacing too.
            self.reconcile_stale()
        entry.leader = view.leader
        if self.router.track(database, view.name):
            # A new direct link: the pairs set up before it stop carrying its origin.
            self._on_route_change(database)
        payload = self._payload(view, key, database)
        pair = entry.pairs.get(database)
        if pair is None:
            pair = PairState(database=database, payload=payload, created_at=now, placed=self.place())
            entry.pairs[database] = pair
            self.database_limit.pair_added(database)
            self.antientropy.track(key, view.name, database)
            changed = True
        else:
            changed = _setup_fields(pair.payload) != _setup_fields(payload)
            pair.payload = payload
        if not changed and not event:
            return
        if not changed and pair.connected and self.supervisor.is_live(pair.worker):
            return
        if not changed and pair.dispatched_to == pair.placed and self.supervisor.is_live(pair.placed):
            # Its worker is still setting up this very subscription (no report since): another one would only
            # take a slot of the ladder from a pair that needs it. A report of its session ends this.
            return
        if not self.scheduler.schedule(view.url, database, payload, sweep=self.ladder):
            self.scheduler.refresh_pending(view.url, database, payload)

    def _place_again(self, entry: Entry, pair: PairState) -> int:
        """The stale-worker path: a pair whose worker is dead or missing is placed on a live one (its schedule lives
        on, in the scheduler). The entry's re-drive timer was aimed at the old placement, so it goes."""
        entry.disarm()
        pair.placed = self.place()
        if not self.supervisor.is_live(pair.worker):
            pair.connected = False
        return pair.placed

    def place(self) -> int:
        """A live worker for a new or moved (peer, database) pair; -1 when none is live.

        The worker with the fewest pairs placed on it, so the databases of even a single peer spread over every
        worker, and the pairs of an exited worker spread over the others one by one. Among equals, a round-robin
        counter picks: deterministic for a given sequence of placements, and it does not pile every tie on the
        lowest slot."""
        live = self.supervisor.live()
        if not live:
            return -1
        load = self.map.load(live)
        self._placements += 1
        fewest = min(load.values())
        candidates = [slot for slot in live if load[slot] == fewest]
        chosen = candidates[self._placements % len(candidates)]
        self.map.placed_on(chosen)
        return chosen

    def _drop_pair(self, entry: Entry, database: str) -> None:
        # The pair's state goes with it, so wanting the pair again starts every stamp over (stall stamp included).
        pair = entry.pairs.pop(database, None)
        self.map.recount()
        entry.disarm()
        self.scheduler.cancel(entry.url, database)
        self.antientropy.forget(entry.key, database)
        if pair is None:
            return
        if self.database_limit.pair_removed(database) and self.database_limit.waiting:
            self.poke_registry()  # room for a database the limit kept off this node
        for worker in {pair.placed, pair.worker}:
            if worker is not None and worker >= 0:
                self.supervisor.send(worker, messages.Unsubscribe(key=entry.key, database=database))
        if not entry.pairs:
            self.map.remove(entry.key)
        # After the pair is gone, so the re-routed payloads of the other pairs no longer exclude its origin.
        self.router.forget(database, entry.peer)

    def reset_pair(self, peer: str, database: str) -> bool:
        """An operator's reset of one pair (`POST /pairs/{peer}/{database}/reset`): the worker drops the pair's
        session, and a new one is set up on the ladder from the durable positions. False when there is no such pair."""
        entry = self.map.by_peer(peer)
        pair = entry.pairs.get(database) if entry is not None else None
        if entry is None or pair is None:
            return False
        for worker in {pair.placed, pair.worker}:
            if worker is not None and worker >= 0:
                self.supervisor.send(worker, messages.Unsubscribe(key=entry.key, database=database))
        now = self.loop.time()
        if pair.connected or pair.disconnected_at is None:
            pair.disconnected_at = now
        pair.connected = False
        pair.caught_up = False
        pair.stall = None
        pair.dispatched_to = None
        self.router.report(database, peer, up=False)
        log.warning("pair_reset", peer=peer, database=database, worker=pair.worker)
        if not self.scheduler.schedule(entry.url, database, pair.payload, sweep=self.ladder):
            self.scheduler.refresh_pending(entry.url, database, pair.payload)
        return True

    def _on_route_change(self, database: str) -> None:
        """An origin of `database` moved between its direct link and the other pairs: every pair of the database
        whose exclusions changed is set up again, on the ladder (stagger spacing), once for every change of this
        turn of the loop. Renewing them at each change would cost O(pairs x links) a change, and a registry pass
        that adds n links (or n links failing over at one timer's time) would cost O(n^3)."""
        self._rerouted[database] = None
        if self._reroute is None and not self._closing:
            self._reroute = self.loop.call_soon(self._renew_rerouted)

    def _renew_rerouted(self) -> None:
        self._reroute = None
        databases, self._rerouted = list(self._rerouted), {}
        for database in databases:
            self._refresh_payloads(database, "route_changed")

    def _refresh_payloads(self, database: str, event: str) -> None:
        """Set up again, on the ladder, every pair of `database` whose subscription changed; one line says what
        changed for the pairs in use (`_route_change`)."""
        if self._closing:
            return
        renewed: list[str] = []
        added: set[str] = set()
        removed: set[str] = set()
        for entry in list(self.map):
            pair = entry.pairs.get(database)
            view = self.views.get(entry.peer)
            if pair is None or view is None:
                continue
            payload = self._payload(view, entry.key, database)
            if _setup_fields(payload) == _setup_fields(pair.payload):
                continue
            before, pair.payload = pair.payload, payload
            if pair.dispatched_at is not None:  # a subscription in use changes (not one still being set up)
                renewed.append(entry.peer)
                old, new = set(before.exclude), set(payload.exclude)
                added |= new - old
                removed |= old - new
            if not self.scheduler.schedule(entry.url, database, payload, sweep=self.ladder):
                self.scheduler.refresh_pending(entry.url, database, payload)
        if renewed:
            log.info(event, database=database, **_route_change(renewed, added, removed))

    # -- recovery of a lost database ---------------------------------------------------------------------------

    def _note_database(self, database: str, open_before: set[str] | None = None) -> None:
        """Begin the recovery of `database` if its file is recovering. `open_before`: what the store had open before
        (at boot, read once for every database), else read now."""
        assert self.store is not None
        opened = database not in (self.store.opened() if open_before is None else open_before)
        try:
            recovering = self.store.database(database).recovering
        except UnknownDatabase:
            return  # removed, or being removed, since the report
        if opened:
            self._release_later(database)
        if recovering and database not in self.recoveries:
            self.recoveries.begin(database, wall=self.wall(), now=self.loop.time())
            self._refresh_payloads(database, "resubscribed")  # every origin from every peer while it recovers

    def _release_later(self, database: str) -> None:
        """Close `database` again soon, in a thread, unless something else in this process holds it by then
        (`Store.release`). The coordinator opens every database it learns of (at boot, on a worker's report) to read
        one flag, and the store's trim closes at most RELEASE_PER_ROUND idle databases per round: with 1,000
        databases the coordinator kept a connection to nearly every one for minutes (about 67 KiB each), and a
        stop closed them all, each close a checkpoint."""
        self._to_release.add(database)
        if self._releasing is None and not self._closing:
            self._releasing = self.loop.create_task(self._release_opened(), name="release opened databases")
            self._tasks.append(self._releasing)

    async def _release_opened(self) -> None:
        try:
            while self._to_release and self.store is not None:
                names, self._to_release = sorted(self._to_release), set()
                await asyncio.to_thread(self.store.release, names)
        except Exception as exc:  # a close that failed leaves the file open; the trim closes it later
            log.warning("database_release_failed", error=repr(exc))
        finally:
            task, self._releasing = self._releasing, None
            if task in self._tasks:  # not when the shutdown took the list to cancel it
                self._tasks.remove(task)

    def database_regressed(self, database: str, floor: int) -> None:
        """The database's file went back in time, to `floor` (`Database.regress`): its recovery starts again."""
        if self.recoveries.regressed(database, floor, wall=self.wall(), now=self.loop.time()):
            # Every pair of the database subscribes again, on the ladder, asking for our own writes back.
            self._refresh_payloads(database, "resubscribed")

    def pairs_of(self, database: str) -> dict[str, PairState]:
        """The pairs this node has for `database`, by peer."""
        return {entry.peer: pair for entry in self.map if (pair := entry.pairs.get(database)) is not None}

    def check_recoveries(self, databases: Iterable[str] | None = None) -> None:
        """Finish the recovery of every database whose peers have all served it back (coordinator.recovery).

        `databases`: only those (a worker's report concerns one); the reconcile pass and the registry look at all.
        """
        if not self._registry_synced or self.store is None:
            return
        targets = self.recoveries.recovering()
        if databases is not None:
            wanted = set(databases)
            targets = [name for name in targets if name in wanted]
        if not targets:
            return
        # Each database's pairs from one walk of the map, and what the peers hold only if it is asked: a walk per
        # database would cost O(databases x peers) per report while many databases recover at once.
        found: dict[str, dict[str, PairState]] = {database: {} for database in targets}
        for entry in self.map:
            if len(entry.pairs) < len(found):
                for database, pair in entry.pairs.items():
                    if database in found:
                        found[database][entry.peer] = pair
            else:
                for database, pairs in found.items():
                    if (pair := entry.pairs.get(database)) is not None:
                        pairs[entry.peer] = pair
        for database in targets:
            pairs = found[database]
            ready = self.recoveries.ready(
                database,
                pairs,
                holders=functools.partial(self._holders, database),
                registry_trusted=self._registry_trusted,
            )
            if not ready:
                continue
            try:
                records = self.store.database(database).finish_recovery()
            except UnknownDatabase:
                continue  # being removed from this node
            self.recoveries.finish(database, records, wall=self.wall())
            if pairs:
                log.info("database_recovered", database=database, records=records, peers=sorted(pairs))
            self._refresh_payloads(database, "route_changed")  # its origins are routed again
            if database == SYSTEM:
                # The views are rebuilt from the whole registry (new pairs included) before anything else may end.
                self.poke_registry()
                break

    def _holders(self, database: str) -> list[str]:
        """The other nodes of the registry that hold `database` (every node holds the system database)."""
        return [
            name
            for name, view in self.views.items()
            if name != self.name and (database == SYSTEM or database in view.holds)
        ]

    # -- databases deleted cluster-wide (coordinator.drops) ------------------------------------------------------

    def drop_database_pairs(self, database: str) -> None:
        """Stop replicating `database` with every peer (it is being removed here): its pairs, setups and timers
        go, as when a peer stops holding a database."""
        for entry in list(self.map):
            if database in entry.pairs:
                self._drop_pair(entry, database)

    def on_database_removed(self, database: str) -> None:
        """The database's file is gone from this node: it is no longer held, advertised, recovered or scrubbed
        here. A peer that still holds it is subscribed to again on the next registry pass (which creates nothing
        here until the peer sends a record written after the deletion)."""
        self.holds.discard(database)
        self.database_limit.removed(database)
        self.recoveries.forget(database)
        self.confirmations.forget_database(database)
        for key in [key for key in self.peer_holds if key[0] == database]:
            del self.peer_holds[key]
        for key in [key for key in self.sending if key[1] == database]:
            del self.sending[key]
        self.antientropy.forget_database(database)
        self._write_own_row(self.system())
        self.poke_registry()

    def _drop_entry(self, entry: Entry, reason: str) -> None:
        log.info("peer_dropped", peer=entry.peer, url=entry.url, reason=reason)
        entry.disarm()
        self.scheduler.cancel_peer(entry.url)
        for database in list(entry.pairs):
            self._drop_pair(entry, database)
        self.map.remove(entry.key)

    # -- setup scheduler ------------------------------------------------------------------------------------------

    def _on_setup_armed(self, peer_url: str, database: str, payload: messages.Subscribe, delay: float) -> None:
        log.info("subscription_setup_armed", peer=payload.peer, database=database, delay_s=round(delay, 4))

    def _dispatch(self, peer_url: str, database: str, payload: messages.Subscribe) -> None:
        if self._closing:
            return
        key = connection_key(peer_url)
        entry = self.map.get(key)
        pair = entry.pairs.get(database) if entry is not None else None
        if entry is None or pair is None:
            log.info("subscription_setup_stale", peer=payload.peer, database=database)
            return
        if not self.supervisor.is_live(pair.placed) and self._place_again(entry, pair) < 0:
            log.warning("subscription_setup_no_worker", peer=entry.peer, database=database)
            return
        worker = pair.placed
        self._dispatches += 1
        pair.dispatched_at = self.loop.time()
        message = msgspec.structs.replace(pair.payload, dispatch=self._dispatches)
        if not self.supervisor.send(worker, message):
            log.warning("subscription_setup_undelivered", peer=entry.peer, database=database, worker=worker)
            return
        pair.dispatched_to = worker
        if not pair.connected:
            pair.setup_started = pair.dispatched_at
        log.info("subscription_setup_dispatched", peer=entry.peer, database=database, worker=worker)

    # -- worker reports -------------------------------------------------------------------------------------------

    def on_worker_message(self, slot: int, message: messages.ToCoordinator) -> None:
        handle = self.supervisor.workers.get(slot)
        if handle is None:
            return
        now = self.loop.time()
        match message:
            case messages.Heartbeat(counters=counters, histograms=histograms):
                self.metrics.apply(counters)
                self.metrics.apply_histograms(histograms)
            case messages.TlsLoaded():
                self._on_tls_loaded(slot, message)
            case messages.Ready(links=shares):
                self.links.forget_worker(slot)  # a respawned worker starts with no link
                if shares:
                    self.links.sharing(slot)
                self.worker_ready.set()
                self.confirmations.worker_ready(slot)
                if self.supervisor.all_ready():
                    self._ready.set()
                if self._ready.is_set():
                    self.reconcile_stale()
                    if handle.restarts:
                        self._on_respawned(handle)
            case messages.LinkState(key=key, up=link_up, streams=streams):
                self.links.report(slot, key, link_up, streams)
            case messages.SubscribeAccepted(key=key, database=database):
                pair = self.map.pair(key, database)
                if pair is not None:
                    pair.accepted_by = slot
            case messages.Connected():
                self._on_connected(slot, message, now)
            case messages.Disconnected():
                self._on_disconnected(message, now)
            case messages.Progress():
                self._on_progress(message, now)
            case messages.PeerClock(peer=peer, offset_seconds=offset):
                self.peer_clock[peer] = offset
            case messages.DatabaseRegressed(name=name, floor=floor):
                self.database_regressed(name, floor)
            case messages.DatabaseClosed():
                self.drops.on_closed(slot, message)
            case messages.DatabaseOpened(name=name):
                if name not in self.holds:
                    self.holds.add(name)
                    self.database_limit.held(name)
                    self._note_database(name)
                    self._own_row_stale = True
                    self.check_recoveries([name])
                    self.antientropy.note_database(name)
            case messages.AntiEntropyDone():
                self.antientropy.on_done(message)
            case messages.BlobsRepaired():
                self.blob_repairs.on_done(message)
            case messages.PeerHolds(peer=peer, database=database, complete=complete, others=others):
                self.peer_holds[(database, peer)] = complete
                self.confirmations.held(database, peer, complete)
                if others:
                    self.confirmations.relayed(database, others, self.views)
            case messages.ConfirmWait():
                self.confirmations.wait(slot, message)
            case messages.ConfirmCancel(ticket=ticket):
                self.confirmations.cancel(slot, ticket)
            case messages.Sending(peer=peer, database=database):
                self._on_sending(message)
            case messages.PurgeBehind(key=key, database=database, origins=origins):
                # Records whose deletions this node will never be sent may be here: the pair's round, now.
                self.antientropy.run_soon(key, database, reason=f"behind the peer's purge of {', '.join(origins)}")

    def _on_connected(self, slot: int, message: messages.Connected, now: float) -> None:
        key, database = message.key, message.database
        entry = self.map.get(key)
        pair = entry.pairs.get(database) if entry is not None else None
        if entry is None or pair is None:
            # A session nobody wants (its pair was dropped while it connected): end it.
            self.supervisor.send(slot, messages.Unsubscribe(key=key, database=database))
            return
        pair.connected = True
        pair.worker = message.worker
        pair.session = message.session
        pair.connected_at = now
        self.peer_seen[entry.peer] = now
        pair.own_upto = message.own_upto
        pair.protocol = message.protocol
        pair.dispatched_to = None
        if pair.setup_started is not None:
            self.metrics.setup_connected(entry.peer, now - pair.setup_started)
            pair.setup_started = None
        pair.last_progress_at = now
        pair.peer_head_seq = message.peer_head_seq
        pair.reconnect_attempts = 0
        pair.last_error = ""
        pair.caught_up = False
        self.router.report(database, entry.peer, up=True)
        # Reset the pair's setup delay, cancel nothing: the report cannot be attributed to the armed work.
        self.scheduler.note_connected(entry.url, database)

    def _on_disconnected(self, message: messages.Disconnected, now: float) -> None:
        pair = self.map.pair(message.key, message.database)
        if pair is None:
            return
        if pair.stall is not None and (pair.stall.worker, pair.stall.session) == (
            message.worker,
            message.session,
        ):
            pair.stall = None  # the monitored session ended: its kick is released
        pair.dispatched_to = None
        pair.reconnect_attempts = message.attempts
        pair.retry_due = None if message.reconnect_in is None else now + message.reconnect_in
        if message.error:
            pair.last_error = message.error
        if (pair.worker, pair.session) == (message.worker, message.session) or not pair.connected:
            if pair.connected or pair.disconnected_at is None:
                pair.disconnected_at = now
            entry = self.map.get(message.key)
            if pair.connected and entry is not None:
                self.peer_seen[entry.peer] = now
            pair.connected = False
            pair.caught_up = False
            pair.worker = message.worker
            if entry is not None:
                self.router.report(message.database, entry.peer, up=False)

    def _on_progress(self, message: messages.Progress, now: float) -> None:
        pair = self.map.pair(message.key, message.database)
        if pair is None:
            return
        own_session = (pair.worker, pair.session) == (message.worker, message.session)
        watch = pair.stall
        if not own_session:
            if (
                watch is not None
                and (watch.worker, watch.session) == (message.worker, message.session)
                and message.last_received_seq > watch.seq
            ):
                pair.stall = None  # the monitored session progressed: its kick is released
            return
        moved = pair.note_ahead(message.ahead, now)
        watched = watch is not None and (watch.worker, watch.session) == (message.worker, message.session)
        if watched and (message.last_received_seq > watch.seq or moved):  # type: ignore[union-attr]
            pair.stall = None  # the monitored session progressed: its kick is released
        if message.last_received_seq > pair.last_received_seq or message.applied > pair.applied:
            pair.last_progress_at = now
        pair.last_received_seq = message.last_received_seq
        pair.peer_head_seq = message.peer_head_seq
        pair.lag_seconds = message.lag_seconds
        pair.progressed = pair.progressed or message.caught_up or message.received > 0
        pair.applied = message.applied
        pair.caught_up = message.caught_up
        pair.peer_recovering = message.peer_recovering
        pair.backlog = message.backlog
        pair.received = message.received
        pair.session_applied = message.session_applied
        pair.received_bytes = message.received_bytes
        self._warn_slow_copy(message.key, pair, now)
        entry = self.map.get(message.key)
        if entry is not None and pair.connected:
            self.peer_seen[entry.peer] = now
            self.router.report(message.database, entry.peer, up=True, caught_up=message.caught_up)
        if message.caught_up:
            pair.caught_up_at = now
            if message.database in self.recoveries and entry is not None:
                self.recoveries.caught_up(message.database, entry.peer, pair)
                self.check_recoveries([message.database])

    def _on_sending(self, message: messages.Sending) -> None:
        """The sending end of a pair reported. Of several sessions of one pair (a reconnect overlapping the old
        session's end), the newest connected one is shown; one that ended is kept until another reports."""
        key = (message.peer, message.database)
        if message.peer not in self.views and message.peer != self.name:
            return  # a peer the registry does not list (removed): its pairs are not shown
        held = self.sending.get(key)
        if not message.connected and held is not None and held.connected and held.session != message.session:
            return  # an old session's end, after its successor started
        if message.connected or (held is not None and held.connected):
            self.peer_seen[message.peer] = self.loop.time()
        self.sending[key] = message

    def _warn_slow_copy(self, key: str, pair: PairState, now: float) -> None:
        """A copy that has run for SLOW_COPY_AFTER and still has more than that much to go, below
        SLOW_COPY_MB_S, is worth a look (a slow link or disk, a busy peer): one warning per session."""
        copying = pair.copy(now)
        if copying is None or pair.slow_copy_warned == pair.session or pair.connected_at is None:
            return
        running = now - pair.connected_at
        if running < SLOW_COPY_AFTER or copying["mb_s"] >= SLOW_COPY_MB_S or (copying["eta_s"] or 0) < SLOW_COPY_AFTER:
            return
        pair.slow_copy_warned = pair.session
        entry = self.map.get(key)
        log.warning(
            "copy_slow",
            peer=entry.peer if entry else "",
            database=pair.database,
            mb_s=copying["mb_s"],
            records=copying["records"],
            total=copying["total"],
            eta_s=copying["eta_s"],
        )

    def _on_respawned(self, handle: WorkerHandle) -> None:
        """A respawned worker starts with no pair (its exit spread them over the others): once it has stayed up for
        RESPAWN_HEALTHY_UPTIME, the uptime that also resets its respawn schedule, pairs move back onto it until the
        load is even (`scaling.rebalance`). A worker that crash-loops is never given pairs only to lose them again."""
        slot, pid = handle.slot, handle.pid
        self._cancel_rebalance(slot)

        def due() -> None:
            self._rebalances.pop(slot, None)
            current = self.supervisor.workers.get(slot)
            if self._closing or current is None or current.pid != pid or not self.supervisor.is_live(slot):
                return
            moved = scaling.rebalance(self, slot)
            log.info("worker_rebalanced", worker=slot, moved=moved)

        self._rebalances[slot] = self.loop.call_later(RESPAWN_HEALTHY_UPTIME, due)

    def _cancel_rebalance(self, slot: int) -> None:
        timer = self._rebalances.pop(slot, None)
        if timer is not None:
            timer.cancel()

    def on_worker_exit(self, handle: WorkerHandle) -> None:
        self._cancel_rebalance(handle.slot)
        self.worker_tls.pop(handle.slot, None)
        self.links.forget_worker(handle.slot)  # its links died with it
        self.antientropy.on_worker_exit(handle.slot)
        self.confirmations.worker_gone(handle.slot)
        self.blob_repairs.on_worker_exit(handle.slot)
        for entry in self.map:
            held = False
            for pair in entry.pairs.values():
                if pair.placed == handle.slot:
                    # The sessions died with the process; a respawn in the same slot starts empty, so the pair is
                    # unplaced until the stale sweep sets it up again (on a live worker, or on the respawned one).
                    pair.placed = -1
                    held = True
                if pair.accepted_by == handle.slot:
                    pair.accepted_by = None
                if pair.dispatched_to == handle.slot:
                    pair.dispatched_to = None
                if pair.worker == handle.slot:
                    pair.connected = False
                    pair.caught_up = False
                    if pair.disconnected_at is None or pair.connected_at is not None:
                        pair.disconnected_at = self.loop.time()
                    self.router.report(pair.database, entry.peer, up=False)
            if held:
                entry.disarm()  # a re-drive timer of the entry may be aimed at a pair that was there
        self.map.recount()
        if not self._closing:
            self.reconcile_stale()

    def _on_boot_error(self, handle: WorkerHandle) -> None:
        self.boot_error = f"worker {handle.slot} cannot boot: {handle.boot_error}"
        log.error("worker_boot_failed", worker=handle.slot, reason=handle.boot_error, action="node halts")
        self.exit_code = EXIT_BOOT_ERROR
        self.request_stop()

    # -- reconcile ------------------------------------------------------------------------------------------------

    async def _reconcile_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.replication.reconcile_interval)
            try:
                self.reconcile()
            except Exception as exc:
                log.error("reconcile_failed", error=repr(exc))

    def reconcile(self) -> None:
        """One pass: the truth pass (hung workers), stale pairs, wedged pairs, stalled receivers."""
        now = self.loop.time()
        timeout = self.config.replication.heartbeat_timeout
        absent = self.pauses.take()
        if absent:
            # The coordinator did not run (stopped with the whole node, frozen, blocked): the workers could not be
            # heard over that time, so it is given back to each of them before any is judged silent.
            log.warning("coordinator_paused", paused_s=round(absent, 3), action="worker silence excused")
            self.supervisor.excuse(absent)
        for handle in list(self.supervisor.workers.values()):
            if not handle.alive:
                continue
            silent = now - handle.last_heartbeat
            if handle.ready and silent > timeout:
                log.warning("worker_hung", worker=handle.slot, pid=handle.pid, silent_s=round(silent, 3))
                self.supervisor.kill(handle.slot)
            elif not handle.ready and silent > BOOT_TIMEOUT:
                log.warning("worker_boot_hung", worker=handle.slot, pid=handle.pid, waited_s=BOOT_TIMEOUT)
                self.supervisor.kill(handle.slot)
        self.reconcile_stale()
        self._redrive_wedged(now)
        self._kick_stalled(now)
        self.check_recoveries()
        log.flush()

    def reconcile_stale(self) -> None:
        """Place every pair whose worker is dead or missing on a live worker, on the ladder (stagger spacing).

        Only those pairs move, each to the least loaded live worker at its turn (`place`), so the pairs of an
        exited worker spread over the others instead of all landing on one."""
        if not self.supervisor.live():
            return
        for entry in self.map:
            for database, pair in entry.pairs.items():
                if self.supervisor.is_live(pair.placed):
                    continue
                worker = self._place_again(entry, pair)
                self.reassignments += 1
                log.info("stale_reassigned", peer=entry.peer, database=database, worker=worker)
                if not self.scheduler.schedule(entry.url, database, pair.payload, sweep=self.ladder):
                    self.scheduler.refresh_pending(entry.url, database, pair.payload)

    def _redrive_base(self) -> float:
        # One draw per sweep as the common base, then the ladder: independent draws would break the spacing.
        return 0.2 + self.rng() * 0.2

    def _redrive_wedged(self, now: float) -> None:
        threshold = self.config.replication.wedge_threshold
        wedged: list[Entry] = []
        for entry in self.map:
            if entry.redrive is not None:
                continue
            if self._wedged_pairs(entry, now, threshold):
                wedged.append(entry)
        if not wedged:
            return
        log.warning("wedge_redrive", count=len(wedged))
        base = self._redrive_base()
        for entry in wedged:
            entry.arm(self._at_slot_unless_linked(self._wedge_link(entry, now), base, self._fire_wedge, entry), "wedge")

    def _wedge_link(self, entry: Entry, now: float) -> Link | None:
        """The link a re-drive of the entry would force-reconnect over now; None when it would set one up anew."""
        wedged = self._wedged_pairs(entry, now, self.config.replication.wedge_threshold)
        if not wedged or wedged[0][1].accepted_by != wedged[0][1].placed:
            return None
        return (wedged[0][1].placed, entry.key)

    def _wedged_pairs(self, entry: Entry, now: float, threshold: float) -> list[tuple[str, PairState]]:
        """The entry's pairs down for the threshold. A pair whose setup is still armed is the schedule's, not
        wedged; a pair never connected counts from its latest dispatch, not from when it was wanted; a pair whose
        worker said when it dials again counts from then: it is backing off, and forcing a dial past its schedule
        would turn a long outage into a redial of every pair every threshold (the fleet simulation's finding)."""
        wedged = []
        for database, pair in entry.pairs.items():
            if pair.connected or self.scheduler.is_armed(entry.url, database):
                continue
            if not self.supervisor.is_live(pair.placed):
                continue  # the stale sweep's, not wedged
            since = pair.disconnected_at
            if since is None:
                since = max(pair.created_at, pair.dispatched_at or 0.0)
            if pair.retry_due is not None:
                since = max(since, pair.retry_due)
            if now - since >= threshold:
                wedged.append((database, pair))
        return wedged

    def _fire_wedge(self, entry: Entry, slotted: bool = True) -> None:
        entry.redrive = None
        entry.redrive_kind = ""
        if self.map.get(entry.key) is not entry:
            return
        now = self.loop.time()
        threshold = self.config.replication.wedge_threshold
        wedged = self._wedged_pairs(entry, now, threshold)
        if not wedged:
            return
        # One database per slot: re-driving all of an entry's databases at once would be a burst of handshakes.
        database, pair = wedged[0]
        if not slotted and pair.accepted_by == pair.placed and self.links.needs_slot((pair.placed, entry.key), now):
            # Armed for a live link that is not live (or not the way) now: it takes a slot after all.
            entry.arm(self.scheduler.call_at_slot(self.ladder, 0.0, self._fire_wedge, entry, True), "wedge")
            return
        self.redrives["wedge"] += 1
        pair.disconnected_at = now  # the next re-drive waits another threshold
        if pair.accepted_by == pair.placed:
            self.supervisor.send(
                pair.placed,
                messages.ForceReconnect(key=entry.key, database=database, reason="wedged: re-driven"),
            )
        elif not self.scheduler.schedule(entry.url, database, pair.payload, sweep=self.ladder):
            self.scheduler.refresh_pending(entry.url, database, pair.payload)
        if len(wedged) > 1:
            entry.arm(self._at_slot_unless_linked(self._wedge_link(entry, now), 0.0, self._fire_wedge, entry), "wedge")

    def _kick_stalled(self, now: float) -> None:
        threshold = self.config.replication.stall_threshold
        candidates: list[tuple[Entry, str, StallWatch]] = []
        for entry in self.map:
            if entry.redrive is not None:
                continue
            for database, pair in entry.pairs.items():
                if pair.stall is not None or pair.worker is None or pair.session is None:
                    continue
                if pair.stalled(now, threshold):
                    origin = min(pair.ahead) if pair.ahead else ""
                    watch = StallWatch(pair.worker, pair.session, now, pair.last_received_seq, origin)
                    pair.stall = watch
                    candidates.append((entry, database, watch))
                    break
        if not candidates:
            return
        base = self._redrive_base()
        for entry, database, watch in candidates:
            link = (watch.worker, entry.key)
            entry.arm(self._at_slot_unless_linked(link, base, self._fire_stall, entry, database, watch), "stall")

    def _fire_stall(self, entry: Entry, database: str, watch: StallWatch, slotted: bool = True) -> None:
        entry.redrive = None
        entry.redrive_kind = ""
        pair = entry.pairs.get(database) if self.map.get(entry.key) is entry else None
        if not should_fire_stall_kick(pair, watch):
            return
        assert pair is not None
        if not slotted and self.links.needs_slot((watch.worker, entry.key), self.loop.time()):
            # Armed for a live link that went down since: the kick takes a slot after all.
            timer = self.scheduler.call_at_slot(self.ladder, 0.0, self._fire_stall, entry, database, watch, True)
            entry.arm(timer, "stall")
            return
        pair.stall = None
        pair.stall_kicked_at = self.loop.time()
        self.redrives["stall"] += 1
        self.stalls[entry.peer] = self.stalls.get(entry.peer, 0) + 1
        log.warning(
            "pair_stalled",
            peer=entry.peer,
            database=database,
            origin=watch.origin,
            behind={origin: mark for origin, mark in sorted(pair.ahead.items())[:5]},
            worker=watch.worker,
            session=watch.session,
        )
        log.warning("stall_kick", peer=entry.peer, database=database, worker=watch.worker, session=watch.session)
        self.supervisor.send(
            watch.worker,
            messages.ForceReconnect(
                key=entry.key, database=database, session=watch.session, reason="receive stalled: kicked"
            ),
        )

    # -- reload ---------------------------------------------------------------------------------------------------

    async def _reload(self) -> None:
        """SIGHUP: the config file, and the TLS files it names, loaded again and taken only if all of it checks out.
        A reload that fails changes nothing (`reload_failed`, replicator_config_last_reload_successful 0): the node
        and every worker run on the config and the certificates they had."""
        announced = self._announced_ready and not self._closing
        if announced:
            # systemd shows the unit reloading until READY=1; MONOTONIC_USEC says when the reload began.
            self.notifier.notify("RELOADING=1", f"MONOTONIC_USEC={int(self.loop.time() * 1_000_000)}")
        try:
            await self._reload_files()
        finally:
            if announced:
                self.notifier.status(self.status_text(), "READY=1")

    async def _reload_files(self) -> None:
        source = self.config.source
        try:
            new = config_module.load(source)
        except ConfigError as exc:
            self._reload_failed(str(exc), "config")
            return
        if (new.node.name, normalize_url(new.node.url)) != (self.name, normalize_url(self.config.node.url)):
            self._reload_failed("node.name and node.url cannot change while running", "config")
            return
        loaded: Credentials | None = None
        if self.credentials is not None:  # booted: what the node presents is read again, and checked first
            try:
                material = credentials.read(new)
            except TlsConfigError as exc:
                self._reload_failed(str(exc), "tls")
                return
            if material.same_content(self.credentials.material):
                self.credentials.material = material  # the same certificates, perhaps from other files
            else:
                loaded = Credentials(material, generation=self.credentials.generation + 1, loaded_at=self.wall())
        old = self.config
        file_workers = new.node.workers
        if self._cli_workers is not None and file_workers == self._file_workers:
            new.node.workers = old.node.workers
        else:
            self._cli_workers = None
        self._file_workers = file_workers
        new.peers = _with_routes(new.peers, self._run_routes)
        self.config = new
        self.scheduler.stagger = new.replication.stagger
        self.router.failover_after = new.replication.failover_after
        self.antientropy.reconfigure()
        for handle in self.supervisor.workers.values():
            self.supervisor.send(handle.slot, messages.Reconfigure(config=config_module.encode(new)))
        if loaded is not None:
            self._take_credentials(loaded)
        log.info("config_reloaded", peers=[peer.name for peer in new.peers], workers=new.worker_count)
        self.reload_health.succeeded(self.wall())
        if new.worker_count != old.worker_count:
            await self.scale(new.worker_count)
        self.poke_registry()

    def _reload_failed(self, reason: str, section: str) -> None:
        log.error("reload_failed", error=reason, section=section, action="the node runs on what it had")
        self.reload_health.failed(reason)

    def _take_credentials(self, loaded: Credentials) -> None:
        """The node presents and trusts `loaded` from now on: its registry rows are signed with it, rows and
        revocations are checked against its CAs, and every worker takes it for its new handshakes."""
        previous, self.credentials = self.credentials, loaded
        changed = loaded.changes(previous) if previous is not None else ["ca", "cert", "key"]
        self.signer = loaded.signer(self.name)
        if "ca" in changed:
            self.verifier = membership.Verifier(loaded.cas)
            self._revocations_seen = -1
        reload = messages.ReloadTls(generation=loaded.generation, material=loaded.material)
        for slot in list(self.supervisor.workers):
            self.supervisor.send(slot, reload)
        # Rows signed with the previous certificate: the own row is written again by the next registry pass
        # (`_write_own_row`), the introductions this node wrote here.
        resigned = membership.resign(self.system(), self.signer) if self.store is not None else []
        issuers = loaded.issuers()
        log.info(
            "tls_reloaded",
            generation=loaded.generation,
            changed=changed,
            serial=loaded.serial,
            not_after=loaded.certificate.not_valid_after_utc.timestamp(),
            issuer=loaded.certificate.issuer.rfc4514_string(),
            cas=[ca.subject.rfc4514_string() for ca in loaded.cas][:LOGGED_NAMES],
            ca_count=len(loaded.cas),
            issued_by_bundle=bool(issuers),
            introductions_resigned=len(resigned),
        )

    def _on_tls_loaded(self, slot: int, message: messages.TlsLoaded) -> None:
        self.worker_tls[slot] = message
        current = self.credentials
        if current is None:
            return
        if message.error:
            log.error("worker_tls_reload_failed", worker=slot, generation=message.generation, error=message.error)
            if message.generation == current.generation:
                self.reload_health.failed(f"worker {slot}: {message.error}")
            return
        if message.generation < current.generation:
            # Started from an older load, or its pipe was not open yet when the reload was sent.
            self.supervisor.send(slot, messages.ReloadTls(generation=current.generation, material=current.material))

    async def scale(self, count: int) -> None:
        """Change the number of workers, moving pairs on the stagger ladder without dropping healthy sessions."""
        await scaling.scale(self, count)


def _with_routes(peers: list[PeerSection], routes: list[PeerSection]) -> list[PeerSection]:
    named = {peer.name for peer in peers}
    return [*peers, *(route for route in routes if route.name not in named)]


def _route_change(renewed: list[str], added: set[str], removed: set[str]) -> dict[str, Any]:
    """The fields of the one line a route change of a database writes: the pairs in use it renews (`peers`, and
    `pairs` counting them), the origins they exclude now and did not (`added`: their own links carry them) and those
    they carry now (`removed`: failed over, or no longer direct), each a capped list beside its count. A line per
    pair listing its whole exclusion made the log grow with the cube of the links a registry pass added (issue 21);
    this one is bounded, and a route change writes one."""
    peers, gained, lost = sorted(renewed), sorted(added), sorted(removed)
    return {
        "pairs": len(peers),
        "peers": peers[:LOGGED_NAMES],
        "added": gained[:LOGGED_NAMES],
        "added_count": len(gained),
        "removed": lost[:LOGGED_NAMES],
        "removed_count": len(lost),
    }


def _setup_fields(payload: messages.Subscribe) -> tuple[Any, ...]:
    return (payload.url, tuple(payload.exclude), payload.leader, payload.recovery)


def _probe_port(host: str, port: int) -> None:
    """Fail at boot when another process holds the node port: workers bind it with SO_REUSEPORT, which would
    otherwise share the port silently with any other process of the same user."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise BootError(f"node port {host}:{port} is in use") from None
            raise BootError(f"cannot bind the node port {host}:{port}: {exc.strerror}") from None
