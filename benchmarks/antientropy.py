"""Anti-entropy: the cost of finding and repairing a few differences, of an idle round, and of keeping the digests
on the write path; prints JSON.

(1) Find and repair. Two stores of two nodes, a and b, hold the same `--records` records (~100-byte values, one
    table; b is built by applying a's `origin_entries` with `apply_batch`, as replication would). Then they are
    made to differ in `--differ` records, of three kinds:
      - lost on b: the row deleted behind b's back with sqlite3 (the delete trigger takes it out of its bucket's
        digest; no tombstone, so a's copy still wins);
      - stale on b: a newer write on a that b lacks (written on a only);
      - damaged on b: its value changed in place with sqlite3, which moves no digest (the checksum column did not
        change), then found by a `scrub` pass over b (its time and rows/s are reported) that marks it damaged.
    The rounds, in order: a pulls from b while they differ (it finds the differences and must repair nothing:
    a holds every winner); b pulls from a, the repair (it must repair exactly `--differ` records, and b's
    `digest()` must equal a's afterwards, or the benchmark fails); a pulls from b and b from a again, both idle.
    Each round reports bytes exchanged, wall and CPU time, buckets (tree nodes) compared, divergent buckets and
    records repaired. The peer is `local_transport`: queries and answers are encoded and decoded as on the wire,
    but no TLS or HTTP, and both ends' work runs in this process.
(2) Idle round CPU. Rounds between the two databases, identical by then: CPU seconds (time.process_time, both
    ends) and wall time of each. An idle round exchanges the roots only.
(3) The write path's cost of anti-entropy (each row's checksum and bucket, the bucket index, the bucket digests
    the writer updates once per bucket and batch, the trigger that takes out a replaced row):
    the store's raw write rate (put_many, batches of 500 records of 200 bytes, a fresh database) and its apply
    rate (apply_batch of 500-record batches of another node's origin_entries, with marks: the replicated
    writes), at this tree and at `--baseline REV` (default 1d4d3a0, the commit before the digests), side by
    side: the files of REV are extracted into a temporary directory (removed afterwards) and every measurement runs
    in a child process of this script with PYTHONPATH (and the working directory) at the tree under test,
    alternating baseline, current, baseline, current... (`--repeat` rounds) so a noisy machine's drift spreads
    over both. Reported: every run, the median records/s of each side, their ratio current / baseline, and
    whether it stays within 10%.

    .venv/bin/python benchmarks/antientropy.py [--records 1000000] [--differ 10] [--write-records 200000]
        [--repeat 3] [--baseline 1d4d3a0]
    .venv/bin/python benchmarks/antientropy.py --quick

The defaults take about 75 s on two cores (most of it building the two 1M-record databases) and under 1 GB of
temporary disk; `--quick` (20,000 records, 20,000 writes, one round of each side) about 2 s. The ratios of
`--quick` are noisier than those of the defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import random
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness

REPO = harness.REPO
DATABASE = "bench"
TABLE = "items"
RECORD_BYTES = 100
WRITE_BYTES = 200
WRITE_BATCH = 500
BUILD_BATCH = 5000  # records per transaction when building the two big databases: setup, not measured
SCRUB_STEP = 1000  # rows per scrub call
IDLE_ROUNDS = 20
REPAIR_RATE = 1e9  # records/s: unpaced, so the round's own cost shows
SEED = 7
# The write path may not get more than 10% slower for the digests.
TOLERATED_DROP = 0.10


def _value(index: int, size: int, tag: str = "") -> bytes:
    """A value of about `size` bytes, different for every record (and every tag): a msgpack string, as the data API
    stores one (a peer's value that is not msgpack is refused, by anti-entropy too)."""
    unit = f"{tag}{index:010d}|"
    return msgspec.msgpack.encode((unit * (size // len(unit) + 1))[: size - 3])


def _timed(work: Callable[[], Any]) -> tuple[Any, float, float]:
    """`work()`, its wall seconds and its CPU seconds (this process)."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = work()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def _fill(db: Any, ids: list[str], size: int, batch: int) -> None:
    for start in range(0, len(ids), batch):
        db.put_many(
            TABLE,
            [(record_id, _value(start + offset, size)) for offset, record_id in enumerate(ids[start : start + batch])],
        )


def _copy(source: Any, target: Any, origin: str, batch: int) -> tuple[int, float, float]:
    """Apply every record `origin` wrote in `source` to `target`, `batch` at a time with the sender's mark, as a
    subscription would. Returns the records applied and the wall and CPU seconds of the apply_batch calls."""
    after = 0
    applied = 0
    wall = cpu = 0.0
    while True:
        entries = source.origin_entries(origin, after, batch)
        if not entries:
            return applied, wall, cpu
        after = entries[-1].version
        _, took, used = _timed(lambda entries=entries, after=after: target.apply_batch(entries, {origin: after}))
        applied += len(entries)
        wall += took
        cpu += used


# -- (1) and (2): find and repair, idle rounds ------------------------------------------------------------------


def _diverge(db_a: Any, db_b: Any, ids: list[str], differ: int) -> dict[str, list[str]]:
    """Make b differ from a in `differ` records: one damaged (if any), then half lost, half stale."""
    chosen = random.Random(SEED).sample(range(len(ids)), differ)
    damaged = chosen[:1]
    lost = chosen[1 : 1 + (differ - 1) // 2]
    stale = chosen[1 + len(lost) :]
    db_a.put_many(TABLE, [(ids[index], _value(index, RECORD_BYTES, "newer")) for index in stale])
    # Behind b's back: a second connection, as the sqlite3 shell would be.
    with closing(sqlite3.connect(db_b.path, isolation_level=None, timeout=10.0)) as conn:
        conn.execute("BEGIN IMMEDIATE")
        for index in lost:
            conn.execute("DELETE FROM records WHERE tbl = ? AND id = ?", (TABLE, ids[index]))
        for index in damaged:
            conn.execute(
                "UPDATE records SET value = ? WHERE tbl = ? AND id = ?",
                (_value(index, RECORD_BYTES, "rot"), TABLE, ids[index]),
            )
        conn.execute("COMMIT")
    return {
        kind: [ids[index] for index in picked]
        for kind, picked in (("lost", lost), ("stale", stale), ("damaged", damaged))
    }


def _scrub(db: Any) -> dict:
    """One whole scrub pass over `db`, SCRUB_STEP rows a call."""
    rows = db.digest()[TABLE]["count"]
    found: list[Any] = []

    def scrub_all() -> None:
        after: int | None = 0
        while after is not None:
            after, damaged = db.scrub(after, SCRUB_STEP)
            found.extend(damaged)

    _, wall, cpu = _timed(scrub_all)
    return {
        "rows": rows,
        "wall_seconds": round(wall, 3),
        "cpu_seconds": round(cpu, 3),
        "rows_per_s": round(rows / wall),
        "damaged_found": sorted(damage.id for damage in found),
    }


async def _round(db: Any, peer: Any) -> dict:
    """One round of `db` pulling from `peer`; an error the round reports fails the benchmark."""
    from replicator.workers.antientropy import Round, local_transport

    wall, cpu = time.perf_counter(), time.process_time()
    result = await Round(db, local_transport(peer), rate=REPAIR_RATE).run()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if result.error:
        raise RuntimeError(f"the round of {db.path} against {peer.path} failed: {result.error}")
    return {
        "bytes_exchanged": result.bytes_exchanged,
        "wall_seconds": round(wall, 4),
        "cpu_seconds": round(cpu, 4),
        "buckets_compared": result.buckets_compared,
        "divergent_buckets": result.divergent_buckets,
        "repaired": result.repaired,
    }


def _fail(message: str) -> None:
    raise SystemExit(f"antientropy benchmark: {message}")


async def find_and_repair(records: int, differ: int) -> tuple[dict, dict]:
    from replicator.shared.store import Store

    ids = [f"r{index:08d}" for index in range(records)]
    with (
        tempfile.TemporaryDirectory(prefix="replicator-ae-bench-") as folder,
        Store(Path(folder) / "a", "a") as store_a,
        Store(Path(folder) / "b", "b") as store_b,
    ):
        db_a = store_a.database(DATABASE, create=True)
        db_b = store_b.database(DATABASE, create=True)
        _, fill_wall, _ = _timed(lambda: _fill(db_a, ids, RECORD_BYTES, BUILD_BATCH))
        copied, copy_wall, _ = _copy(db_a, db_b, "a", BUILD_BATCH)
        if db_a.digest() != db_b.digest():
            _fail("b does not match a after the build")
        kinds = _diverge(db_a, db_b, ids, differ)
        scrub = _scrub(db_b)
        if scrub["damaged_found"] != sorted(kinds["damaged"]):
            _fail(f"the scrub found {scrub['damaged_found']}, not the damaged {kinds['damaged']}")
        digest_a = db_a.digest()
        if differ and db_b.digest() == digest_a:
            _fail("b's digest equals a's although they differ")

        rounds = {"a_from_b_while_differing": await _round(db_a, db_b)}
        if db_a.digest() != digest_a:
            _fail("a changed pulling from b, which holds no winner")
        rounds["b_from_a_repair"] = await _round(db_b, db_a)
        repaired = rounds["b_from_a_repair"]["repaired"]
        if repaired != differ:
            _fail(f"the repair round repaired {repaired} records, not {differ}")
        if db_b.digest() != db_a.digest():
            _fail("b's digest differs from a's after the repair round")
        rounds["a_from_b_after"] = await _round(db_a, db_b)
        rounds["b_from_a_again"] = await _round(db_b, db_a)
        if rounds["a_from_b_after"]["repaired"] or rounds["b_from_a_again"]["repaired"]:
            _fail("a round after the repair repaired something")

        idle = [await _round(db_b, db_a) for _ in range(IDLE_ROUNDS)]

    find = {
        "records": records,
        "value_bytes": RECORD_BYTES,
        "differ": differ,
        "differences": {kind: len(picked) for kind, picked in kinds.items()},
        "build": {
            "a_put_many_records_per_s": round(records / fill_wall),
            "b_apply_batch_records_per_s": round(copied / copy_wall),
            "batch": BUILD_BATCH,
        },
        "scrub_b": {key: value for key, value in scrub.items() if key != "damaged_found"}
        | {"damaged_found": len(scrub["damaged_found"])},
        "rounds": rounds,
        "digests_equal_after_repair": True,
    }
    cpu = [run["cpu_seconds"] for run in idle]
    wall = [run["wall_seconds"] for run in idle]
    idle_cost = {
        "records": records,
        "rounds": IDLE_ROUNDS,
        "cpu_seconds_median": statistics.median(cpu),
        "cpu_seconds_min": min(cpu),
        "cpu_seconds_max": max(cpu),
        "wall_seconds_median": statistics.median(wall),
        "wall_seconds_max": max(wall),
        "bytes_exchanged": idle[0]["bytes_exchanged"],
        "buckets_compared": idle[0]["buckets_compared"],
        # One table: one root compared, and nothing asked beyond the roots.
        "roots_only": all(
            run["buckets_compared"] == 1 and run["bytes_exchanged"] == idle[0]["bytes_exchanged"] for run in idle
        ),
    }
    return find, idle_cost


# -- (3) the write path, this tree against a baseline ------------------------------------------------------------


def measure_writes(code: Path, records: int) -> dict:
    """Runs in the child: put_many and apply_batch rates of the store of the tree `code` (on PYTHONPATH)."""
    if (code / "src" / "replicator").is_dir():
        store_module = importlib.import_module("replicator.shared.store")
    else:  # a tree from before the `replicator` import root
        store_module = importlib.import_module("shared.store")

    loaded = Path(store_module.__file__).resolve()
    if not loaded.is_relative_to(code):
        raise RuntimeError(f"replicator.shared.store came from {loaded}, not from {code}")
    ids = [f"w{index:08d}" for index in range(records)]
    batches = [
        [
            (record_id, _value(start + offset, WRITE_BYTES))
            for offset, record_id in enumerate(ids[start : start + WRITE_BATCH])
        ]
        for start in range(0, records, WRITE_BATCH)
    ]
    with (
        tempfile.TemporaryDirectory(prefix="replicator-ae-writes-") as folder,
        store_module.Store(Path(folder) / "a", "a") as store_a,
        store_module.Store(Path(folder) / "b", "b") as store_b,
    ):
        db_a = store_a.database(DATABASE, create=True)
        db_b = store_b.database(DATABASE, create=True)

        def write() -> None:
            for items in batches:
                db_a.put_many(TABLE, items)

        _, put_wall, put_cpu = _timed(write)
        applied, apply_wall, apply_cpu = _copy(db_a, db_b, "a", WRITE_BATCH)
        with closing(sqlite3.connect(db_a.path)) as conn:
            columns = [row[1] for row in conn.execute("PRAGMA table_info(records)")]
    return {
        "store": str(loaded),
        "records_columns": columns,
        "put_many": {
            "records_per_s": round(records / put_wall),
            "cpu_us_per_record": round(put_cpu * 1e6 / records, 2),
            "seconds": round(put_wall, 3),
        },
        "apply_batch": {
            "records_per_s": round(applied / apply_wall),
            "cpu_us_per_record": round(apply_cpu * 1e6 / applied, 2),
            "seconds": round(apply_wall, 3),
        },
    }


def _run_side(code: Path, records: int) -> dict:
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--measure-writes",
        str(code),
        "--write-records",
        str(records),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(code / "src"), str(code)])}
    done = subprocess.run(command, cwd=code, env=env, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the write measurement of {code} exited with {done.returncode}")
    return json.loads(done.stdout)


def write_path(baseline: str, records: int, repeat: int) -> dict:
    baseline_rev, current_rev = harness.revisions(baseline)
    runs: dict[str, list[dict]] = {"baseline": [], "current": []}
    with harness.baseline_tree(baseline_rev) as tree:
        for _ in range(repeat):
            runs["baseline"].append(_run_side(tree, records))
            runs["current"].append(_run_side(REPO, records))
    result: dict[str, Any] = {
        "records": records,
        "value_bytes": WRITE_BYTES,
        "batch": WRITE_BATCH,
        "repeat": repeat,
        "order": "baseline, current, alternating",
        "baseline": {"rev": baseline_rev, "records_columns": runs["baseline"][0]["records_columns"]},
        "current": {"rev": current_rev, "records_columns": runs["current"][0]["records_columns"]},
    }
    for path in ("put_many", "apply_batch"):
        sides = {}
        for side, side_runs in runs.items():
            sides[side] = {
                "runs_records_per_s": [run[path]["records_per_s"] for run in side_runs],
                "runs_cpu_us_per_record": [run[path]["cpu_us_per_record"] for run in side_runs],
                "median_records_per_s": statistics.median(run[path]["records_per_s"] for run in side_runs),
                "median_cpu_us_per_record": statistics.median(run[path]["cpu_us_per_record"] for run in side_runs),
            }
        ratio = round(sides["current"]["median_records_per_s"] / sides["baseline"]["median_records_per_s"], 3)
        cpu_ratio = sides["current"]["median_cpu_us_per_record"] / sides["baseline"]["median_cpu_us_per_record"]
        result[path] = {
            **sides,
            "ratio_current_over_baseline": ratio,
            "cpu_per_record_ratio_current_over_baseline": round(cpu_ratio, 3),
            "within_10_percent": ratio >= 1 - TOLERATED_DROP,
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000, help="records in each of the two databases")
    parser.add_argument("--differ", type=int, default=10, help="records in which the two databases differ")
    parser.add_argument("--write-records", type=int, default=200_000, help="records written per write measurement")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of (baseline, current) write measurements")
    parser.add_argument(
        "--baseline", metavar="REV", default="1d4d3a0", help="the revision the write path is compared with"
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: 20,000 records and writes, one round")
    parser.add_argument("--measure-writes", type=Path, metavar="TREE", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.measure_writes:
        print(json.dumps(measure_writes(options.measure_writes.resolve(), options.write_records)))
        return
    if options.quick:
        options.records, options.differ, options.write_records, options.repeat = 20_000, 10, 20_000, 1
    if not 0 <= options.differ <= options.records:
        parser.error("--differ must be between 0 and --records")
    load_before = os.getloadavg()[0]
    find, idle = asyncio.run(find_and_repair(options.records, options.differ))
    writes = write_path(options.baseline, options.write_records, options.repeat)
    result = {
        "benchmark": "antientropy",
        "find_and_repair": find,
        "idle_round": idle,
        "write_path": writes,
        # The machine's 1-minute load average around the run: other work on it skews a run, and shows here.
        "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
