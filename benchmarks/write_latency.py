"""Write-to-visible latency and idle CPU on two nodes (issue 12, pushed change notification); prints JSON.

(a) One record at a time: a write to node a through the data API, every `--interval` seconds, `--writes` times.
    A record's latency is its commit on b minus its commit on a, both read from the stores' audit logs
    (`committed_at`, one clock: both nodes run on this machine). Targets: median <= 1.5 ms, p99 <= 5 ms.
(b) Idle: `--databases` databases, created on a by one write each and replicated to b, every pair connected, then
    nothing written for `--idle-seconds`. The CPU each worker used over that time, as a share of one core. Target:
    <= 1% of a core per worker.

`--baseline REV` measures REV and this tree in the same invocation, alternating (`--repeat` rounds), and gives the
ratios current / baseline of the medians.

    .venv/bin/python benchmarks/write_latency.py [--writes 300] [--interval 0.02] [--databases 100]
    .venv/bin/python benchmarks/write_latency.py --baseline HEAD~1 [--repeat 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness

TARGET_MEDIAN_MS = 1.5
TARGET_P99_MS = 5.0
TARGET_IDLE_CORE_PERCENT = 1.0
DATABASE = "latency"


def _committed(path: Path, table: str) -> dict[tuple[str, int], float]:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        rows = conn.execute(
            "SELECT id, version, committed_at FROM audit WHERE origin = 'a' AND tbl = ?", (table,)
        ).fetchall()
    return {(id_, version): at for id_, version, at in rows}


def _workers(node: Any) -> dict[str, psutil.Process]:
    """The node's processes by role: the coordinator and each worker (every child that runs Python)."""
    root = psutil.Process(node.process.pid)
    found = {"coordinator": root}
    for index, child in enumerate(sorted(root.children(recursive=True), key=lambda p: p.pid)):
        found[f"child{index}"] = child
    return found


async def _one_at_a_time(cluster: Any, writes: int, interval: float) -> None:
    """Each write on a new connection, so the node's workers take them in turn (SO_REUSEPORT): a write then lands
    in the worker that serves b's subscription or in the other one, and both paths are measured."""
    url = cluster.nodes["a"].data_url
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector, headers=cluster._headers()) as http:
        for i in range(writes):
            started = time.monotonic()
            async with http.put(
                f"{url}/data/{DATABASE}/single/r{i:05d}", data=json.dumps({"i": i}), ssl=cluster.data_ssl
            ) as response:
                if response.status not in (200, 201):
                    raise RuntimeError(f"write {i} answered {response.status}: {await response.text()}")
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))


