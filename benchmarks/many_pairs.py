"""1,000 pairs on one node (issue 12, item 4): setup, dispatch spacing, memory, idle CPU and throughput; prints JSON.

Scenarios (`--scenario`, default `both`):

two-nodes    Two real nodes, a and b (`--workers` workers each), each a static peer of the other. `--databases` D
             (500) databases are created with one write each, alternately on a and on b; each reaches the other
             node, so both hold all D, and each node has D + 1 pairs out (system included) and as many sessions in:
             2 (D + 1) pairs in all.
fifty-peers  One real node n and `--peers` P (50) lightweight peers in this process, `--per-peer` K (20) databases
             each: P x K databases on n, P x (K + 1) pairs out of n (system included). A lightweight peer is what n
             sees of a real one: its own certificate from the cluster CA, an introduction on n (`PUT /nodes`) so n
             dials it, a signed registry row of its own (holds its K databases) served on n's system subscription,
             a WebSocket server that answers n's subscriptions (Hello, Schema, one record, marks, caught up, then
             takes acks and holds), and a subscriber of its own to each of its databases on n once n's row says n
             holds it (n's row comes over the peer's subscription to n's system database), acking every batch.
             All P peers run on this process's one event loop, so they take CPU from the same two cores as n.
             Fifty real nodes would be 150 processes (a coordinator and two workers each) on this two-core machine:
             the figures would be the scheduler's, not n's. The peers write nothing after their first record, so
             fifty-peers measures n's outbound pairs and n's senders, not the peers' side of the streams.

Figures, per scenario:

connect_s              seconds from the first database created (two-nodes) or the first introduction (fifty-peers)
                       until every pair a node wants is connected: per node, the latest first `session_connected`
                       of its wanted pairs (from its log); `observed_s` is when /status, polled every `--poll`
                       seconds, first showed them all. fifty-peers also gives `peer_sessions_s`: until every
                       lightweight subscriber to n was streaming.
dispatch               per node, its `subscription_setup_dispatched` events until everything connected: how many,
                       the smallest, median and 90th percentile gap between consecutive dispatches (seconds;
                       `replication.stagger`, 0.05 s, is the floor the ladder keeps), and the span first to last.
                       Every setup takes a slot of one ladder, so connect_s is at least dispatches x stagger; a
                       median gap above the stagger, or more dispatches than pairs, is time lost by the coordinator.
memory                 with everything connected and settled: RSS and PSS (`shared.memory.pss_bytes`) of each process
                       of the node (coordinator, workers, any other child) and the node's totals.
idle_cpu               with everything connected and nothing written for `--idle-seconds`: the CPU each process of the
                       node used, as a percentage of one core, and the node's total.
throughput             `--records` N records (about 100 bytes each) written through the data API of a (n), spread
                       round-robin over every database in requests of `--batch` records, `--clients` at a time:
                       `applied_per_s` is N over the time from the first record committed on a to the last applied on
                       b (audit `committed_at`, one clock) or, fifty-peers, to the last received by the peers;
                       `written_per_s` is the rate a took the writes at.

`--baseline REV` measures REV (a git revision, through a temporary worktree, or the path of a source tree) and this
tree in the same invocation, in child processes, alternating (`--repeat` rounds); the medians of the main figures and
their ratios current / baseline are given. `--py-spy DIR` records the node's coordinator and workers with py-spy
(raw folded stacks) during setup and during the idle window; the figures of such a run are disturbed by it.
`--keep-logs DIR` keeps the nodes' logs. Two-core machine, full sizes: about 4 minutes per tree for both scenarios.

    .venv/bin/python benchmarks/many_pairs.py [--scenario two-nodes|fifty-peers|both] [--databases 500]
        [--peers 50] [--per-peer 20] [--records 100000] [--idle-seconds 20]
    .venv/bin/python benchmarks/many_pairs.py --databases 40 --peers 5 --per-peer 4 --records 2000 --idle-seconds 5
    .venv/bin/python benchmarks/many_pairs.py --baseline HEAD [--repeat 1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import itertools
import os
import random
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import msgspec
import psutil
from aiohttp import WSMsgType, web

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness

HOST = "127.0.0.1"
SYSTEM = "system"
TABLE = "load"
MAX_FRAME = 16 * 1024 * 1024


class Tree:
    """The modules of the tree under test: the nodes run its code, and the lightweight peers speak its protocol."""

    def __init__(self, code: Path) -> None:
        self.code = code
        self.local_cluster = harness.use_code(code)
        self.wire = _module("shared.wire")
        self.membership = _module("shared.membership")
        self.tls = _module("shared.tls")
        self.store = _module("shared.store")
        self.memory = _module("shared.memory")


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"replicator.{name}")


async def limited(calls: Iterable[Callable[[], Awaitable[Any]]], concurrency: int) -> list[Any]:
    gate = asyncio.Semaphore(concurrency)

    async def one(call: Callable[[], Awaitable[Any]]) -> Any:
        async with gate:
            return await call()

    return await asyncio.gather(*(one(call) for call in calls))


# -- what a node shows -------------------------------------------------------------------------------------------


def spacing(times: list[float]) -> dict[str, Any]:
    times = sorted(times)
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    if not gaps:
        return {"dispatches": len(times)}
    return {
        "dispatches": len(times),
        "min_gap_s": round(min(gaps), 4),
        "median_gap_s": round(statistics.median(gaps), 4),
        "p90_gap_s": round(harness.percentile(gaps, 0.9), 4),
        "span_s": round(times[-1] - times[0], 3),
    }


def dispatch_spacing(node: Any, start: float, end: float) -> dict[str, Any]:
    events = node.events("subscription_setup_dispatched")
    return spacing([e["ts"] for e in events if start <= e["ts"] <= end])


def memory_figures(tree: Tree, processes: dict[str, psutil.Process]) -> dict[str, Any]:
    rss: dict[str, int] = {}
    pss: dict[str, int] = {}
    for role, process in processes.items():
        try:
            rss[role] = process.memory_info().rss
        except psutil.Error:
            continue
        pss[role] = tree.memory.pss_bytes(process.pid) or 0
    mib = 2**20
    return {
        "rss_mib": {role: round(value / mib, 1) for role, value in rss.items()},
        "pss_mib": {role: round(value / mib, 1) for role, value in pss.items()},
        "rss_total_mib": round(sum(rss.values()) / mib, 1),
        "pss_total_mib": round(sum(pss.values()) / mib, 1),
    }


async def applied_total(cluster: Any, name: str, peer: str) -> float:
    """The node's replicator_records_applied_total from `peer`, summed over databases."""
    # A baseline tree from before the admin token (issue 21) has no admin_headers: its admin port asks none.
    headers = getattr(cluster[name], "admin_headers", {})
    async with cluster.http.get(cluster[name].admin_url + "/metrics", headers=headers) as response:
        text = await response.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("replicator_records_applied_total{") and f'peer="{peer}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def load_body(database: str, start: int, count: int) -> list[dict[str, Any]]:
    value = {"database": database, "pad": "x" * 48}
    return [{"id": f"r{i:07d}", "value": {**value, "i": i}} for i in range(start, start + count)]


