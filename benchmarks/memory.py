"""Memory of a node (issue 12): PSS per process at rest with 1 and with 100 idle databases, and under load; prints JSON.

Two nodes run on loopback, a and b (LocalCluster, `--workers` workers each, replicating to each other), as an
operator would run them. The figures are node a's, its peer's beside them:

(a) at rest with one database: PSS of the coordinator, of each worker and of every other process the coordinator
    started (the worker template, multiprocessing's resource tracker, a forkserver), their total, and what
    `/status` says the total is (`pss_total_bytes`);
(b) the same with `--databases` databases (100), each created by one write through the data API, all replicated
    to the peer and then left idle;
(c) the increment per database added, (b) - (a) over the databases added;
(d) with `--records N` (0 skips it), the peak of the node's total PSS, sampled every 0.25 s while N records of 1 KB
    are written to a in bulk (the throughput benchmark's load: batches of 500, 4 concurrent requests) and
    replicated to b.

PSS shares each page among the processes that map it, and on this machine a node shares its library pages with
its peer (and with whatever else runs here): the node's PSS is then smaller than on a machine of its own.
`footprint_bytes` does not depend on that: it counts every physical page any process of the node maps once
(`/proc/PID/pagemap`, which shows page frames to root only; null otherwise), which is what the node takes from a
machine it has alone. `uss_bytes` is each process's private memory, which nothing else shares.

`--baseline REV` measures REV as well, in the same invocation: `git archive` of REV into a temporary directory
(the repository's state is not touched), runs alternating baseline, current (`--repeat` rounds), each in a child
process of its own that imports its tree's code (`--code`).

    .venv/bin/python benchmarks/memory.py [--databases 100] [--workers 2] [--settle 40] [--records 0]
    .venv/bin/python benchmarks/memory.py --baseline HEAD [--repeat 1]

About two minutes on two cores without `--records` (mostly the two settles); `--records 100000` adds about one.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness

REPO = harness.REPO
MIB = 2**20
PAGE = os.sysconf("SC_PAGE_SIZE")
PFN_MASK = (1 << 55) - 1
PRESENT = 1 << 63
TABLE = "t"
# Issue 12: the node (coordinator and two workers) at rest, each further idle database, the peak under load.
TARGET_REST_BYTES = 90 * MIB
TARGET_PER_DATABASE_BYTES = 0.2 * MIB
TARGET_PEAK_BYTES = 250 * MIB


def _pss(pid: int) -> int | None:
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return None


def _frames(pid: int) -> list[int] | None:
    """The physical page frames the process maps, or None when the kernel hides them (not root) or it is gone."""
    frames: list[int] = []
    try:
        with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/pagemap", "rb") as pagemap:
            for line in maps:
                fields = line.split()
                if fields[-1] == "[vsyscall]":
                    continue
                start, end = (int(bound, 16) for bound in fields[0].split("-"))
                pagemap.seek(start // PAGE * 8)
                entries = array.array("Q")
                entries.frombytes(pagemap.read((end - start) // PAGE * 8))
                frames.extend(entry & PFN_MASK for entry in entries if entry & PRESENT)
    except OSError:
        return None
    if frames and not any(frames):
        return None  # frames read as 0: not allowed to see them
    return frames


def _processes(node: Any, workers: set[int]) -> dict[int, str]:
    """pid -> role of every process of the node: the coordinator, its workers, and whatever else it started."""
    root = psutil.Process(node.process.pid)
    roles = {root.pid: "coordinator"}
    for child in root.children(recursive=True):
        if child.pid in workers:
            roles[child.pid] = "worker"
        else:
            role = harness.helper_role(child)
            if role is not None:
                roles[child.pid] = role
    return roles


async def _worker_pids(cluster: Any, name: str) -> set[int]:
    _, body = await cluster.admin(name, "/status")
    return {worker["pid"] for worker in body["workers"] if worker["pid"]}


async def _sample(cluster: Any, name: str) -> dict[str, Any]:
    """One reading of every process of the node."""
    roles = _processes(cluster[name], await _worker_pids(cluster, name))
    processes = []
    frames: dict[int, list[int] | None] = {}
    for pid, role in sorted(roles.items(), key=lambda item: (item[1] != "coordinator", item[1], item[0])):
        try:
            uss = psutil.Process(pid).memory_full_info().uss
        except psutil.Error:
            continue
        frames[pid] = _frames(pid)
        processes.append({"role": role, "pid": pid, "pss_bytes": _pss(pid) or 0, "uss_bytes": uss})
    _, status = await cluster.admin(name, "/status")
    reading: dict[str, Any] = {
        "processes": processes,
        "pss_total_bytes": sum(p["pss_bytes"] for p in processes),
        "status_pss_total_bytes": status.get("pss_total_bytes"),
        "footprint_bytes": None,
    }
    if all(found is not None for found in frames.values()):
        # A page mapped by k processes of the node counts 1/k for each: the node's pages each counted once.
        sharers: Counter[int] = Counter()
        for found in frames.values():
            sharers.update(set(found))
        for process in processes:
            own = set(frames[process["pid"]] or ())
            process["footprint_bytes"] = round(sum(PAGE / sharers[frame] for frame in own))
        reading["footprint_bytes"] = len(sharers) * PAGE
    return reading


async def _at_rest(cluster: Any, settle: float, samples: int = 3) -> dict[str, dict[str, Any]]:
    """Per node, the median reading (by total PSS) of a few taken a second apart, after `settle` seconds of
    idleness (long enough for the node's memory trim, every 30 s, to have run since the last write)."""
    await asyncio.sleep(settle)
    return {name: await _median_reading(cluster, name, samples) for name in cluster.nodes}


async def _median_reading(cluster: Any, name: str, samples: int) -> dict[str, Any]:
    readings = []
    for index in range(samples):
        if index:
            await asyncio.sleep(1.0)
        readings.append(await _sample(cluster, name))
    readings.sort(key=lambda reading: reading["pss_total_bytes"])
    return readings[len(readings) // 2]


async def _create(cluster: Any, databases: list[str]) -> None:
    for database in databases:
        status, answer = await cluster.data("a", "PUT", f"/data/{database}/{TABLE}/k", {"created": database})
        if status != 200:
            raise RuntimeError(f"write to {database} failed: {status} {answer}")
    await cluster.wait_connected(timeout=120, databases=databases)
    for database in databases:
        await cluster.wait_converged(database, timeout=120, expect_count=1)


async def _peak_under_load(cluster: Any, database: str, records: int) -> dict[str, Any]:
    peaks = {name: 0 for name in cluster.nodes}
    stop = asyncio.Event()

    async def sample() -> None:
        while not stop.is_set():
            for name in cluster.nodes:
                pids = _processes(cluster[name], set())
                peaks[name] = max(peaks[name], sum(_pss(pid) or 0 for pid in pids))
            try:
                await asyncio.wait_for(stop.wait(), 0.25)
            except TimeoutError:
                pass

    queue: asyncio.Queue[int] = asyncio.Queue()
    for start in range(0, records, 500):
        queue.put_nowait(start)
    pad = "x" * 1000

    async def write() -> None:
        while not queue.empty():
            start = queue.get_nowait()
            body = [{"id": f"r{i:07d}", "value": {"i": i, "pad": pad}} for i in range(start, min(records, start + 500))]
            status, answer = await cluster.data("a", "POST", f"/data/{database}/bulk", body)
            if status != 200:
                raise RuntimeError(f"write failed: {status} {answer}")

    sampler = asyncio.create_task(sample())
    started = time.monotonic()
    try:
        await asyncio.gather(*(write() for _ in range(4)))
        await cluster.wait_converged(database, timeout=600)
    finally:
        stop.set()
        await sampler
    return {"records": records, "seconds": round(time.monotonic() - started, 1), "peak_pss_total_bytes": peaks}


def _mib(value: float | None) -> float | None:
    return None if value is None else round(value / MIB, 2)


def _summary(one: dict[str, Any], many: dict[str, Any], added: int) -> dict[str, Any]:
    def per_role(reading: dict[str, Any]) -> dict[str, float | None]:
        roles: dict[str, float] = {}
        for process in reading["processes"]:
            roles[process["role"]] = roles.get(process["role"], 0) + process["pss_bytes"]
        return {role: _mib(value) for role, value in roles.items()}

    def increment(key: str) -> float | None:
        if one[key] is None or many[key] is None:
            return None
        return round((many[key] - one[key]) / added / MIB, 3)

    return {
        "one_database_pss_mib": _mib(one["pss_total_bytes"]),
        "one_database_pss_by_role_mib": per_role(one),
        "many_databases_pss_mib": _mib(many["pss_total_bytes"]),
        "many_databases_pss_by_role_mib": per_role(many),
        "per_database_pss_mib": increment("pss_total_bytes"),
        "one_database_footprint_mib": _mib(one["footprint_bytes"]),
        "many_databases_footprint_mib": _mib(many["footprint_bytes"]),
        "per_database_footprint_mib": increment("footprint_bytes"),
    }


async def measure(code: Path, databases: int, workers: int, settle: float, records: int) -> dict[str, Any]:
    cluster_class = harness.use_code(code).LocalCluster
    names = [f"m{index:03d}" for index in range(databases)]
    with tempfile.TemporaryDirectory(prefix="replicator-memory-") as folder:
        cluster = cluster_class(folder, ["a", "b"], workers=workers)
        cluster.prepare()
        cluster.start()
        try:
            await cluster.wait_ready()
            await cluster.wait_connected()
            await _create(cluster, names[:1])
            one = await _at_rest(cluster, settle)
            await _create(cluster, names[1:])
            many = await _at_rest(cluster, settle)
            load = await _peak_under_load(cluster, names[0], records) if records else None
        finally:
            cluster.stop()
            await cluster.close()
    summary = {name: _summary(one[name], many[name], databases - 1) for name in cluster.nodes}
    a = summary["a"]
    targets = {
        "rest_mib_max": _mib(TARGET_REST_BYTES),
        "per_database_mib_max": _mib(TARGET_PER_DATABASE_BYTES),
        "peak_mib_max": _mib(TARGET_PEAK_BYTES),
    }
    meets = a["one_database_pss_mib"] <= targets["rest_mib_max"] and (
        a["per_database_pss_mib"] <= targets["per_database_mib_max"]
    )
    if load is not None:
        meets = meets and load["peak_pss_total_bytes"]["a"] <= TARGET_PEAK_BYTES
        load["peak_pss_total_mib"] = {name: _mib(value) for name, value in load.pop("peak_pss_total_bytes").items()}
    return {
        "benchmark": "memory",
        "code": str(code),
        "workers_per_node": workers,
        "databases": databases,
        "settle_s": settle,
        "node": "a",
        **a,
        "peer": summary["b"],
        "load": load,
        "targets": targets,
        "meets_targets": meets,
        "readings": {"one_database": one, "many_databases": many},
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


# -- baseline comparison ---------------------------------------------------------------------------------------


def _run_side(code: Path, options: argparse.Namespace) -> dict[str, Any]:
    args = ["--databases", str(options.databases), "--workers", str(options.workers)]
    args += ["--settle", str(options.settle), "--records", str(options.records)]
    return harness.run_side(__file__, code, args)


def compare(options: argparse.Namespace) -> dict[str, Any]:
    figures = ("one_database_pss_mib", "many_databases_pss_mib", "per_database_pss_mib")
    figures += ("one_database_footprint_mib", "many_databases_footprint_mib", "per_database_footprint_mib")
    runs: dict[str, list[dict[str, Any]]] = {"baseline": [], "current": []}
    commit, _ = harness.revisions(options.baseline)
    with harness.baseline_tree(commit) as tree:
        for _ in range(options.repeat):
            runs["baseline"].append(_run_side(tree, options))
            runs["current"].append(_run_side(REPO, options))

    def median(side: str, figure: str) -> float | None:
        values = [run[figure] for run in runs[side] if run[figure] is not None]
        return statistics.median(values) if values else None

    return {
        "benchmark": "memory",
        "baseline": {"rev": commit, "median": {f: median("baseline", f) for f in figures}, "runs": runs["baseline"]},
        "current": {"median": {f: median("current", f) for f in figures}, "runs": runs["current"]},
        "order": "baseline, current, alternating",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--databases", type=int, default=100, help="idle databases in the second reading")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--settle", type=float, default=40.0, help="seconds of idleness before each reading")
    parser.add_argument("--records", type=int, default=0, help="records written for the peak under load (0: none)")
    parser.add_argument("--baseline", metavar="REV", help="also measure this git revision, side by side")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of (baseline, current) with --baseline")
    parser.add_argument("--code", type=Path, default=REPO, help="the tree whose code is measured (default: this one)")
    options = parser.parse_args()
    if options.databases < 2:
        parser.error("--databases must be at least 2")
    if options.baseline:
        result = compare(options)
    else:
        result = asyncio.run(
            measure(options.code.resolve(), options.databases, options.workers, options.settle, options.records)
        )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
