"""Blob requests of a hostile peer holding a cluster certificate (issue 21): what they cost the serving worker, this
tree beside a baseline revision (before the blob limits), each in a child process; prints JSON.

Each side runs one node `a` (1 worker) of its own tree's LocalCluster (`harness.use_code`), and `mallet`, a peer
with a certificate of the cluster's CA (the integration tests' `FakePeer`, imported from the same tree's
`tests/integration/test_hostile_peer.py`), registered on `a` as a replicating peer. Everything is on loopback with
TLS host checks on. While each scenario runs, a thread of the benchmark polls a data API read of a small record
(`GET /data/probe/t/p` on the node port, served by the same worker) every 10 ms: its slowest answer (`probe_max_ms`)
is an outside measure of how long the worker's loop stalled; the same thread samples the worker's RSS
(`rss_growth_mb`: the peak over the RSS before the scenario).

    range_requests   an 8 MB blob stored on `a`; mallet sends `--requests` (200) requests for its last 4 bytes
                     (`Range: bytes=N-`) to the endpoint peers fetch blobs from (`/replication/blobs/{db}/{sha256}`
                     on the node port), one after the other, each checked (206, the right 4 bytes). Reported: the
                     wall time, the bytes the worker hashed meanwhile (`replicator_blob_check_bytes_total`, null
                     where the tree has no such counter), the worker's CPU seconds (psutil), the RSS growth and the
                     probe's worst answer. The first request (which waits for mallet's row to reach the worker)
                     comes before the measurement: a tree that remembers a check has hashed the blob once by then.
    huge_reference   mallet announces it holds the database `hostile` and sends a record whose blob reference
                     claims 2**62 bytes; its blob endpoint answers any request with zeros without end, up to
                     `--part-cap-mb` over all requests (a guard for the disk: then it stays silent; when it
                     got there is `peer_cap_reached_after_s`). For `--huge-seconds` (10) from the node's
                     subscription to `hostile`: the largest `.part` file in the node's blob folder (sampled every
                     10 ms), the bytes mallet sent, the blob requests it got, whether the node logged
                     `blob_refused`, the RSS growth and the probe's worst answer.

The targets (issue 21): no single request stalls the worker's loop 100 ms or more or grows it 16 MB or more;
`targets_met` says whether this tree's node meets them in both scenarios (probe_max_ms < 100, rss_growth_mb < 16).
The probe runs in the benchmark's process, beside mallet: when mallet streams at full speed (the baseline's
download) the probe's figure includes some of the benchmark's own delay, and both share two cores with the node.

    .venv/bin/python benchmarks/blobs_hostile.py [--requests 200] [--huge-seconds 10] [--part-cap-mb 2048]
        [--baseline c266d0e]
    .venv/bin/python benchmarks/blobs_hostile.py --quick

The defaults take about 45 s on two cores (the baseline writes some 1.2 GB of `.part` file in its 10 s);
`--quick` (50 requests, 5 s of the huge reference, a 512 MB cap) about 30 s. Each side starts its node once and
runs both scenarios on it.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib
import inspect
import io
import json
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import psutil
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness

REPO = harness.REPO
MB = 1024 * 1024
BLOB_BYTES = 8 * MB
PROBE_SECONDS = 0.01
PROBE_TARGET_MS = 100.0
RSS_TARGET_MB = 16.0
HUGE_SIZE = 2**62
CHECK_SERIES = "replicator_blob_check_bytes_total"
REPLICATION = {"reconcile_interval": 1.0, "shutdown_timeout": 8.0}
COUNTER_SETTLE = 2.5  # seconds: a worker reports its counters each second (heartbeat)


class Tree:
    """The modules of the tree under test (after `harness.use_code`)."""

    def __init__(self, code: Path) -> None:
        self.local_cluster = harness.use_code(code)
        root = self.local_cluster.__name__.removesuffix(".coordinator.local_cluster")
        self.blobs = importlib.import_module(f"{root}.shared.blobs")
        self.wire = importlib.import_module(f"{root}.shared.wire")
        self.membership = importlib.import_module(f"{root}.shared.membership")
        self.store = importlib.import_module(f"{root}.shared.store")
        self.tls = importlib.import_module(f"{root}.shared.tls")
        self.hostile_peer = importlib.import_module("tests.integration.test_hostile_peer")
        for module in (self.blobs, self.hostile_peer):
            if not Path(module.__file__ or "").resolve().is_relative_to(code):
                raise RuntimeError(f"{module.__name__} came from {module.__file__}, not from {code}")


class Probe:
    """In a thread of its own (its own loop and HTTP session): a data API read every PROBE_SECONDS, the slowest
    answer kept; the worker's RSS and optionally another sample (`extra`) taken as often."""

    def __init__(self, url: str, ssl: Any, worker: psutil.Process, extra: Callable[[], None] | None = None) -> None:
        self._url = url
        self._ssl = ssl
        self._worker = worker
        self._extra = extra
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self.rss_before = worker.memory_info().rss
        self.rss_peak = self.rss_before
        self.slowest = 0.0
        self.reads = 0
        self.failures = 0
        self._ready = threading.Event()

    async def _run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            await self._read(http)  # the TLS handshake, before any measurement
            self._ready.set()
            while not self._stop.is_set():
                started = time.perf_counter()
                ok = await self._read(http)
                self.slowest = max(self.slowest, time.perf_counter() - started)
                self.reads += 1
                self.failures += not ok
                self._sample()
                await asyncio.sleep(PROBE_SECONDS)

    async def _read(self, http: aiohttp.ClientSession) -> bool:
        try:
            async with http.get(self._url, ssl=self._ssl) as response:
                await response.read()
                return response.status == 200
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False

    def _sample(self) -> None:
        try:
            self.rss_peak = max(self.rss_peak, self._worker.memory_info().rss)
        except psutil.Error:
            pass
        if self._extra is not None:
            self._extra()

    def __enter__(self) -> Probe:
        self._thread.start()
        self._ready.wait(30)
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(2 * PROBE_SECONDS)  # one more read: a stall that lasted to the end is seen once it ends
        self._stop.set()
        self._thread.join(60)
        self._sample()

    def figures(self) -> dict[str, Any]:
        return {
            "probe_max_ms": round(self.slowest * 1000, 1),
            "probe_reads": self.reads,
            "probe_failures": self.failures,
            "rss_growth_mb": round(max(0, self.rss_peak - self.rss_before) / MB, 1),
        }