async def write_load(cluster: Any, name: str, databases: list[str], records: int, batch: int, clients: int) -> int:
    """`records` records written through `name`'s data API, round-robin over `databases`; returns how many."""
    requests: list[tuple[str, int, int]] = []
    offsets = dict.fromkeys(databases, 0)
    written = 0
    index = 0
    while written < records:
        database = databases[index % len(databases)]
        count = min(batch, records - written)
        requests.append((database, offsets[database], count))
        offsets[database] += count
        written += count
        index += 1

    async def post(database: str, start: int, count: int) -> None:
        status, body = await cluster.data(name, "POST", f"/data/{database}/{TABLE}", load_body(database, start, count))
        if status != 200:
            raise RuntimeError(f"POST /data/{database}/{TABLE} answered {status}: {body}")

    await limited([lambda r=r: post(*r) for r in requests], clients)
    return written


def committed_span(folder: Path, databases: list[str], origin: str) -> tuple[float, float, int]:
    """(first, last committed_at, count) of the `load` records of `origin` in the databases' files in `folder`."""
    first, last, count = float("inf"), float("-inf"), 0
    for database in databases:
        path = folder / f"{database}.sqlite"
        if not path.exists():
            continue
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
            low, high, n = conn.execute(
                "SELECT min(committed_at), max(committed_at), count(*) FROM audit WHERE tbl = ? AND origin = ?",
                (TABLE, origin),
            ).fetchone()
        if n:
            first, last, count = min(first, low), max(last, high), count + n
    return first, last, count


