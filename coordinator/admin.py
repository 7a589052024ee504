"""Admin HTTP, served by the coordinator (plain HTTP, loopback by default).

GET /metrics /healthz /readyz /status /digest/{database}
GET /nodes[?revoked=true]   the registry (`replicator node list`): each row with where it comes from and, beside it,
    whether a session with its node is up, how many of this node's pairs with it are, how long ago one last was,
    and the CA-signed revocations naming it; with ?revoked=true also the rows signed by a revoked certificate
GET /backup /backup/{database} /backup/{database}/blobs[/{sha256}]   what `replicator backup` copies
    (`coordinator.admin_backup`)
GET /ca   the cluster CA certificates this node trusts (tls.ca as loaded at boot or by the latest reload), PEM, so
    that a new node can check it was issued by the same CA before it joins (`replicator clone`); certificates only,
    never a key
GET /revocations   every CA-signed revocation the registry holds: [{"id", "revocation", "revokes", "signed_by":
    {"subject", "fingerprint"}}] (`replicator certs resign`)
PUT /nodes/{name}/revocations   store a revocation `replicator certs revoke` signed
PUT /nodes/{name} {"url", "databases", "replicates"[, "leader"]}: an introduction of another node, signed by this
    one (shared.membership); a node's own row always wins over it. 409 with "limit" past the introduction caps
    (membership.MAX_PENDING_PER_INTRODUCER of this node's, MAX_PENDING_INTRODUCTIONS in all).   DELETE /nodes/{name}
POST /antientropy/{database} /antientropy [?timeout=SECONDS]   run an anti-entropy round now with every peer of
    the database (of every database the node holds) and answer when all came back:
    {"rounds": [{"peer", "database", "buckets_compared", "divergent_buckets", "repaired", "bytes", "seconds",
    "error"}], "repaired": total}
POST /repair/blobs/{database} [?timeout=SECONDS]   fetch again from peers every blob of the database that is missing
    or damaged here, paced (workers.blob_repair); answers when done: {"database", "scanned", "missing", "repaired",
    "failed": [{"table", "id", "hash", "reason"}]}, 500 with "error" when it stopped early
GET /digest/{database}/{table}/tree?level=L&nodes=N,...  /digest/{database}/{table}/rows?level=L&nodes=N,...   a
    table's digest tree and the rows under its nodes, read-only, under the anti-entropy caps (coordinator.digest_tree)
DELETE /databases/{name}   delete a database cluster-wide (shared.dropped): {"name", "version"}, the version being
    the deletion floor; 400 for a bad name or `system`, 404 when neither this node nor the registry knows it

Every request passes `coordinator.admin_access` first (its Host, its Origin, the admin token, JSON for a request
that changes state), and every connection `coordinator.admin_site` (the connection cap, the request timeout).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web
from cryptography import x509
from prometheus_client.aiohttp import make_aiohttp_handler

from replicator.coordinator.admin_access import MAX_CONNECTIONS, AdminAccess
from replicator.coordinator.admin_backup import BackupEndpoints
from replicator.coordinator.admin_site import CappedSite
from replicator.coordinator.blob_repairs import NoWorker, WorkerExited
from replicator.coordinator.digest_tree import DigestTree
from replicator.coordinator.drops import NotHeld
from replicator.coordinator.filecheck import WriteProbe
from replicator.coordinator.view import AdminView
from replicator.shared import config as config_module
from replicator.shared import membership, memory, revocation
from replicator.shared.config import DATABASE_PATTERN_RE, NAME_RE, ListenSection
from replicator.shared.http_errors import json_runner
from replicator.shared.keys import normalize_url
from replicator.shared.logs import capture_library_logs, log
from replicator.shared.store import SYSTEM, BadName, NodeRow, RefusedFile, UnknownDatabase
from replicator.shared.tls import TlsConfigError, ca_certificates, certificate_identity, certificates_pem, fingerprint

_json = msgspec.json.Encoder()
MAX_WAIT = 3600.0  # the longest `?timeout=` a run-now request may ask for
MAX_BODY = 1024 * 1024  # an introduction or a revocation is a few KB
AUTHORIZED = web.RequestKey("authorized", bool)  # whether the request carried the admin token (or none is set)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _reply(payload: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=_json.encode(payload), content_type="application/json")


def _error(status: int, message: str) -> web.Response:
    return _reply({"error": message}, status)


def _timeout(request: web.Request, default: float | None) -> float | web.Response | None:
    """The request's `?timeout=SECONDS` (in (0, MAX_WAIT]), `default` without one, or the 400 that refuses it."""
    if "timeout" not in request.query:
        return default
    try:
        timeout = float(request.query["timeout"])
    except ValueError:
        timeout = -1.0
    if not 0 < timeout <= MAX_WAIT:
        return _error(400, f"bad timeout {request.query['timeout'][:40]!r}: seconds in (0, {MAX_WAIT:g}]")
    return timeout


