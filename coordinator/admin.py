"""Admin HTTP, served by the coordinator (plain HTTP, loopback by default).

GET /metrics /healthz /readyz /status /nodes /digest/{database}
PUT /nodes/{name} {"url", "databases", "replicates"[, "leader", "revoked"]}   DELETE /nodes/{name}
POST /antientropy/{database} /antientropy [?timeout=SECONDS]   run an anti-entropy round now with every peer of
    the database (of every database the node holds) and answer when all came back:
    {"rounds": [{"peer", "database", "buckets_compared", "divergent_buckets", "repaired", "bytes", "seconds",
    "error"}], "repaired": total}
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from aiohttp import web

from coordinator.metrics import CONTENT_TYPE
from coordinator.view import AdminView
from shared.config import DATABASE_PATTERN_RE, NAME_RE
from shared.keys import normalize_url
from shared.store import BadName, NodeRow, UnknownDatabase, delete_node, read_nodes, write_node

_json = msgspec.json.Encoder()
MAX_WAIT = 3600.0  # the longest `?timeout=` a run-now request may ask for


def _reply(payload: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=_json.encode(payload), content_type="application/json")


def _error(status: int, message: str) -> web.Response:
    return _reply({"error": message}, status)


class NodeUpdate(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    url: str
    databases: list[str] = msgspec.field(default_factory=lambda: ["*"])
    replicates: bool = True
    leader: bool | None = None
    revoked: list[str] | None = None


class AdminServer:
    def __init__(self, node: AdminView) -> None:
        self._node = node
        self._runner: web.AppRunner | None = None
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/status", self.status)
        app.router.add_get("/nodes", self.nodes)
        app.router.add_put("/nodes/{name}", self.put_node)
        app.router.add_delete("/nodes/{name}", self.delete_node)
        app.router.add_get("/digest/{database}", self.digest)
        app.router.add_post("/antientropy", self.antientropy)
        app.router.add_post("/antientropy/{database}", self.antientropy)
        self._app = app

    async def start(self) -> None:
        listen = self._node.config.listen
        self._runner = web.AppRunner(self._app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, listen.admin_host, listen.admin_port, reuse_address=True)
        await site.start()

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self._node.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def healthz(self, request: web.Request) -> web.Response:
        return _reply({"status": "ok", "node": self._node.name})

    async def readyz(self, request: web.Request) -> web.Response:
        supervisor = self._node.supervisor
        waiting = [
            slot for slot, w in sorted(supervisor.workers.items()) if not (w.alive and w.ready) and not w.retiring
        ]
        if supervisor.all_ready():
            return _reply({"ready": True, "workers": len(supervisor.live())})
        return _reply({"ready": False, "waiting_for_workers": waiting, "boot_error": self._node.boot_error}, 503)

    async def status(self, request: web.Request) -> web.Response:
        return _reply(status_document(self._node))

    async def nodes(self, request: web.Request) -> web.Response:
        rows = read_nodes(self._node.system())
        static = {peer.name: peer.url for peer in self._node.config.peers}
        listing = []
        for name in sorted(set(rows) | set(static)):
            row = rows.get(name)
            item = msgspec.to_builtins(row) if row is not None else {"name": name, "url": static[name]}
            item["static"] = name in static
            item["self"] = name == self._node.name
            listing.append(item)
        return _reply(listing)

    async def put_node(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if not NAME_RE.match(name):
            return _error(400, f"bad node name {name[:80]!r}: use 1 to 64 of A-Z a-z 0-9 _ -")
        try:
            update = msgspec.json.decode(await request.read(), type=NodeUpdate)
        except msgspec.ValidationError as exc:
            return _error(400, f"bad node: {exc}")
        except msgspec.DecodeError as exc:
            return _error(400, f"body is not valid JSON: {exc}")
        try:
            url = normalize_url(update.url)
        except ValueError as exc:
            return _error(400, f"bad url: {exc}")
        if not update.url.startswith(("wss://", "ws://")):
            return _error(400, f"bad url: expected wss://, got {update.url!r}")
        for pattern in update.databases:
            if not DATABASE_PATTERN_RE.match(pattern):
                return _error(400, f"bad databases: {pattern!r} is neither '*' nor a database name")
        system = self._node.system()
        current = read_nodes(system).get(name)
        row = NodeRow(
            name=name,
            url=url,
            databases=update.databases,
            replicates=update.replicates,
            leader=update.leader if update.leader is not None else (current.leader if current else False),
            revoked=update.revoked if update.revoked is not None else (list(current.revoked) if current else []),
            holds=list(current.holds) if current else [],
        )
        version = write_node(system, row)
        self._node.poke_registry()
        return _reply({"name": name, "version": version})

    async def delete_node(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if not NAME_RE.match(name):
            return _error(400, f"bad node name {name[:80]!r}")
        if name == self._node.name:
            return _error(409, "a node cannot delete its own registry row")
        if delete_node(self._node.system(), name) is None:
            return _error(404, f"no node {name!r} in the registry")
        self._node.poke_registry()
        return _reply({"name": name, "deleted": True})

    async def digest(self, request: web.Request) -> web.Response:
        name = request.match_info["database"]
        assert self._node.store is not None
        try:
            database = self._node.store.database(name)
        except BadName as exc:
            return _error(400, str(exc))
        except UnknownDatabase as exc:
            return _error(404, str(exc))
        # Off the loop: the scrub may hold the database's lock for a table scan (check_digests).
        tables = await asyncio.to_thread(database.digest)
        return _reply({"database": name, "tables": tables})

    async def antientropy(self, request: web.Request) -> web.Response:
        name = request.match_info.get("database")
        if name is not None:
            if not NAME_RE.match(name):
                return _error(400, f"bad database name {name[:80]!r}: use 1 to 64 of A-Z a-z 0-9 _ -")
            if name not in self._node.holds:
                return _error(404, f"this node does not hold database {name!r}")
        timeout: float | None = None
        if "timeout" in request.query:
            try:
                timeout = float(request.query["timeout"])
            except ValueError:
                timeout = -1.0
            if not 0 < timeout <= MAX_WAIT:
                return _error(400, f"bad timeout {request.query['timeout'][:40]!r}: seconds in (0, {MAX_WAIT:g}]")
        reports = await self._node.antientropy.run_now(name, timeout)
        return _reply(
            {"rounds": [report.summary() for report in reports], "repaired": sum(r.repaired for r in reports)}
        )


def status_document(node: AdminView) -> dict[str, Any]:
    now = node.loop.time()
    workers = [
        {
            "id": slot,
            "pid": handle.pid if handle.alive else None,
            "ready": handle.alive and handle.ready,
            "rss_bytes": handle.rss_bytes if handle.alive else 0,
            "restarts": handle.restarts,
            "exit_code": handle.exit_code,
            "boot_error": handle.boot_error or None,
        }
        for slot, handle in sorted(node.supervisor.workers.items())
    ]
    connections = []
    for entry in sorted(node.map, key=lambda e: e.peer):
        databases = []
        for database, pair in sorted(entry.pairs.items()):
            databases.append(
                {
                    "database": database,
                    "connected": pair.connected,
                    "worker": pair.worker if pair.worker is not None else entry.worker,
                    "session": pair.session,
                    "setup_pending": node.scheduler.is_armed(entry.url, database),
                    "reconnect_attempts": pair.reconnect_attempts,
                    "last_received_seq": pair.last_received_seq,
                    "peer_head_seq": pair.peer_head_seq,
                    "lag_seconds": pair.lag_seconds,
                    "last_error": pair.last_error or None,
                    "applied": pair.applied,
                    "caught_up": pair.caught_up,
                    "exclude": list(pair.payload.exclude),
                    "connected_for_s": round(now - pair.connected_at, 3)
                    if pair.connected and pair.connected_at is not None
                    else None,
                    "antientropy": _round_status(node, entry.key, database),
                }
            )
        connections.append({"peer": entry.peer, "url": entry.url, "worker": entry.worker, "databases": databases})
    return {
        "node": node.name,
        "url": node.config.node.url,
        "ready": node.supervisor.all_ready(),
        "holds": sorted(node.holds),
        "setup_pending": node.scheduler.pending,
        "workers": workers,
        "connections": connections,
        # Per database, the direct peers whose origins every connected peer carries (their link is down).
        "failed_over": node.router.failed_over(),
        "recovery": {name: dict(state) for name, state in sorted(node.recoveries.items())},
        "clock_offsets": {peer: offset for peer, offset in sorted(node.peer_clock.items())},
        # Per held database, the last pass of the scrub (checksums, buckets and bucket digests verified).
        "scrub": {database: report.status() for database, report in node.antientropy.scrubs().items()},
    }


def _round_status(node: AdminView, key: str, database: str) -> dict[str, Any] | None:
    report = node.antientropy.last_round(key, database)
    return report.status() if report is not None else None