# -- py-spy -------------------------------------------------------------------------------------------------------


class Profiler:
    """py-spy recording the node's processes (raw folded stacks, one file per process and phase)."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        self._running: list[subprocess.Popen[bytes]] = []

    def start(self, label: str, processes: dict[str, psutil.Process]) -> None:
        if self.folder is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        spy = Path(sys.executable).with_name("py-spy")
        for role, process in processes.items():
            if not (role == "coordinator" or role.startswith("worker")):
                continue
            output = self.folder / f"{label}-{role}.txt"
            command = [str(spy), "record", "--pid", str(process.pid), "--rate", "50", "--format", "raw"]
            command += ["--nonblocking", "--output", str(output)]
            self._running.append(
                subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            )

    def stop(self) -> None:
        running, self._running = self._running, []
        for spy in running:
            if spy.poll() is None:
                spy.send_signal(signal.SIGINT)
        for spy in running:
            try:
                spy.wait(30)
            except subprocess.TimeoutExpired:
                spy.kill()
                spy.wait()


# -- two nodes ----------------------------------------------------------------------------------------------------


async def two_nodes(tree: Tree, options: argparse.Namespace) -> dict[str, Any]:
    count = options.databases
    names = [f"db{i:04d}" for i in range(count)]
    wanted = harness.full_mesh_pairs(["a", "b"], names)
    profiler = Profiler(options.py_spy and Path(options.py_spy) / "two-nodes")
    with tempfile.TemporaryDirectory(prefix="replicator-pairs-") as folder:
        replication = {"shutdown_timeout": 20.0}
        cluster = tree.local_cluster.LocalCluster(folder, ["a", "b"], workers=options.workers, replication=replication)
        cluster.prepare()
        cluster.start()
        try:
            await cluster.wait_ready(timeout=120)
            status = {name: (await cluster.admin(name, "/status"))[1] for name in ("a", "b")}
            profiler.start("setup-a", harness.node_processes(cluster["a"], status["a"]))
            started = time.time()
            await harness.create_databases(cluster, ["a", "b"], list(enumerate(names)), options.clients)
            created = time.time()
            observed, status = await harness.wait_connected(cluster, wanted, options.timeout, options.poll)
            profiler.stop()
            connect: dict[str, Any] = {
                "pairs_per_node": count + 1,
                "created_s": round(created - started, 3),
                "observed_s": round(observed - started, 3),
            }
            dispatch = {}
            for name in ("a", "b"):
                first = harness.first_connected(cluster[name], wanted[name])
                connect[name] = round(max(first.values()) - started, 3) if len(first) == count + 1 else None
                dispatch[name] = dispatch_spacing(cluster[name], started, observed)
            await asyncio.sleep(options.settle)
            processes = {name: harness.node_processes(cluster[name], status[name]) for name in ("a", "b")}
            memory = {name: memory_figures(tree, found) for name, found in processes.items()}
            profiler.start("idle-a", processes["a"])
            idle = await harness.idle_cpu(processes, options.idle_seconds)
            profiler.stop()
            throughput: dict[str, Any] = {"records": options.records}
            if options.records:
                before = await applied_total(cluster, "b", "a")
                await write_load(cluster, "a", names, options.records, options.batch, options.clients)
                deadline = time.monotonic() + options.timeout
                while await applied_total(cluster, "b", "a") < before + options.records:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"b did not apply {options.records} records in {options.timeout} s")
                    await asyncio.sleep(0.5)
        finally:
            profiler.stop()
            cluster.stop()
            await cluster.close()
            harness.keep_logs(cluster, options.keep_logs, "two-nodes")
        if options.records:
            first, last_written, written = committed_span(Path(folder) / "a" / "data", names, "a")
            _, last_applied, applied = committed_span(Path(folder) / "b" / "data", names, "a")
            throughput.update(
                applied=applied,
                seconds=round(last_applied - first, 3),
                applied_per_s=round(applied / (last_applied - first), 1),
                written_per_s=round(written / (last_written - first), 1),
            )
    return {
        "scenario": "two-nodes",
        "databases": count,
        "workers": options.workers,
        "connect_s": connect,
        "dispatch": dispatch,
        "memory": memory,
        "idle_cpu": idle,
        "throughput": throughput,
    }


# -- fifty lightweight peers ----------------------------------------------------------------------------------------


class Closed(Exception):
    """The other end closed the WebSocket, or sent what a lightweight peer does not expect."""


async def expect(tree: Tree, ws: Any, kind: type, timeout: float | None = 30.0) -> Any:
    message = await ws.receive(timeout=timeout)
    if message.type != WSMsgType.BINARY:
        raise Closed(f"{message.type!r}: {message.data!r} {message.extra!r}")
    decoded = tree.wire.decode(message.data)
    if not isinstance(decoded, kind):
        raise Closed(f"expected {kind.__name__}, got {type(decoded).__name__}")
    return decoded


class LightPeer:
    """One lightweight peer: a name, a certificate, K databases with one record each, a signed row of its own."""

    def __init__(self, fleet: Fleet, name: str, port: int, databases: list[str]) -> None:
        tree = fleet.tree
        self.fleet = fleet
        self.name = name
        self.port = port
        self.databases = databases
        folder = fleet.folder / name
        tree.tls.issue_node_cert(fleet.ca_dir, name, [HOST, "localhost"], folder)
        ca = fleet.ca_dir / "ca.pem"
        self.server_ssl = tree.tls.server_context(ca, folder / f"{name}.pem", folder / f"{name}.key")
        self.client_ssl = tree.tls.client_context(ca, folder / f"{name}.pem", folder / f"{name}.key")
        signer = tree.membership.Signer.load(name, folder / f"{name}.pem", folder / f"{name}.key")
        now = int(time.time() * 1_000_000)
        row = tree.store.NodeRow(name=name, url=self.url, replicates=True, holds=sorted(databases))
        self.row = tree.membership.signed_entry(signer, tree.membership.NODES, row, now)
        value = msgspec.msgpack.encode({"peer": name})
        self.seeds = {database: tree.wire.Entry("t", "seed", value, now + 1, name) for database in databases}
        # What this peer holds of n's databases, per origin, from the marks of the batches it took.
        self.progress: dict[str, dict[str, int]] = {database: {name: now + 1} for database in databases}
        self.subscribed: set[str] = set()

    @property
    def url(self) -> str:
        return f"wss://{HOST}:{self.port}"

    # The sending end: n subscribes to this peer's system database and to each of its databases.

    async def serve(self, ws: web.WebSocketResponse) -> None:
        wire = self.fleet.tree.wire
        await expect(self.fleet.tree, ws, wire.Hello)
        hello = wire.Hello(node=self.name, capabilities=wire.CAPABILITIES, wall=time.time(), max_frame=MAX_FRAME)
        await ws.send_bytes(wire.encode(hello))
        subscribe = await expect(self.fleet.tree, ws, wire.Subscribe)
        if subscribe.database == SYSTEM:
            entries = [self.row]
        elif subscribe.database in self.seeds:
            entries = [self.seeds[subscribe.database]]
        else:
            await ws.close(code=wire.CLOSE_POLICY, message=b"not held")
            return
        mark = entries[-1].version
        behind = subscribe.progress.get(self.name, 0) < mark
        schema = wire.Schema(database=subscribe.database, epoch=self.name, head_seq=1, backlog=len(entries) * behind)
        await ws.send_bytes(wire.encode(schema))
        batch = wire.Batch(
            entries=entries if behind else [], marks={self.name: mark} if behind else {}, head_seq=1, caught_up=True
        )
        await ws.send_bytes(wire.encode(batch))
        while True:  # acks and holds; nothing more to serve
            message = await ws.receive()
            if message.type != WSMsgType.BINARY:
                return

    # The subscribing end: this peer's subscriptions to n, its system database first.

    def on_batch(self, database: str, batch: Any) -> None:
        fleet = self.fleet
        for origin, mark in batch.marks.items():
            progress = self.progress.setdefault(database, {})
            progress[origin] = max(progress.get(origin, 0), mark)
        if database == SYSTEM:
            for entry in batch.entries:
                if entry.table == "nodes" and entry.id == fleet.node_name and not entry.tombstone:
                    signed = msgspec.msgpack.decode(entry.value, type=fleet.tree.membership.SignedRow)
                    for held in sorted(set(signed.row.holds) & set(self.databases) - self.subscribed):
                        self.subscribed.add(held)
                        fleet.spawn(self.subscribe(held))
            return
        now = time.time()
        for entry in batch.entries:
            if entry.table == TABLE:
                fleet.received.add((database, entry.id))
                fleet.last_received = now

    async def subscribe(self, database: str) -> None:
        fleet = self.fleet
        wire = fleet.tree.wire
        delay = 0.5
        while not fleet.stopping:
            ws = None
            try:
                ws = await fleet.http.ws_connect(
                    fleet.node_url + "/replication",
                    protocols=[wire.SUBPROTOCOL],
                    ssl=self.client_ssl,
                    heartbeat=5.0,
                    max_msg_size=MAX_FRAME,
                )
                hello = wire.Hello(
                    node=self.name, capabilities=wire.CAPABILITIES, wall=time.time(), max_frame=MAX_FRAME
                )
                await ws.send_bytes(wire.encode(hello))
                await expect(fleet.tree, ws, wire.Hello)
                progress = dict(self.progress.get(database, {}))
                await ws.send_bytes(wire.encode(wire.Subscribe(database=database, progress=progress)))
                await expect(fleet.tree, ws, wire.Schema)
                fleet.streaming(self.name, database)
                delay = 0.5
                acked = 0
                while True:
                    batch = await expect(fleet.tree, ws, wire.Batch, timeout=None)
                    self.on_batch(database, batch)
                    acked += 1
                    await ws.send_bytes(wire.encode(wire.Ack(seq=acked)))
            except (aiohttp.ClientError, OSError, TimeoutError, Closed, wire.MalformedFrame):
                pass
            finally:
                if ws is not None:
                    await ws.close()
            if fleet.stopping:
                return
            fleet.reconnects += 1
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 10.0)


class Fleet:
    """The lightweight peers, on this process's loop: one HTTPS server with a site per peer, one client session."""

    def __init__(self, tree: Tree, folder: Path, ca_dir: Path, node_name: str, node_url: str) -> None:
        self.tree = tree
        self.folder = folder
        self.ca_dir = ca_dir
        self.node_name = node_name
        self.node_url = node_url
        self.peers: dict[int, LightPeer] = {}  # by port
        self.stopping = False
        self.received: set[tuple[str, str]] = set()
        self.last_received = 0.0
        self.first_streaming: dict[tuple[str, str], float] = {}
        self.reconnects = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._sockets: set[web.WebSocketResponse] = set()
        self._runner: web.AppRunner | None = None
        self.http: aiohttp.ClientSession = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    def add(self, name: str, port: int, databases: list[str]) -> LightPeer:
        peer = LightPeer(self, name, port, databases)
        self.peers[port] = peer
        return peer

    async def start(self) -> None:
        app = web.Application(client_max_size=MAX_FRAME)
        app.router.add_get("/replication", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        for port, peer in self.peers.items():
            await web.TCPSite(self._runner, HOST, port, ssl_context=peer.server_ssl).start()

    async def _handle(self, request: web.Request) -> web.WebSocketResponse:
        port = request.transport.get_extra_info("sockname")[1] if request.transport is not None else 0
        peer = self.peers[port]
        ws = web.WebSocketResponse(protocols=[self.tree.wire.SUBPROTOCOL], heartbeat=5.0, max_msg_size=MAX_FRAME)
        await ws.prepare(request)
        self._sockets.add(ws)
        try:
            await peer.serve(ws)
        except (Closed, OSError, TimeoutError, ConnectionError, self.tree.wire.MalformedFrame):
            pass
        finally:
            self._sockets.discard(ws)
            await ws.close()
        return ws

    def follow(self) -> None:
        """Every peer subscribes to n's system database; n's own row there says which databases n holds."""
        for peer in self.peers.values():
            peer.subscribed.add(SYSTEM)
            self.spawn(peer.subscribe(SYSTEM))

    def spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def streaming(self, peer: str, database: str) -> None:
        self.first_streaming.setdefault((peer, database), time.time())

    async def close(self) -> None:
        self.stopping = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(ws.close() for ws in list(self._sockets)), return_exceptions=True)
        await self.http.close()
        if self._runner is not None:
            await self._runner.cleanup()