# What `GET /nodes` says of sessions with the node itself.
_NO_SESSIONS = {"connected": None, "pairs": 0, "pairs_connected": 0, "last_seen_s": None}


class NodeUpdate(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    url: str
    databases: list[str] = msgspec.field(default_factory=lambda: ["*"])
    replicates: bool = True
    leader: bool | None = None
    revoked: list[str] | None = None


class BodyTimeout(Exception):
    """A request body that did not arrive within listen.request_timeout."""


class AdminServer:
    def __init__(self, node: AdminView) -> None:
        self._node = node
        self._runner: web.AppRunner | None = None
        self._write_probe: WriteProbe | None = None  # made with the store: can it still write? (/readyz)
        # The rules for the address the port was bound to; the token and the allowed hosts follow a reload.
        self._access: tuple[ListenSection, AdminAccess] | None = None
        self._bound = (node.config.listen.admin_host, node.config.listen.admin_port)
        # prometheus-client's own handler: the text format or OpenMetrics as the scraper's Accept asks, gzip when
        # its Accept-Encoding allows, `?name[]=` to select families.
        self._exposition = make_aiohttp_handler(node.metrics.registry)
        app = web.Application(client_max_size=MAX_BODY, middlewares=[self._guard])
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/status", self.status)
        app.router.add_get("/nodes", self.nodes)
        app.router.add_get("/ca", self.ca)
        app.router.add_put("/nodes/{name}", self.put_node)
        app.router.add_put("/nodes/{name}/revocations", self.put_revocation)
        app.router.add_get("/revocations", self.revocations)
        app.router.add_delete("/nodes/{name}", self.delete_node)
        app.router.add_get("/digest/{database}", self.digest)
        app.router.add_delete("/databases/{name}", self.delete_database)
        app.router.add_post("/antientropy", self.antientropy)
        app.router.add_post("/antientropy/{database}", self.antientropy)
        app.router.add_post("/repair/blobs/{database}", self.repair_blobs)
        app.router.add_post("/pairs/{peer}/{database}/reset", self.reset_pair)
        # Read-only, for `replicator diff`: a table's digest tree and rows (coordinator.digest_tree).
        app.router.add_routes(DigestTree(node).routes())
        BackupEndpoints(node).add_routes(app)
        self._app = app

    async def start(self) -> None:
        # aiohttp's and asyncio's own messages become single JSON lines: no traceback in the log.
        capture_library_logs(log, "aiohttp", "asyncio")
        listen = self._node.config.listen
        self._bound = (listen.admin_host, listen.admin_port)
        # The node port's request timeout (`shared.http_errors.json_runner`); a body is read within it too (`_body`).
        self._runner = json_runner(self._app, listen.request_timeout)
        await self._runner.setup()
        site = CappedSite(
            self._runner,
            listen.admin_host,
            listen.admin_port,
            listen.admin_max_connections,
            on_refused=lambda: self._node.metrics.admin_refused(MAX_CONNECTIONS),
        )
        await site.start()

    def access(self) -> AdminAccess:
        """The rules for the bound address, with the current config's token and allowed hosts."""
        listen = self._node.config.listen
        if self._access is None or self._access[0] is not listen:
            host, port = self._bound
            self._access = (listen, AdminAccess(host, port, listen.admin_allowed_hosts, listen.admin_token))
        return self._access[1]

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Refuse what `coordinator.admin_access` refuses, before any handler runs; a refusal is counted and logged."""
        access = self.access()
        hosts = request.headers.getall("Host", [])
        origins = request.headers.getall("Origin", [])
        authorization = request.headers.get("Authorization")
        refusal = access.refusal(
            request.method,
            request.path,
            hosts[0] if len(hosts) == 1 else None,
            origins[0] if len(origins) == 1 else (None if not origins else ""),  # several: refused
            authorization,
            request.headers.get("Content-Type"),
        )
        if refusal is not None:
            self._node.metrics.admin_refused(refusal.reason)
            peer = request.transport.get_extra_info("peername") if request.transport is not None else None
            log.warning(
                "admin_request_refused",
                reason=refusal.reason,
                status=refusal.status,
                method=request.method[:16],
                path=request.path[:200],
                client=str(peer[0]) if isinstance(peer, tuple) and peer else "",
                sample_by=("reason",),
            )
            response = _error(refusal.status, refusal.message)
            if refusal.status == 401:
                response.headers["WWW-Authenticate"] = 'Bearer realm="replicator admin"'
            return response
        # Past the rules, only an open path may have come without the token.
        open_path = access.open_without_token(request.method, request.path)
        request[AUTHORIZED] = not open_path or access.token_refusal(authorization) is None
        try:
            return await handler(request)
        except BodyTimeout:
            response = _error(408, "the request body did not arrive within listen.request_timeout")
            response.force_close()
            return response
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            # aiohttp's own refusals (404, 405, 413) answer JSON too.
            response = _error(exc.status, exc.text or exc.reason)
            for name in ("Allow", "Retry-After"):
                if name in exc.headers:
                    response.headers[name] = exc.headers[name]
            return response

    async def _body(self, request: web.Request) -> bytes:
        """The request's body, which must arrive within listen.request_timeout (BodyTimeout otherwise)."""
        try:
            async with asyncio.timeout(self._node.config.listen.request_timeout):
                return await request.read()
        except TimeoutError:
            raise BodyTimeout from None

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        self._node.metrics.prepare()
        return await self._exposition(request)

    async def healthz(self, request: web.Request) -> web.Response:
        # Answered without the token: then it says nothing but that the loop runs.
        if request.get(AUTHORIZED):
            return _reply({"status": "ok", "node": self._node.name})
        return _reply({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        supervisor = self._node.supervisor
        waiting = [
            slot for slot, w in sorted(supervisor.workers.items()) if not (w.alive and w.ready) and not w.retiring
        ]
        reasons = [] if supervisor.all_ready() else [f"waiting for workers {waiting}"]
        if self._node.boot_error:
            reasons.append(self._node.boot_error)
        store = self._node.store
        if store is not None:
            if self._write_probe is None:
                self._write_probe = WriteProbe(store.data_dir, store.path(SYSTEM), loop=self._node.loop)
            problem = await self._write_probe.problem()
            if problem is not None:
                reasons.append(problem)
        if not request.get(AUTHORIZED):
            # Answered without the token (a container runtime's probe): then it says only whether the node is ready.
            return _reply({"ready": not reasons}, 503 if reasons else 200)
        if not reasons:
            return _reply({"ready": True, "workers": len(supervisor.live())})
        return _reply(
            {"ready": False, "reasons": reasons, "waiting_for_workers": waiting, "boot_error": self._node.boot_error},
            503,
        )

    async def status(self, request: web.Request) -> web.Response:
        return _reply(status_document(self._node))

    async def nodes(self, request: web.Request) -> web.Response:
        """The registry as this node reads it, each row with whether a session with its node is up, when one last
        was, and the CA-signed revocations that name it. With `?revoked=true`, also the rows the registry ignores
        because the certificate that signed them is revoked (`"revoked": true`), which `DELETE /nodes/{name}` still
        removes."""
        with_revoked = request.query.get("revoked", "").lower() in ("1", "true", "yes")
        system = self._node.system()
        rows = self._node.verifier.listing(system, self._node.revoked)
        ignored = {}
        if with_revoked:
            ignored = {name: found for name, found in self._node.verifier.listing(system).items() if name not in rows}
        static = {peer.name: peer.url for peer in self._node.config.peers}
        revocations = self._node.revocations()
        now = self._node.loop.time()
        inbound = {peer for (peer, _), state in self._node.sending.items() if state.connected}
        listing = []
        for name in sorted(set(rows) | set(ignored) | set(static)):
            found = rows.get(name) or ignored.get(name)
            if found is not None:
                item = msgspec.to_builtins(found[0])
                item["source"] = found[2]
                if found[2] == "own":
                    # Which certificate signed it: during a CA rotation, every row must be signed by a certificate
                    # of the new CA before the old one leaves the bundles (RUNBOOK.md).
                    own = self._node.verifier.own_row(system, name)
                    item["certificate"] = _signer_summary(own[1]) if own is not None else None
            else:
                item = {"name": name, "url": static[name], "source": "config"}
            item["static"] = name in static
            item["self"] = name == self._node.name
            item["revoked"] = name in ignored
            item["revocations"] = [
                {"id": r.record_id, "serial": r.serial or None, "issued_before": r.issued_before}
                for r in revocations
                if r.name == name
            ]
            item.update(_NO_SESSIONS if item["self"] else self._sessions_with(name, name in inbound, now))
            listing.append(item)
        return _reply(listing)

    def _sessions_with(self, name: str, inbound: bool, now: float) -> dict[str, Any]:
        """Whether a session with node `name` is up (this node's subscriptions to it, or, `inbound`, one of its to
        this node), how many of this node's pairs with it are, and how long ago one last was (None: none since this
        node started)."""
        entry = self._node.map.by_peer(name)
        pairs = list(entry.pairs.values()) if entry is not None else []
        connected = sum(1 for pair in pairs if pair.connected)
        seen = self._node.peer_seen.get(name)
        up = bool(connected) or inbound
        return {
            "connected": up,
            "pairs": len(pairs),
            "pairs_connected": connected,
            "last_seen_s": 0.0 if up else (round(now - seen, 3) if seen is not None else None),
        }

    async def ca(self, request: web.Request) -> web.Response:
        loaded = self._node.credentials
        if loaded is not None:
            certs = loaded.cas
        else:
            config = self._node.config
            try:
                certs = ca_certificates(config_module.resolve_path(config, config.tls.ca))
            except TlsConfigError as exc:
                return _error(500, f"cannot read the CA certificate: {exc}")
        return web.Response(body=certificates_pem(certs), content_type="application/x-pem-file")

    async def put_node(self, request: web.Request) -> web.Response:
        """Introduce another node: a row signed by this node that lets the cluster admit and dial it until it
        writes its own (which always wins). A node's own row comes from its config, so it cannot be set here."""
        name = request.match_info["name"]
        if not NAME_RE.match(name):
            return _error(400, f"bad node name {name[:80]!r}: use 1 to 64 of A-Z a-z 0-9 _ -")
        if name == self._node.name:
            return _error(
                409,
                "this node's own row is written from its config (node.url, replication.databases,"
                " replication.mesh): change the config and reload",
            )
        try:
            update = msgspec.json.decode(await self._body(request), type=NodeUpdate)
        except msgspec.ValidationError as exc:
            return _error(400, f"bad node: {exc}")
        except msgspec.DecodeError as exc:
            return _error(400, f"body is not valid JSON: {exc}")
        if update.revoked is not None:
            return _error(
                400,
                "revoked: serials in registry rows are no longer honoured; revoke a certificate with"
                " `replicator certs revoke` (signed by the cluster CA)",
            )
        try:
            url = normalize_url(update.url)
        except ValueError as exc:
            return _error(400, f"bad url: {exc}")
        if not update.url.startswith(("wss://", "ws://")):
            return _error(400, f"bad url: expected wss://, got {update.url!r}")
        for pattern in update.databases:
            if not DATABASE_PATTERN_RE.match(pattern):
                return _error(400, f"bad databases: {pattern!r} is neither '*' nor a database name")
        signer = self._node.signer
        if signer is None:
            return _error(503, "the node has not loaded its certificate yet")
        system = self._node.system()
        current = self._node.verifier.listing(system, self._node.revoked).get(name)
        capped = membership.room_to_introduce(system, self._node.name, name)
        if capped is not None:
            return _reply({"error": f"cannot introduce {name!r}: {capped.reason}", "limit": capped.limit}, 409)
        row = NodeRow(
            name=name,
            url=url,
            databases=update.databases,
            replicates=update.replicates,
            leader=bool(update.leader),
        )
        version = membership.write(system, signer, membership.INTRODUCTIONS, row)
        self._node.poke_registry(full=False)  # one view changed: the registry pass looks at it alone
        answer: dict[str, Any] = {"name": name, "version": version, "introduced_by": self._node.name}
        if current is not None and current[2] == "own":
            answer["note"] = f"{name} has its own row, which takes precedence over an introduction"
        return _reply(answer)

    async def put_revocation(self, request: web.Request) -> web.Response:
        """Store a revocation the cluster CA signed (the document `replicator certs revoke` prints). It replicates
        to every node, each verifies the signature, and the sessions of the revoked certificate end."""
        name = request.match_info["name"]
        if not NAME_RE.match(name):
            return _error(400, f"bad node name {name[:80]!r}: use 1 to 64 of A-Z a-z 0-9 _ -")
        ca = self._node.verifier.ca  # the CA bundle the node loaded
        if ca is None:
            return _error(503, "the node has not loaded its CA certificate yet")
        try:
            found = revocation.parse(await self._body(request), ca)
        except revocation.BadRevocation as exc:
            return _error(400, str(exc))
        if found.name != name:
            return _error(400, f"the revocation is of {found.name!r}, not {name!r}")
        version = self._node.system().put(revocation.TABLE, found.record_id, revocation.encode(found))
        self._node.poke_registry()
        log.warning("certificate_revoked", name=name, serial=found.serial or "all", id=found.record_id)
        return _reply({"name": name, "id": found.record_id, "version": version, "revokes": found.describe()})

    async def revocations(self, request: web.Request) -> web.Response:
        """Every revocation the registry holds that a CA of this node's bundle signed, each with that CA: what
        `replicator certs resign` signs again with a new CA before the old one leaves the bundles."""
        ca = self._node.verifier.ca
        listing = []
        for found in sorted(self._node.revocations(), key=lambda r: r.record_id):
            authority = revocation.signed_by(found, ca) if ca is not None else None
            listing.append(
                {
                    "id": found.record_id,
                    "revocation": msgspec.to_builtins(found),
                    "revokes": found.describe(),
                    "signed_by": None
                    if authority is None
                    else {"subject": authority.subject.rfc4514_string(), "fingerprint": fingerprint(authority)},
                }
            )
        return _reply(listing)

    async def delete_node(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if not NAME_RE.match(name):
            return _error(400, f"bad node name {name[:80]!r}")
        if name == self._node.name:
            return _error(409, "a node cannot delete its own registry row")
        if not membership.remove(self._node.system(), name):
            return _error(404, f"no node {name!r} in the registry")
        self._node.poke_registry(full=False)
        return _reply({"name": name, "deleted": True})

    async def delete_database(self, request: web.Request) -> web.Response:
        """Delete a database cluster-wide (`shared.dropped`): a marker whose floors are what this node holds of it,
        per origin. Every node drops the records they cover, for good, and removes the database when nothing is
        left of it; a write made after the deletion survives it."""
        name = request.match_info["name"]
        if not NAME_RE.fullmatch(name):
            return _error(400, f"bad database name {name[:80]!r}: use 1 to 64 of A-Z a-z 0-9 _ -")
        if name == SYSTEM:
            return _error(400, "the system database holds the registry and cannot be deleted")
        drops = self._node.drops
        if not drops.known(name):
            return _error(404, f"no database {name!r} on this node, and no node of the registry holds one")
        try:
            version, floors = drops.request(name)
        except NotHeld as exc:
            holders = sorted(view.name for view in self._node.views.values() if name in view.holds)
            return _error(409, f"{exc} ({', '.join(holders) or 'none known'})")
        return _reply({"name": name, "version": version, "floors": floors})

    async def digest(self, request: web.Request) -> web.Response:
        name = request.match_info["database"]
        assert self._node.store is not None
        try:
            database = self._node.store.database(name)
        except BadName as exc:
            return _error(400, str(exc))
        except RefusedFile as exc:
            return _error(503, str(exc))
        except UnknownDatabase as exc:
            return _error(404, str(exc))
        # Off the loop: the scrub may hold the database's lock for a table scan (check_digests).
        tables = await asyncio.to_thread(database.digest)
        return _reply({"database": name, "tables": tables})

    async def antientropy(self, request: web.Request) -> web.Response:
        name = request.match_info.get("database")
        if name is not None and (refused := self._unheld(name)) is not None:
            return refused
        timeout = _timeout(request, None)
        if isinstance(timeout, web.Response):
            return timeout
        reports = await self._node.antientropy.run_now(name, timeout)
        return _reply(
            {"rounds": [report.summary() for report in reports], "repaired": sum(r.repaired for r in reports)}
        )

    async def reset_pair(self, request: web.Request) -> web.Response:
        """Renew this node's subscription to one peer for one database, without a restart: its session ends and a
        new one starts from this node's durable positions, on the setup ladder (the other direction is the peer's
        own subscription: reset it there)."""
        peer, database = request.match_info["peer"], request.match_info["database"]
        if not NAME_RE.match(peer):
            return _error(400, f"bad node name {peer[:80]!r}: use 1 to 64 of A-Z a-z 0-9 _ -")
        if not NAME_RE.match(database):
            return _error(400, f"bad database name {database[:80]!r}: use 1 to 64 of A-Z a-z 0-9 _ -")
        if not self._node.reset_pair(peer, database):
            return _error(404, f"this node does not replicate database {database!r} with {peer!r}")
        return _reply({"peer": peer, "database": database, "reset": True}, 202)

    def _unheld(self, name: str) -> web.Response | None:
        """The 400 for a bad database name, or the 404 for a database this node does not hold; None if it holds it."""
        if not NAME_RE.match(name):
            return _error(400, f"bad database name {name[:80]!r}: use 1 to 64 of A-Z a-z 0-9 _ -")
        if name not in self._node.holds:
            return _error(404, f"this node does not hold database {name!r}")
        return None

    async def repair_blobs(self, request: web.Request) -> web.Response:
        name = request.match_info["database"]
        if (refused := self._unheld(name)) is not None:
            return refused
        timeout = _timeout(request, MAX_WAIT)
        if isinstance(timeout, web.Response):
            return timeout
        assert timeout is not None
        try:
            answer = await self._node.blob_repairs.run(name, timeout)
        except NoWorker as exc:
            return _error(503, str(exc))
        except WorkerExited as exc:
            return _error(500, str(exc))
        except TimeoutError:
            return _error(504, f"the repair did not answer within {timeout:g} s; it goes on")
        document: dict[str, Any] = {
            "database": answer.database,
            "scanned": answer.scanned,
            "missing": answer.missing,
            "repaired": answer.repaired,
            "failed": msgspec.to_builtins(answer.failed),
        }
        if answer.error:
            document["error"] = answer.error
        return _reply(document, 500 if answer.error else 200)


STATUS_NAMES = 20  # names a /status field lists of a set a peer's row can make as large as it likes


def _over_limit(node: AdminView) -> dict[str, Any]:
    left_out = node.database_limit.left_out()
    return {
        "limit": node.config.data.max_databases,
        "taken": node.database_limit.count,  # held, or about to be created by a pair
        "count": len(left_out),
        "databases": left_out[:STATUS_NAMES],
    }


def _signer_summary(der: bytes) -> dict[str, Any] | None:
    """The certificate that signed a registry row: its name, serial, issuer and end of validity."""
    try:
        cert = x509.load_der_x509_certificate(der)
    except ValueError:
        return None
    identity = certificate_identity(cert)
    return {
        "name": identity.name if identity is not None else None,
        "serial": format(cert.serial_number, "x"),
        "issuer": cert.issuer.rfc4514_string(),
        "not_after": cert.not_valid_after_utc.timestamp(),
    }


def status_document(node: AdminView) -> dict[str, Any]:
    now = node.loop.time()
    live = {slot: handle.pid for slot, handle in node.supervisor.workers.items() if handle.alive and handle.pid}
    pss = memory.node_memory(os.getpid(), live)
    presented = node.worker_tls
    workers = [
        {
            "id": slot,
            "pid": handle.pid if handle.alive else None,
            "ready": handle.alive and handle.ready,
            "rss_bytes": handle.rss_bytes if handle.alive else 0,
            "pss_bytes": pss.workers.get(slot, 0),
            "restarts": handle.restarts,
            "exit_code": handle.exit_code,
            "boot_error": handle.boot_error or None,
            # The certificate the worker presents to new handshakes (its serial) and which load of the node it is.
            "tls_serial": presented[slot].serial if slot in presented else None,
            "tls_generation": presented[slot].generation if slot in presented else None,
        }
        for slot, handle in sorted(node.supervisor.workers.items())
    ]
    connections = []
    pairs_of: dict[str, list[str]] = {}
    for entry in sorted(node.map, key=lambda e: e.peer):
        for database in entry.pairs:
            pairs_of.setdefault(database, []).append(entry.peer)
        databases = []
        for database, pair in sorted(entry.pairs.items()):
            databases.append(
                {
                    "database": database,
                    "connected": pair.connected,
                    "worker": pair.worker if pair.worker is not None else pair.placed,
                    # The worker the coordinator placed the pair on (its next setup goes there); -1: none yet.
                    "placed": pair.placed,
                    "session": pair.session,
                    "setup_pending": node.scheduler.is_armed(entry.url, database),
                    "reconnect_attempts": pair.reconnect_attempts,
                    "last_received_seq": pair.last_received_seq,
                    "peer_head_seq": pair.peer_head_seq,
                    "lag_seconds": pair.lag_seconds,
                    "last_error": pair.last_error or None,
                    # The protocol version the pair's latest session speaks (None until one connected).
                    "protocol": pair.protocol or None,
                    "applied": pair.applied,
                    "caught_up": pair.caught_up,
                    # Origins the peer holds complete beyond this node, with this node's position for each; with
                    # `ahead_for_s`, how long none of them has moved (a stall past stall_threshold is renewed).
                    "ahead": dict(sorted(pair.ahead.items())),
                    "ahead_for_s": round(now - pair.ahead_since, 3) if pair.ahead_since is not None else None,
                    "copy": pair.copy(now),
                    # The current session's records: received (won or not) and applied; a record received
                    # again after a resume is the difference.
                    "session_records": {"received": pair.received, "applied": pair.session_applied},
                    "exclude": list(pair.payload.exclude),
                    "connected_for_s": round(now - pair.connected_at, 3)
                    if pair.connected and pair.connected_at is not None
                    else None,
                    "antientropy": _round_status(node, entry.key, database),
                }
            )
        # Each database is placed on a worker of its own: a peer's pairs may be spread over several workers.
        placed_on = sorted({pair.placed for pair in entry.pairs.values() if pair.placed >= 0})
        connections.append(
            {
                "peer": entry.peer,
                "url": entry.url,
                "workers": placed_on,
                # The workers whose multiplexed link to the peer is up (their LinkState reports).
                "links": node.links.workers_up(entry.key),
                "databases": databases,
            }
        )
    coordinator = {"pid": os.getpid(), "pss_bytes": pss.coordinator or 0}
    # The other processes the coordinator started (the worker template; multiprocessing's resource tracker when
    # workers are spawned) are the node's too.
    helpers = [{"pid": pid, "pss_bytes": size} for pid, size in sorted(pss.helpers.items())]
    return {
        "node": node.name,
        # What the node takes from the machine: PSS shares each page among the processes that map it.
        "coordinator": coordinator,
        "helpers": helpers,
        "pss_total_bytes": pss.total,
        "url": node.config.node.url,
        "ready": node.supervisor.all_ready(),
        "holds": sorted(node.holds),
        # Databases peers hold that the node does not take, being at data.max_databases (coordinator.database_limit).
        "databases_over_limit": _over_limit(node),
        "setup_pending": node.scheduler.pending,
        "workers": workers,
        "connections": connections,
        # Per database, the direct peers whose origins every connected peer carries (their link is down).
        "failed_over": node.router.failed_over(),
        "recovery": node.recoveries.status(pairs_of),
        # The sending end of each pair: what this node serves each peer that subscribes to it.
        "sending": [
            {
                "peer": state.peer,
                "database": state.database,
                "connected": state.connected,
                "worker": state.worker,
                "session": state.session,
                "batches_sent": state.batches_sent,
                "batches_acked": state.batches_acked,
                "records_sent": state.records_sent,
                "caught_up": state.caught_up,
                "blocked": state.blocked,
                "exclude": state.exclude,
                "protocol": state.protocol or None,
                "error": state.error or None,
            }
            for _, state in sorted(node.sending.items())
        ],
        "clock_offsets": {peer: offset for peer, offset in sorted(node.peer_clock.items())},
        # The TLS material the node loaded (boot or latest reload) and what each worker presents; the last reload.
        "tls": node.credentials.describe(dict(presented)) if node.credentials is not None else None,
        "reload": node.reload_health.status(),
        # Per held database, the last pass of the scrub (checksums, buckets and bucket digests verified).
        "scrub": {database: report.status() for database, report in node.antientropy.scrubs().items()},
    }


def _round_status(node: AdminView, key: str, database: str) -> dict[str, Any] | None:
    report = node.antientropy.last_round(key, database)
    return report.status() if report is not None else None