async def measure(code: Path, writes: int, interval: float, databases: int, idle_seconds: float) -> dict:
    cluster_class = harness.use_code(code).LocalCluster
    with tempfile.TemporaryDirectory(prefix="replicator-bench-") as folder:
        cluster = cluster_class(folder, ["a", "b"], workers=2)
        cluster.prepare()
        cluster.start()
        try:
            await cluster.wait_ready()
            await cluster.data("a", "PUT", f"/data/{DATABASE}/warmup/w", {"ok": True})
            await cluster.wait_connected(databases=[DATABASE], timeout=120)
            await cluster.wait_converged(DATABASE, timeout=60)
            await _one_at_a_time(cluster, writes, interval)
            await cluster.wait_converged(DATABASE, timeout=60)

            names = [f"idle{i:03d}" for i in range(databases)]
            for name in names:
                await cluster.data("a", "PUT", f"/data/{name}/t/r", {"ok": True})
            await cluster.wait_connected(databases=names, timeout=300)
            for name in names:
                await cluster.wait_converged(name, timeout=120)
            await asyncio.sleep(5.0)  # let setup, first progress reports and heartbeats settle
            processes = {node: _workers(cluster.nodes[node]) for node in ("a", "b")}
            before = {node: harness.cpu_seconds(found) for node, found in processes.items()}
            started = time.monotonic()
            await asyncio.sleep(idle_seconds)
            elapsed = time.monotonic() - started
            after = {node: harness.cpu_seconds(found) for node, found in processes.items()}
        finally:
            cluster.stop()
            await cluster.close()
        files = {node: Path(folder) / node / "data" / f"{DATABASE}.sqlite" for node in ("a", "b")}
        wrote = _committed(files["a"], "single")
        applied = _committed(files["b"], "single")
    latencies = [(applied[key] - at) * 1000 for key, at in wrote.items() if key in applied]
    if len(latencies) != writes:
        raise RuntimeError(f"{writes - len(latencies)} of {writes} records never reached b")
    idle = {
        node: {
            role: round(100 * (after[node][role] - before[node][role]) / elapsed, 3)
            for role in before[node]
            if role in after[node]
        }
        for node in before
    }
    workers = [share for node in idle.values() for role, share in node.items() if role != "coordinator"]
    median = statistics.median(latencies)
    p99 = harness.percentile(latencies, 0.99)
    return {
        "code": str(code),
        "writes": writes,
        "interval_s": interval,
        "latency_median_ms": round(median, 3),
        "latency_p99_ms": round(p99, 3),
        "latency_max_ms": round(max(latencies), 3),
        "idle_databases": databases,
        "idle_seconds": round(elapsed, 2),
        "idle_core_percent": idle,
        "idle_worker_core_percent_max": max(workers),
        "targets": {
            "latency_median_ms": TARGET_MEDIAN_MS,
            "latency_p99_ms": TARGET_P99_MS,
            "idle_worker_core_percent": TARGET_IDLE_CORE_PERCENT,
        },
        "met": {
            "latency_median": median <= TARGET_MEDIAN_MS,
            "latency_p99": p99 <= TARGET_P99_MS,
            "idle_cpu": max(workers) <= TARGET_IDLE_CORE_PERCENT,
        },
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


FIGURES = ("latency_median_ms", "latency_p99_ms", "idle_worker_core_percent_max")


def compare(options: argparse.Namespace) -> dict:
    args = [
        "--writes",
        str(options.writes),
        "--interval",
        str(options.interval),
        "--databases",
        str(options.databases),
        "--idle-seconds",
        str(options.idle_seconds),
    ]
    baseline_rev, current_rev, runs = harness.alternate(__file__, options.baseline, args, options.repeat)
    medians = {side: {f: statistics.median(run[f] for run in found) for f in FIGURES} for side, found in runs.items()}
    return {
        "benchmark": "write_latency",
        "repeat": options.repeat,
        "order": "baseline, current, alternating",
        "baseline": {"rev": baseline_rev, "median": medians["baseline"], "runs": runs["baseline"]},
        "current": {"rev": current_rev, "median": medians["current"], "runs": runs["current"]},
        "ratios_current_over_baseline": {
            f: harness.ratio(medians["current"][f], medians["baseline"][f]) for f in FIGURES
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writes", type=int, default=300, help="single-record writes (default 300)")
    parser.add_argument("--interval", type=float, default=0.02, help="seconds between writes (default 0.02)")
    parser.add_argument("--databases", type=int, default=100, help="idle databases (default 100)")
    # CPU time is counted in 10 ms ticks: 30 s reads a share of a core to 0.03%, and averages out the timers that
    # still fire once in the first seconds after the pairs connected (a session's first holds report, its STAYED_UP).
    parser.add_argument("--idle-seconds", type=float, default=30.0, help="idle time measured (default 30)")
    parser.add_argument("--baseline", metavar="REV", help="also measure this git revision, side by side")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of (baseline, current) with --baseline")
    parser.add_argument("--code", type=Path, default=harness.REPO, help="the tree measured (default: this one)")
    options = parser.parse_args()
    if options.baseline:
        result = compare(options)
    else:
        result = asyncio.run(
            measure(options.code.resolve(), options.writes, options.interval, options.databases, options.idle_seconds)
        )
    harness.print_json(result)


if __name__ == "__main__":
    main()