async def fifty_peers(tree: Tree, options: argparse.Namespace) -> dict[str, Any]:
    count, per_peer = options.peers, options.per_peer
    peer_names = [f"p{i:02d}" for i in range(count)]
    databases = {name: [f"{name}_d{j:02d}" for j in range(per_peer)] for name in peer_names}
    every = [database for name in peer_names for database in databases[name]]
    wanted = {"n": {name: [SYSTEM, *databases[name]] for name in peer_names}}
    profiler = Profiler(options.py_spy and Path(options.py_spy) / "fifty-peers")
    with tempfile.TemporaryDirectory(prefix="replicator-pairs-") as folder:
        replication = {"shutdown_timeout": 20.0}
        cluster = tree.local_cluster.LocalCluster(
            folder, ["n"], workers=options.workers, topology={"n": []}, replication=replication
        )
        cluster.prepare()
        fleet = Fleet(tree, Path(folder) / "peers", cluster.dir / "ca", "n", cluster["n"].url)
        ports = tree.local_cluster.free_ports(count)
        for name, port in zip(peer_names, ports, strict=True):
            fleet.add(name, port, databases[name])
        await fleet.start()
        cluster.start()
        try:
            await cluster.wait_ready(timeout=120)
            status = (await cluster.admin("n", "/status"))[1]
            profiler.start("setup-n", harness.node_processes(cluster["n"], status))
            started = time.time()
            for peer in fleet.peers.values():
                code, body = await cluster.admin_request("n", "PUT", f"/nodes/{peer.name}", {"url": peer.url})
                if code != 200:
                    raise RuntimeError(f"introducing {peer.name} answered {code}: {body}")
            fleet.follow()
            observed, documents = await harness.wait_connected(cluster, wanted, options.timeout, options.poll)
            status = documents["n"]
            streams = len(every) + count
            deadline = time.monotonic() + options.timeout
            while len(fleet.first_streaming) < streams:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{streams - len(fleet.first_streaming)} peer subscriptions never streamed")
                await asyncio.sleep(options.poll)
            profiler.stop()
            first = harness.first_connected(cluster["n"], wanted["n"])
            pairs = len(every) + count
            connect = {
                "pairs": pairs,
                "observed_s": round(observed - started, 3),
                "n": round(max(first.values()) - started, 3) if len(first) == pairs else None,
                "peer_sessions": streams,
                "peer_sessions_s": round(max(fleet.first_streaming.values()) - started, 3),
                "peer_reconnects": fleet.reconnects,
            }
            dispatch = {"n": dispatch_spacing(cluster["n"], started, observed)}
            await asyncio.sleep(options.settle)
            processes = {"n": harness.node_processes(cluster["n"], status)}
            memory = {"n": memory_figures(tree, processes["n"])}
            memory["benchmark_process_rss_mib"] = round(psutil.Process().memory_info().rss / 2**20, 1)
            profiler.start("idle-n", processes["n"])
            idle = await harness.idle_cpu(processes, options.idle_seconds)
            profiler.stop()
            throughput: dict[str, Any] = {"records": options.records}
            if options.records:
                fleet.received.clear()
                await write_load(cluster, "n", every, options.records, options.batch, options.clients)
                deadline = time.monotonic() + options.timeout
                while len(fleet.received) < options.records:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the peers received {len(fleet.received)} of {options.records} records")
                    await asyncio.sleep(0.2)
                received_at = fleet.last_received
        finally:
            profiler.stop()
            cluster.stop()
            await cluster.close()
            await fleet.close()
            harness.keep_logs(cluster, options.keep_logs, "fifty-peers")
        if options.records:
            first_write, last_written, written = committed_span(Path(folder) / "n" / "data", every, "n")
            throughput.update(
                received=len(fleet.received),
                seconds=round(received_at - first_write, 3),
                applied_per_s=round(len(fleet.received) / (received_at - first_write), 1),
                written_per_s=round(written / (last_written - first_write), 1),
            )
    return {
        "scenario": "fifty-peers",
        "peers": count,
        "databases_per_peer": per_peer,
        "workers": options.workers,
        "connect_s": connect,
        "dispatch": dispatch,
        "memory": memory,
        "idle_cpu": idle,
        "throughput": throughput,
    }


