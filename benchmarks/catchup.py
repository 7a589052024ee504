"""Catch-up throughput after an outage with writes running; prints JSON.

Two nodes a and b on loopback. b is stopped; a takes writes at `--rate` records per second of `--size` bytes for
`--outage` seconds; b starts again while the writes go on, and catches up. The figure is the catch-up rate in
MB/s: the records b's session received from the moment it connected until the sender said it was caught up,
times their size, over that time (b's own `/status` figures: `session_records.received`, `copy`).

Baseline, measured in the same run: for records, the raw rate at which one process applies the same records to
a store (`Database.apply_batch`, batches of 500, records and audit), the ceiling of this machine's disk and
SQLite; for values of `data.blob_threshold` and more, which travel as blob files, the rate at which one process
writes such files the way the blob store does (`BlobStore.write`: a temporary file, fsync, rename), the disk's
ceiling. The document gives both and their ratio, and the issue's targets (20 MB/s for records on loopback;
blobs limited by the disk, not the protocol).

    .venv/bin/python benchmarks/catchup.py [--outage 120] [--rate 2000] [--size 1024] [--workers 2]
    .venv/bin/python benchmarks/catchup.py --size 1048576 --rate 5          # 1 MB blobs

Quick mode: `--outage 20`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from replicator.coordinator.local_cluster import LocalCluster  # noqa: E402
from replicator.shared.blobs import BlobStore  # noqa: E402
from replicator.shared.store import Store  # noqa: E402
from replicator.shared.wire import Entry  # noqa: E402

DATABASE = "catchup"
TARGET_MB_S = 20.0
REQUEST = 200  # records per data API request (fewer for big values: about 2 MB per request)
BLOB_THRESHOLD = 256 * 1024  # data.blob_threshold (default): values this big travel as blob files


def _value(size: int, n: int) -> dict[str, Any]:
    # msgpack of {"n": int, "pad": str} is about `size` bytes.
    return {"n": n, "pad": "x" * max(0, size - 24)}


def raw_blob_rate(size: int, count: int) -> float:
    """MB/s at which one process writes `count` distinct blob files of `size` bytes (write, fsync, rename)."""
    with tempfile.TemporaryDirectory() as tmp:
        store = BlobStore(Path(tmp) / f"{DATABASE}.blobs")
        payloads = [msgspec.msgpack.encode(_value(size, i)) for i in range(count)]
        started = time.perf_counter()
        for payload in payloads:
            store.write(payload)
        seconds = time.perf_counter() - started
    return sum(len(p) for p in payloads) / seconds / 1e6


def raw_apply_rate(size: int, records: int) -> float:
    """MB/s at which one process applies `records` records of `size` bytes to a fresh store (batches of 500)."""
    with tempfile.TemporaryDirectory() as tmp, Store(Path(tmp) / "src", "a") as source, Store(Path(tmp), "b") as dest:
        db = source.database(DATABASE, create=True)
        for start in range(0, records, 500):
            items = [(f"r{i:08d}", msgspec.msgpack.encode(_value(size, i))) for i in range(start, start + 500)]
            db.put_many("t", items)
        entries = db.origin_entries("a", 0, records)
        target = dest.database(DATABASE, create=True)
        total = sum(len(entry.value) + len(entry.id) for entry in entries)
        started = time.perf_counter()
        for start in range(0, len(entries), 500):
            chunk: list[Entry] = entries[start : start + 500]
            target.apply_batch(chunk, {"a": chunk[-1].version})
        seconds = time.perf_counter() - started
    return total / seconds / 1e6


async def _writer(cluster: LocalCluster, rate: float, size: int, stop: asyncio.Event, counter: list[int]) -> None:
    """Write at `rate` records per second in requests of REQUEST records until `stop` is set."""
    started = time.monotonic()
    per_request = max(1, min(REQUEST, 2_000_000 // size))
    while not stop.is_set():
        n = counter[0]
        records = [{"id": f"r{i:08d}", "value": _value(size, i)} for i in range(n, n + per_request)]
        status, body = await cluster.data("a", "POST", f"/data/{DATABASE}/t", records)
        if status != 200:
            raise RuntimeError(f"write failed: {status} {body}")
        counter[0] += per_request
        ahead = counter[0] / rate - (time.monotonic() - started)
        if ahead > 0:
            await asyncio.sleep(ahead)


async def _pair(cluster: LocalCluster) -> dict[str, Any] | None:
    try:
        _, status = await cluster.admin("b", "/status")
    except (aiohttp.ClientError, OSError):
        return None  # b is still booting
    for connection in status["connections"]:
        for pair in connection["databases"]:
            if connection["peer"] == "a" and pair["database"] == DATABASE:
                return pair
    return None


async def measure(outage: float, rate: float, size: int, workers: int, keep: str | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        tmp = keep or scratch
        cluster = LocalCluster(Path(tmp), ["a", "b"], workers=workers, replication={"reconcile_interval": 1.0})
        cluster.prepare()
        cluster.start()
        try:
            await cluster.wait_ready()
            await cluster.wait_converged("system", timeout=60)
            cluster["b"].stop()
            stop, counter = asyncio.Event(), [0]
            writer = asyncio.create_task(_writer(cluster, rate, size, stop, counter))
            await asyncio.sleep(outage)
            backlog = counter[0]
            cluster["b"].start()
            connected_at: float | None = None
            first: dict[str, Any] | None = None
            while True:
                pair = await _pair(cluster)
                now = time.monotonic()
                if pair is not None and pair["connected"] and connected_at is None:
                    connected_at, first = now, pair
                if connected_at is not None and pair is not None and pair["caught_up"]:
                    break
                if writer.done():
                    writer.result()
                await asyncio.sleep(0.05)
            seconds = now - connected_at
            received = pair["session_records"]["received"]
            stop.set()
            await writer
            copy = (first or {}).get("copy") or {}
            return {
                "outage_s": outage,
                "write_rate": rate,
                "record_bytes": size,
                "records_behind_at_restart": backlog,
                "copy_total_at_connect": copy.get("total"),
                "records_received": received,
                "seconds": round(seconds, 3),
                "catchup_mb_s": round(received * size / seconds / 1e6, 2),
                "catchup_records_s": round(received / seconds),
            }
        finally:
            cluster.stop()
            await cluster.close()


def main() -> None:
    warnings.filterwarnings("ignore", category=ResourceWarning)  # aiohttp's note on large request bodies
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--outage", type=float, default=120.0, help="seconds b is down while a takes writes")
    parser.add_argument("--rate", type=float, default=2000.0, help="records per second written on a")
    parser.add_argument("--size", type=int, default=1024, help="bytes per record value")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--dir", help="keep the cluster's files (logs, data) here instead of a temporary directory")
    args = parser.parse_args()
    result = asyncio.run(measure(args.outage, args.rate, args.size, args.workers, args.dir))
    if args.size >= BLOB_THRESHOLD:
        baseline = "raw_blob_write_mb_s"
        raw = raw_blob_rate(args.size, min(int(args.outage * args.rate), 200))
    else:
        baseline = "raw_apply_mb_s"
        raw = raw_apply_rate(args.size, min(int(args.outage * args.rate), 100_000))
    document = {
        "catchup": result,
        "kind": "blobs" if args.size >= BLOB_THRESHOLD else "records",
        f"baseline_{baseline}": round(raw, 2),
        "ratio_catchup_to_raw": round(result["catchup_mb_s"] / raw, 3),
        "target_mb_s": TARGET_MB_S,
        "meets_target": result["catchup_mb_s"] >= TARGET_MB_S,
    }
    print(json.dumps(document, indent=2))


if __name__ == "__main__":
    main()
