"""Replication throughput and lag between two real nodes on loopback; prints JSON.

(a) A's local write rate into its own store: the ceiling, measured in the same run;
(b) the rate at which B applies A's records, and b / a;
(c) replication lag p50 / p99 at a steady write rate.

Times come from the stores themselves: every audit entry carries the writer's commit time (`committed_at`) and
the record's version, which is the origin's commit time in microseconds. For A's own entries that gives when A
wrote; for B's entries of origin A, `committed_at - version` is the lag from A's commit to B's, on one clock.

    .venv/bin/python benchmarks/replication_throughput.py [--records 100000] [--rate 2000] [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator.local_cluster import LocalCluster

DATABASE = "bench"


def _audit(path: Path, origin: str, table: str) -> list[tuple[int, float]]:
    """(version, committed_at) of the entries of `origin` in `table`, in commit order."""
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        return conn.execute(
            "SELECT version, committed_at FROM audit WHERE origin = ? AND tbl = ? ORDER BY seq", (origin, table)
        ).fetchall()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _bulk(cluster: LocalCluster, records: int, batch: int, concurrency: int, value: str) -> None:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for start in range(0, records, batch):
        queue.put_nowait(start)

    async def worker() -> None:
        while not queue.empty():
            start = queue.get_nowait()
            body = [
                {"id": f"r{i:07d}", "value": {"i": i, "pad": value}} for i in range(start, min(records, start + batch))
            ]
            status, answer = await cluster.data("a", "POST", f"/data/{DATABASE}/bulk", body)
            if status != 200:
                raise RuntimeError(f"write failed: {status} {answer}")

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _steady(cluster: LocalCluster, rate: int, seconds: float, value: str) -> int:
    """Write `rate` records per second for `seconds`, in small batches every 10 ms."""
    per_tick = max(1, rate // 100)
    ticks = int(seconds * 100)
    start = time.monotonic()
    pending: set[asyncio.Task] = set()
    for tick in range(ticks):
        body = [{"id": f"s{tick:05d}-{i:03d}", "value": {"pad": value}} for i in range(per_tick)]
        task = asyncio.create_task(
            cluster.data("a", "PUT" if per_tick == 1 else "POST", f"/data/{DATABASE}/steady", body)
        )
        pending.add(task)
        task.add_done_callback(pending.discard)
        delay = start + (tick + 1) / 100 - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
    await asyncio.gather(*pending)
    return per_tick * ticks


async def main(records: int, rate: int, seconds: float, workers: int) -> dict:
    value = "x" * 1000
    with tempfile.TemporaryDirectory(prefix="replicator-bench-") as folder:
        cluster = LocalCluster(folder, ["a", "b"], workers=workers, replication={"shutdown_timeout": 10.0})
        cluster.prepare()
        cluster.start()
        try:
            await cluster.wait_ready()
            await cluster.wait_connected()
            # Create the database and let B subscribe to it before measuring.
            await cluster.data("a", "PUT", f"/data/{DATABASE}/warmup/w", {"ok": True})
            await cluster.wait_converged(DATABASE, timeout=60)

            await _bulk(cluster, records, batch=500, concurrency=4, value=value)
            await cluster.wait_converged(DATABASE, timeout=600)
            steady = await _steady(cluster, rate, seconds, value)
            await cluster.wait_converged(DATABASE, timeout=120)
        finally:
            cluster.stop()
            await cluster.close()
        written = _audit(Path(folder) / "a" / "data" / f"{DATABASE}.sqlite", "a", "bulk")
        applied = _audit(Path(folder) / "b" / "data" / f"{DATABASE}.sqlite", "a", "bulk")
        lags = [
            committed - version / 1e6
            for version, committed in _audit(Path(folder) / "b" / "data" / f"{DATABASE}.sqlite", "a", "steady")
        ]
    first_write = written[0][1]
    write_rate = len(written) / (written[-1][1] - first_write)
    apply_rate = len(applied) / (applied[-1][1] - first_write)
    return {
        "benchmark": "replication_throughput",
        "records": len(written),
        "value_bytes": len(value),
        "workers_per_node": workers,
        "a_local_write_rate_per_s": round(write_rate),
        "b_apply_rate_per_s": round(apply_rate),
        "ratio_b_over_a": round(apply_rate / write_rate, 3),
        "steady_rate_per_s": rate,
        "steady_records": steady,
        "lag_p50_ms": round(statistics.median(lags) * 1000, 2),
        "lag_p99_ms": round(_percentile(lags, 0.99) * 1000, 2),
        "lag_max_ms": round(max(lags) * 1000, 2),
        "targets": {"ratio_b_over_a_min": 0.5, "lag_p99_ms_max": 100},
        "meets_targets": apply_rate / write_rate >= 0.5 and _percentile(lags, 0.99) <= 0.1,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--rate", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--workers", type=int, default=2)
    options = parser.parse_args()
    print(json.dumps(asyncio.run(main(options.records, options.rate, options.seconds, options.workers)), indent=2))