# -- running and comparing ------------------------------------------------------------------------------------------

SCENARIOS = {"two-nodes": two_nodes, "fifty-peers": fifty_peers}
# The figure of each scenario the comparison gives medians and ratios of: (name, path into the result).
FIGURES: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    "two-nodes": [
        ("connect_s_a", ("connect_s", "a")),
        ("connect_s_b", ("connect_s", "b")),
        ("dispatch_median_gap_s_a", ("dispatch", "a", "median_gap_s")),
        ("pss_total_mib_a", ("memory", "a", "pss_total_mib")),
        ("idle_total_core_percent_a", ("idle_cpu", "a", "total_core_percent")),
        ("idle_total_core_percent_b", ("idle_cpu", "b", "total_core_percent")),
        ("applied_per_s", ("throughput", "applied_per_s")),
    ],
    "fifty-peers": [
        ("connect_s_n", ("connect_s", "n")),
        ("peer_sessions_s", ("connect_s", "peer_sessions_s")),
        ("dispatch_median_gap_s_n", ("dispatch", "n", "median_gap_s")),
        ("pss_total_mib_n", ("memory", "n", "pss_total_mib")),
        ("idle_total_core_percent_n", ("idle_cpu", "n", "total_core_percent")),
        ("applied_per_s", ("throughput", "applied_per_s")),
    ],
}


