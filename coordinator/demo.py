"""`replicator demo`: a real cluster on loopback, replicating, then a short report.

Boots N nodes x W workers with fresh certificates in full mesh, writes records spread over every node (including
conflicting writes to the same ids on all nodes, updates and deletes), waits for identical digests, prints what it
saw, stops everything and exits 0 only if the cluster converged.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path

from replicator.coordinator.local_cluster import LocalCluster

DATABASE = "demo"
TABLE = "items"
BATCH = 200
CONVERGE_TIMEOUT = 120.0


async def run_demo(nodes: int, workers: int, records: int, directory: str | None) -> int:
    if nodes < 2 or workers < 1 or records < 1:
        print("replicator demo: need --nodes >= 2, --workers >= 1 and --records >= 1")
        return 2
    folder = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="replicator-demo-"))
    names = [f"node{i + 1}" for i in range(nodes)]
    cluster = LocalCluster(folder, names, workers=workers, topology="mesh")
    print(f"demo: {nodes} nodes x {workers} workers on 127.0.0.1, files in {folder}")
    started = time.monotonic()
    cluster.prepare()
    cluster.start()
    converged = False
    try:
        await cluster.wait_ready(timeout=90.0)
        booted = time.monotonic() - started
        await cluster.wait_connected(timeout=60.0)
        connected = time.monotonic() - started
        print(f"demo: nodes ready in {booted:.1f} s, every pair connected at {connected:.1f} s")
        expected, wrote_s = await _write(cluster, names, records)
        print(f"demo: wrote {records} records (+ conflicts, updates, deletes) in {wrote_s:.2f} s")
        try:
            converge_s = await cluster.wait_converged(DATABASE, timeout=CONVERGE_TIMEOUT, expect_count=expected)
            converged = True
        except TimeoutError as exc:
            print(f"demo: NOT CONVERGED: {exc}")
            converge_s = float("nan")
        await _report(cluster, names, expected, converge_s)
    except (TimeoutError, RuntimeError) as exc:
        print(f"demo: FAILED: {exc}")
        for name in names:
            tail = cluster[name].log_path.read_text(errors="replace").splitlines()[-5:]
            print(f"--- {name} log tail:\n" + "\n".join(tail))
    finally:
        codes = cluster.stop()
        await cluster.close()
        print("demo: stopped: " + ", ".join(f"{name} exit {code}" for name, code in codes.items()))
        if directory is None and converged:
            shutil.rmtree(folder, ignore_errors=True)
    print("demo: CONVERGED" if converged else "demo: FAILED")
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


async def _report(cluster: LocalCluster, names: list[str], expected: int, converge_s: float) -> None:
    print(f"demo: {expected} live records on every node; converged {converge_s:.2f} s after the last write")
    print(f"{'node':8} {'workers':>8} {'pairs':>8} {'max lag s':>10} {'applied':>9} {'rss MiB':>9}")
    for name in names:
        status, body = await cluster.admin(name, "/status")
        if status != 200:
            print(f"{name:8} status unavailable ({status})")
            continue
        workers = body["workers"]
        ready = sum(1 for w in workers if w["ready"])
        pairs = [d for c in body["connections"] for d in c["databases"]]
        connected = sum(1 for d in pairs if d["connected"])
        lag = max((d["lag_seconds"] for d in pairs), default=0.0)
        applied = sum(d["applied"] for d in pairs)
        rss = sum(w["rss_bytes"] for w in workers) / 2**20
        print(
            f"{name:8} {ready:>3}/{len(workers):<4} {connected:>3}/{len(pairs):<4}"
            f" {lag:>10.3f} {applied:>9} {rss:>9.1f}"
        )
    status, text = await _metrics_sample(cluster, names[0])
    if status == 200:
        print(f"demo: {names[0]} metrics: " + ", ".join(text))


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
