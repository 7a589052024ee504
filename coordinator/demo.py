"""`replicator demo`: a real cluster on loopback, replicating, then a short report.

Boots N nodes x W workers with fresh certificates in full mesh, writes records spread over every node (including
conflicting writes to the same ids on all nodes, updates and deletes), waits for identical digests, prints what it
saw, stops everything and exits 0 only if the cluster converged.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from replicator.coordinator.local_cluster import LocalCluster

DATABASE = "demo"
TABLE = "items"
BATCH = 200
CONVERGE_TIMEOUT = 120.0


async def run_demo(nodes: int, workers: int, records: int, directory: str | None, as_json: bool = False) -> int:
    """With `as_json`, the lines go to stderr and one JSON object to stdout at the end: `{"converged", "nodes",
    "workers", "records", "dir", "seconds": {"ready", "connected", "write", "converge"}, "status": [...],
    "exit_codes"}`."""
    stream = sys.stderr if as_json else sys.stdout

    def say(line: str) -> None:
        print(line, file=stream, flush=True)

    if nodes < 2 or workers < 1 or records < 1:
        say("replicator demo: need --nodes >= 2, --workers >= 1 and --records >= 1")
        return 2
    folder = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="replicator-demo-"))
    names = [f"node{i + 1}" for i in range(nodes)]
    cluster = LocalCluster(folder, names, workers=workers, topology="mesh")
    say(f"demo: {nodes} nodes x {workers} workers on 127.0.0.1, files in {folder}")
    started = time.monotonic()
    cluster.prepare()
    cluster.start()
    converged = False
    seconds: dict[str, float | None] = {"ready": None, "connected": None, "write": None, "converge": None}
    report: list[dict[str, Any]] = []
    codes: dict[str, int | None] = {}
    error = None
    try:
        await cluster.wait_ready(timeout=90.0)
        seconds["ready"] = booted = time.monotonic() - started
        await cluster.wait_connected(timeout=60.0)
        seconds["connected"] = connected = time.monotonic() - started
        say(f"demo: nodes ready in {booted:.1f} s, every pair connected at {connected:.1f} s")
        expected, wrote_s = await _write(cluster, names, records)
        seconds["write"] = wrote_s
        say(f"demo: wrote {records} records (+ conflicts, updates, deletes) in {wrote_s:.2f} s")
        try:
            converge_s = await cluster.wait_converged(DATABASE, timeout=CONVERGE_TIMEOUT, expect_count=expected)
            converged = True
            seconds["converge"] = converge_s
        except TimeoutError as exc:
            say(f"demo: NOT CONVERGED: {exc}")
            error = f"not converged: {exc}"
            converge_s = float("nan")
        report = await _report(cluster, names, expected, converge_s, say)
    except (TimeoutError, RuntimeError) as exc:
        say(f"demo: FAILED: {exc}")
        error = str(exc)
        for name in names:
            tail = cluster[name].log_path.read_text(errors="replace").splitlines()[-5:]
            say(f"--- {name} log tail:\n" + "\n".join(tail))
    finally:
        codes = cluster.stop()
        await cluster.close()
        say("demo: stopped: " + ", ".join(f"{name} exit {code}" for name, code in codes.items()))
        if directory is None and converged:
            shutil.rmtree(folder, ignore_errors=True)
    say("demo: CONVERGED" if converged else "demo: FAILED")
    if as_json:
        document = {
            "converged": converged,
            "nodes": names,
            "workers": workers,
            "records": records,
            "dir": str(folder) if directory is not None or not converged else None,
            "seconds": {key: None if value is None else round(value, 3) for key, value in seconds.items()},
            "status": report,
            "exit_codes": codes,
        }
        if error is not None:
            document["error"] = error
        print(json.dumps(document, indent=2))
    return 0 if converged else 1


async def _write(cluster: LocalCluster, names: list[str], records: int) -> tuple[int, float]:
    """Write `records` records spread over the nodes; returns the live record count every node must end with."""
    started = time.monotonic()
    ids = [f"r{i:06d}" for i in range(records)]
    posts = []
    for index in range(0, records, BATCH):
        chunk = ids[index : index + BATCH]
        writer = names[(index // BATCH) % len(names)]
        body = [{"id": i, "value": {"n": int(i[1:]), "by": writer}} for i in chunk]
        posts.append(cluster.data(writer, "POST", f"/data/{DATABASE}/{TABLE}", body))
    for status, body in await asyncio.gather(*posts):
        if status != 200:
            raise RuntimeError(f"batch write failed: {status} {body}")
    # Conflicts: every node writes the same few ids at once; last-writer-wins must pick one everywhere.
    conflicts = [
        cluster.data(name, "PUT", f"/data/{DATABASE}/{TABLE}/conflict-{k}", {"winner?": name})
        for k in range(5)
        for name in names
    ]
    # Updates and deletes on records written elsewhere.
    deletes = ids[: max(1, records // 100)]
    updates = ids[len(deletes) : len(deletes) + max(1, records // 50)]
    changes = [
        cluster.data(names[i % len(names)], "PUT", f"/data/{DATABASE}/{TABLE}/{rid}", {"updated": True})
        for i, rid in enumerate(updates)
    ]
    for status, body in await asyncio.gather(*conflicts, *changes):
        if status != 200:
            raise RuntimeError(f"write failed: {status} {body}")
    await cluster.wait_converged(DATABASE, timeout=CONVERGE_TIMEOUT)
    removed = [
        cluster.data(names[-1 - i % len(names)], "DELETE", f"/data/{DATABASE}/{TABLE}/{rid}")
        for i, rid in enumerate(deletes)
    ]
    for status, body in await asyncio.gather(*removed):
        if status != 200:
            raise RuntimeError(f"delete failed: {status} {body}")
    return records - len(deletes) + 5, time.monotonic() - started


async def _report(
    cluster: LocalCluster, names: list[str], expected: int, converge_s: float, say: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Say each node's workers, pairs, lag, records applied and memory; return them, one object per node."""
    say(f"demo: {expected} live records on every node; converged {converge_s:.2f} s after the last write")
    say(f"{'node':8} {'workers':>8} {'pairs':>8} {'max lag s':>10} {'applied':>9} {'rss MiB':>9}")
    report = []
    for name in names:
        status, body = await cluster.admin(name, "/status")
        if status != 200:
            say(f"{name:8} status unavailable ({status})")
            report.append({"node": name, "error": f"status answered {status}"})
            continue
        workers = body["workers"]
        pairs = [d for c in body["connections"] for d in c["databases"]]
        found = {
            "node": name,
            "workers_ready": sum(1 for w in workers if w["ready"]),
            "workers": len(workers),
            "pairs_connected": sum(1 for d in pairs if d["connected"]),
            "pairs": len(pairs),
            "max_lag_s": max((d["lag_seconds"] for d in pairs), default=0.0),
            "applied": sum(d["applied"] for d in pairs),
            "rss_bytes": sum(w["rss_bytes"] for w in workers),
        }
        report.append(found)
        say(
            f"{name:8} {found['workers_ready']:>3}/{found['workers']:<4}"
            f" {found['pairs_connected']:>3}/{found['pairs']:<4} {found['max_lag_s']:>10.3f}"
            f" {found['applied']:>9} {found['rss_bytes'] / 2**20:>9.1f}"
        )
    status, text = await _metrics_sample(cluster, names[0])
    if status == 200:
        say(f"demo: {names[0]} metrics: " + ", ".join(text))
    return report


async def _metrics_sample(cluster: LocalCluster, name: str) -> tuple[int, list[str]]:
    wanted = (
        "replicator_setup_dispatched_total",
        "replicator_worker_restarts_total",
        "replicator_workers_ready",
    )
    async with cluster.http.get(cluster[name].admin_url + "/metrics", headers=cluster[name].admin_headers) as response:
        text = await response.text()
    lines = [line for line in text.splitlines() if line.startswith(wanted)]
    return response.status, lines