def scenarios(options: argparse.Namespace) -> list[str]:
    return list(SCENARIOS) if options.scenario == "both" else [options.scenario]


async def measure(options: argparse.Namespace) -> dict[str, Any]:
    harness.raise_fd_limit()
    tree = Tree(options.code.resolve())
    results: dict[str, Any] = {"code": str(tree.code)}
    for scenario in scenarios(options):
        results[scenario] = await SCENARIOS[scenario](tree, options)
    results["load_average_1m"] = round(os.getloadavg()[0], 2)
    return results


def _figure(result: dict[str, Any], path: tuple[str, ...]) -> float | None:
    found: Any = result
    for key in path:
        if not isinstance(found, dict) or key not in found:
            return None
        found = found[key]
    return found if isinstance(found, int | float) else None


def compare(options: argparse.Namespace, args: list[str]) -> dict[str, Any]:
    baseline_rev, current_rev, runs = harness.alternate(__file__, options.baseline, args, options.repeat)
    summary: dict[str, Any] = {}
    for scenario in scenarios(options):
        medians = {
            side: {
                name: harness.median([_figure(run[scenario], path) for run in found], 3)
                for name, path in FIGURES[scenario]
            }
            for side, found in runs.items()
        }
        ratios = {
            name: harness.ratio(medians["current"][name], medians["baseline"][name]) for name, _ in FIGURES[scenario]
        }
        summary[scenario] = {"baseline": medians["baseline"], "current": medians["current"], "ratios": ratios}
    return harness.comparison("many_pairs", options.repeat, baseline_rev, current_rev, summary, runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=["two-nodes", "fifty-peers", "both"], default="both")
    parser.add_argument("--databases", type=int, default=500, help="two-nodes: databases (default 500)")
    parser.add_argument("--peers", type=int, default=50, help="fifty-peers: lightweight peers (default 50)")
    parser.add_argument("--per-peer", type=int, default=20, help="fifty-peers: databases per peer (default 20)")
    parser.add_argument("--workers", type=int, default=2, help="workers per node (default 2)")
    parser.add_argument("--records", type=int, default=100_000, help="records written for throughput; 0 skips it")
    parser.add_argument("--batch", type=int, default=50, help="records per write request (default 50)")
    parser.add_argument("--clients", type=int, default=16, help="concurrent requests (default 16)")
    parser.add_argument("--idle-seconds", type=float, default=20.0, help="idle window measured (default 20)")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds after connected before measuring")
    parser.add_argument("--poll", type=float, default=1.0, help="seconds between /status polls (default 1)")
    parser.add_argument("--timeout", type=float, default=900.0, help="give up on a phase after this (default 900)")
    parser.add_argument("--py-spy", metavar="DIR", help="record the node's processes with py-spy into DIR")
    parser.add_argument("--keep-logs", metavar="DIR", help="copy the nodes' logs into DIR")
    harness.comparison_options(parser)
    options = parser.parse_args()
    result = compare(options, harness.side_args(sys.argv[1:])) if options.baseline else asyncio.run(measure(options))
    harness.print_json(result)


if __name__ == "__main__":
    main()