async def _metric(cluster: Any, name: str, metric: str, **labels: str) -> float | None:
    """The value of the node's series of `metric` with exactly these labels, None when it has none."""
    node = cluster[name]
    async with cluster.http.get(node.admin_url + "/metrics", headers=getattr(node, "admin_headers", {})) as response:
        text = await response.text()
    for found in re.finditer(rf"^{metric}\{{([^}}]*)\}} (\S+)$", text, re.MULTILINE):
        if dict(re.findall(r'(\w+)="([^"]*)"', found.group(1))) == labels:
            return float(found.group(2))
    return None


async def _put(cluster: Any, path: str, value: Any) -> None:
    body = io.BytesIO(json.dumps(value).encode())  # aiohttp warns about large raw bodies
    async with cluster.http.put(cluster["a"].data_url + path, data=body, ssl=cluster.data_ssl) as response:
        if response.status != 200:
            raise RuntimeError(f"PUT {path}: {response.status} {(await response.text())[:300]}")


async def _register(cluster: Any, url: str) -> None:
    node = cluster["a"]
    headers = {**getattr(node, "admin_headers", {}), "Content-Type": "application/json"}
    body = json.dumps({"url": url, "replicates": True})
    async with cluster.http.put(node.admin_url + "/nodes/mallet", data=body, headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(f"registering mallet: {response.status} {(await response.text())[:300]}")


async def _until(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if inspect.isawaitable(found):
            found = await found
        if found:
            return found
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(0.1)


async def _worker(cluster: Any) -> psutil.Process:
    node = cluster["a"]
    async with cluster.http.get(node.admin_url + "/status", headers=getattr(node, "admin_headers", {})) as response:
        status = await response.json(content_type=None)
    pids = [worker["pid"] for worker in status.get("workers", []) if worker.get("pid")]
    if len(pids) != 1:
        raise RuntimeError(f"expected one worker, /status names {pids}")
    return psutil.Process(pids[0])


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


class Mallet:
    """The hostile peer's two faces: the replication sessions `a` dials (FakePeer's `serve`), and its blob
    endpoint, which answers every request with zeros without end (up to `cap` bytes over all requests)."""

    def __init__(self, tree: Tree, cluster: Any, folder: Path, cap: int) -> None:
        self.tree = tree
        self.folder = folder
        self.cap = cap
        self.sent = 0
        self.requests = 0
        self.capped_at: float | None = None  # when the cap was reached (monotonic)
        self.armed = asyncio.Event()  # set: announce `hostile` and send the huge reference
        self.subscribed = asyncio.Event()  # set: a subscribed to `hostile`
        self.stop = asyncio.Event()
        self.huge = tree.blobs.Ref(hashlib.sha256(b"the issue's reference").digest(), HUGE_SIZE)
        self.peer = self._fake_peer(cluster)

    def _fake_peer(self, cluster: Any) -> Any:
        module = self.tree.hostile_peer
        fake = module.FakePeer
        if "routes" in inspect.signature(fake).parameters:
            return fake(cluster, self.folder, self.serve, self.routes)
        routes = self.routes

        class RoutedPeer(fake):  # type: ignore[misc, valid-type]
            """A tree whose FakePeer serves /replication only: the same server, with the blob route."""

            async def start(self) -> None:
                app = web.Application()
                app.router.add_get("/replication", self._handle)
                routes(app)
                self._runner = web.AppRunner(app, access_log=None)
                await self._runner.setup()
                ca = self.cluster.dir / "ca" / "ca.pem"
                context = module.server_context(ca, self.folder / "mallet.pem", self.folder / "mallet.key")
                await web.TCPSite(self._runner, "127.0.0.1", self.port, ssl_context=context).start()

        return RoutedPeer(cluster, self.folder, self.serve)

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/replication/blobs/{database}/{hash}", self.endless)

    async def endless(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        found = re.match(r"bytes=(\d+)-", request.headers.get("Range", ""))
        start = int(found.group(1)) if found else 0
        response = web.StreamResponse(status=206 if start else 200)
        if start:
            response.headers["Content-Range"] = f"bytes {start}-{HUGE_SIZE - 1}/{HUGE_SIZE}"
        response.force_close()  # no idle TLS connection left behind
        await response.prepare(request)
        zeros = b"\0" * 65536
        try:
            while not self.stop.is_set() and self.sent < self.cap:
                await response.write(zeros)
                self.sent += len(zeros)
            if self.sent >= self.cap and self.capped_at is None:
                self.capped_at = time.monotonic()
            await self.stop.wait()
        except (ConnectionError, RuntimeError):
            pass  # the node hung up
        return response

    async def serve(self, ws: Any, subscribe: Any) -> None:
        wire = self.tree.wire
        await ws.send_bytes(wire.encode(wire.Schema(database=subscribe.database, epoch="x", head_seq=1)))
        holding = asyncio.ensure_future(self._hold(ws))
        if subscribe.database == "system":
            arming = asyncio.ensure_future(self.armed.wait())
            await asyncio.wait({holding, arming}, return_when=asyncio.FIRST_COMPLETED)
            arming.cancel()
            if self.armed.is_set() and not ws.closed:
                await ws.send_bytes(self._batch([self._announcement()]))
        elif subscribe.database == "hostile":
            self.subscribed.set()
            now = int(time.time() * 1_000_000)
            entry = wire.Entry("t", "huge", self.tree.blobs.reference(self.huge), now, "mallet")
            await ws.send_bytes(self._batch([entry]))
        await holding

    def _announcement(self) -> Any:
        """mallet's own registry row, signed with its certificate, saying it holds `hostile`."""
        membership = self.tree.membership
        signer = membership.Signer.load("mallet", self.folder / "mallet.pem", self.folder / "mallet.key")
        row = self.tree.store.NodeRow(name="mallet", url=self.peer.url, replicates=True, holds=["hostile"])
        return membership.signed_entry(signer, "nodes", row, int(time.time() * 1_000_000))

    def _batch(self, entries: list[Any]) -> bytes:
        wire = self.tree.wire
        marks = {"mallet": max(entry.version for entry in entries)}
        return wire.encode(wire.Batch(entries=entries, marks=marks, head_seq=1, caught_up=True))

    @staticmethod
    async def _hold(ws: Any) -> None:
        while not ws.closed:
            message = await ws.receive()
            if message.type in (web.WSMsgType.CLOSE, web.WSMsgType.CLOSED, web.WSMsgType.CLOSING):
                return


async def _range_requests(tree: Tree, cluster: Any, mallet_ssl: Any, probe_url: str, requests: int) -> dict[str, Any]:
    value = hashlib.sha256(b"8 MB").hexdigest() * (BLOB_BYTES // 64)
    data = msgspec.msgpack.encode(value)
    ref = tree.blobs.ref_of(data)
    await _put(cluster, "/data/ranged/t/big", value)
    url = f"{cluster['a'].data_url}/replication/blobs/ranged/{ref.hex}"
    headers = {"Range": f"bytes={ref.size - 4}-"}

    async def last_bytes() -> tuple[int, bytes]:
        async with cluster.http.get(url, ssl=mallet_ssl, headers=headers) as response:
            return response.status, await response.read()

    async def allowed() -> bool:
        return (await last_bytes())[0] == 206

    await _until(allowed, 60, "mallet's row to reach a's worker")
    await asyncio.sleep(COUNTER_SETTLE)
    hashed_before = await _metric(cluster, "a", CHECK_SERIES, database="ranged")
    worker = await _worker(cluster)
    cpu_before = _cpu(worker)
    with Probe(probe_url, cluster.data_ssl, worker) as probe:
        started = time.perf_counter()
        for _ in range(requests):
            answer = await last_bytes()
            if answer != (206, data[-4:]):
                raise RuntimeError(f"a Range request answered {answer[0]} {answer[1][:40]!r}")
        wall = time.perf_counter() - started
        cpu = _cpu(worker) - cpu_before
    await asyncio.sleep(COUNTER_SETTLE)
    hashed_after = await _metric(cluster, "a", CHECK_SERIES, database="ranged")
    hashed = None if hashed_after is None else int(hashed_after - (hashed_before or 0))
    return {
        "blob_bytes": ref.size,
        "requests": requests,
        "wall_s": round(wall, 3),
        "per_request_ms": round(wall / requests * 1000, 2),
        "bytes_hashed": hashed,
        "bytes_hashed_before": None if hashed_before is None else int(hashed_before),
        "worker_cpu_s": round(cpu, 3),
        **probe.figures(),
    }


async def _huge_reference(tree: Tree, cluster: Any, mallet: Mallet, probe_url: str, seconds: float) -> dict[str, Any]:
    folder = cluster["a"].dir / "data" / f"hostile{tree.blobs.SUFFIX}"
    largest = [0]

    def part_size() -> None:
        try:
            sizes = [path.stat().st_size for path in folder.glob(f"*{tree.blobs.PART}")]
        except OSError:
            return
        largest[0] = max([largest[0], *sizes])

    worker = await _worker(cluster)
    armed_at = time.monotonic()
    mallet.armed.set()
    await asyncio.wait_for(mallet.subscribed.wait(), 90)
    subscribed_at = time.monotonic()
    subscribed_after = subscribed_at - armed_at
    with Probe(probe_url, cluster.data_ssl, worker, part_size) as probe:
        await asyncio.sleep(seconds)
    refused = [e for e in cluster["a"].events("blob_refused") if e.get("peer") == "mallet"]
    return {
        "claimed_bytes": HUGE_SIZE,
        "seconds": seconds,
        "subscribed_after_s": round(subscribed_after, 2),
        "largest_part_bytes": largest[0],
        "largest_part_mb": round(largest[0] / MB, 1),
        "peer_bytes_sent": mallet.sent,
        "peer_cap_reached_after_s": None if mallet.capped_at is None else round(mallet.capped_at - subscribed_at, 2),
        "blob_requests": mallet.requests,
        "refused": bool(refused),
        **probe.figures(),
    }


async def measure(code: Path, requests: int, huge_seconds: float, cap: int) -> dict[str, Any]:
    """Runs in the child: both scenarios on one node of the tree `code`."""
    tree = Tree(code)
    with tempfile.TemporaryDirectory(prefix="replicator-blobs-hostile-") as holder:
        cluster = tree.local_cluster.LocalCluster(Path(holder) / "cluster", ["a"], workers=1, replication=REPLICATION)
        cluster.prepare()
        folder = Path(holder) / "mallet"
        tree.tls.issue_node_cert(cluster.dir / "ca", "mallet", ["127.0.0.1"], folder)
        mallet_ssl = tree.tls.client_context(
            cluster.dir / "ca" / "ca.pem", folder / "mallet.pem", folder / "mallet.key"
        )
        mallet = Mallet(tree, cluster, folder, cap)
        cluster.start()
        started = False
        try:
            await cluster.wait_ready()
            await _put(cluster, "/data/probe/t/p", {"v": 1})
            await _put(cluster, "/data/hostile/t/first", {"v": 0})  # a holds `hostile`: it subscribes once told
            await mallet.peer.start()
            started = True
            await _register(cluster, mallet.peer.url)
            probe_url = cluster["a"].data_url + "/data/probe/t/p"
            ranged = await _range_requests(tree, cluster, mallet_ssl, probe_url, requests)
            huge = await _huge_reference(tree, cluster, mallet, probe_url, huge_seconds)
        finally:
            mallet.stop.set()
            if started:
                try:
                    await asyncio.wait_for(mallet.peer.close(), 90)
                except (TimeoutError, RuntimeError, AssertionError) as exc:
                    print(f"mallet did not close cleanly: {exc!r}", file=sys.stderr)
            cluster.stop()
            await cluster.close()
    return {"range_requests": ranged, "huge_reference": huge}


def _meets(side: dict[str, Any]) -> bool:
    return all(
        scenario["probe_max_ms"] < PROBE_TARGET_MS and scenario["rss_growth_mb"] < RSS_TARGET_MB
        for scenario in side.values()
    )


def _ratio(current: Any, baseline: Any) -> float | None:
    if not isinstance(current, (int, float)) or not isinstance(baseline, (int, float)) or not baseline:
        return None
    return round(current / baseline, 4)


def _ratios(current: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    """This tree's figure over the baseline's, for the figures both have."""
    figures = {
        "range_requests": ("wall_s", "bytes_hashed", "worker_cpu_s", "rss_growth_mb", "probe_max_ms"),
        "huge_reference": ("largest_part_bytes", "peer_bytes_sent", "rss_growth_mb", "probe_max_ms"),
    }
    return {
        scenario: {name: _ratio(current[scenario][name], baseline[scenario][name]) for name in names}
        for scenario, names in figures.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="Range requests for 4 bytes of the 8 MB blob")
    parser.add_argument("--huge-seconds", type=float, default=10.0, help="how long the huge reference is watched")
    parser.add_argument("--part-cap-mb", type=int, default=2048, help="the most mallet sends of the huge blob")
    parser.add_argument("--baseline", metavar="REV", default="c266d0e", help="the revision compared with")
    parser.add_argument("--quick", action="store_true", help="50 requests, 5 s of the huge reference, 512 MB cap")
    parser.add_argument("--code", type=Path, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.quick:
        options.requests, options.huge_seconds, options.part_cap_mb = 50, 5.0, 512
    settings = ["--requests", str(options.requests), "--huge-seconds", str(options.huge_seconds)]
    settings += ["--part-cap-mb", str(options.part_cap_mb)]
    if options.code:
        figures = asyncio.run(
            measure(options.code.resolve(), options.requests, options.huge_seconds, options.part_cap_mb * MB)
        )
        print(json.dumps(figures))
        return
    load_before = os.getloadavg()[0]
    baseline_rev, current_rev = harness.revisions(options.baseline)
    with harness.baseline_tree(baseline_rev) as tree:
        baseline = harness.run_side(__file__, tree, settings)
    current = harness.run_side(__file__, REPO, settings)
    result = {
        "benchmark": "blobs_hostile",
        "requests": options.requests,
        "huge_seconds": options.huge_seconds,
        "part_cap_mb": options.part_cap_mb,
        "targets": {"probe_max_ms": PROBE_TARGET_MS, "rss_growth_mb": RSS_TARGET_MB},
        "targets_met": _meets(current),
        "baseline_targets_met": _meets(baseline),
        "ratios_current_to_baseline": _ratios(current, baseline),
        "baseline": {"rev": baseline_rev, **baseline},
        "current": {"rev": current_rev, **current},
        # The machine's 1-minute load average around the run: other work on it skews a run, and shows here.
        "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
