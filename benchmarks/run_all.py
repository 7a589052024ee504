"""Run every benchmark, one after the other, and write `benchmarks/RESULTS.md` (`make bench`).

Each benchmark prints one JSON object; this script keeps it whole (in a folded block of the document) and puts its
headline figures in a table, with the command that produced them, how long it ran, and the machine and revision
they were measured on. A benchmark that fails is reported as failed, with its exit code and the end of its error
output, and the others still run. Benchmarks that start nodes run one at a time: on a small machine two of them at
once would measure each other.

    .venv/bin/python benchmarks/run_all.py [--quick] [--only NAME[,NAME]] [--output benchmarks/RESULTS.md]

`--quick` gives each benchmark its smoke-sized options (minutes in all rather than the better part of an hour);
the document says which sizes ran.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Bench:
    name: str
    script: str
    what: str
    args: list[str] = field(default_factory=list)  # the full run's options
    quick: list[str] = field(default_factory=list)  # `--quick`: these instead (the full ones when empty)
    # Paths (dot-separated keys into the JSON) of the figures that go in the table; missing ones are skipped.
    headline: list[str] = field(default_factory=list)


BENCHES = [
    Bench(
        "fleet_sim",
        "fleet_sim.py",
        "a fleet reconnecting to a peer back from an outage, in virtual time; validated against the AWS experiment",
        quick=["--nodes", "2000"],
    ),
    Bench(
        "setup_storm",
        "setup_storm.py",
        "the setup scheduler against one timer per event, 1,000 pairs in a storm of node-update events",
        quick=["--pairs", "200", "--events", "500"],
    ),
    Bench(
        "write_latency",
        "write_latency.py",
        "single-record write to visible on the peer; idle CPU with 100 databases",
        quick=["--writes", "100", "--databases", "20", "--idle-seconds", "5"],
        headline=[
            "latency_median_ms",
            "latency_p99_ms",
            "idle_worker_core_percent_max",
            "met.latency_median",
            "met.latency_p99",
            "met.idle_cpu",
        ],
    ),
    Bench(
        "memory",
        "memory.py",
        "proportional set size of a node at rest, with 1 and 100 idle databases, and at peak",
        args=["--records", "100000"],
        quick=["--databases", "20", "--settle", "10", "--records", "20000"],
    ),
    Bench(
        "replication_throughput",
        "replication_throughput.py",
        "raw store ceiling against end-to-end replication (200 B and 1 KB), lag at a steady rate",
        quick=["--records", "20000", "--seconds", "5"],
    ),
    Bench(
        "many_pairs",
        "many_pairs.py",
        "1,000 pairs on one node: time to connect, dispatch spacing, memory, idle CPU, spread writes",
        quick=["--databases", "100", "--peers", "10", "--per-peer", "10", "--records", "20000", "--idle-seconds", "5"],
    ),
    Bench(
        "antientropy",
        "antientropy.py",
        "finding and repairing differences between two stores; the scrub; the write path's cost",
        quick=["--quick"],
    ),
    Bench(
        "antientropy_hostile",
        "antientropy_hostile.py",
        "a hostile peer's costliest anti-entropy queries and answers: loop stall, memory, against a baseline",
        quick=["--quick"],
        headline=[
            "summary.current.largest_stall_ms",
            "summary.current.largest_rss_growth_mb",
            "summary.current.hostile_rounds_ended",
            "summary.baseline.largest_stall_ms",
            "summary.baseline.largest_rss_growth_mb",
            "summary.targets_met",
        ],
    ),
    Bench(
        "blobs_hostile",
        "blobs_hostile.py",
        "a hostile peer's blob requests and a 2^62-byte reference: worker loop stall, memory, CPU, against a baseline",
        quick=["--quick"],
        headline=[
            "current.range_requests.worker_cpu_s",
            "baseline.range_requests.worker_cpu_s",
            "current.range_requests.probe_max_ms",
            "current.huge_reference.largest_part_bytes",
            "baseline.huge_reference.largest_part_bytes",
            "current.huge_reference.probe_max_ms",
            "targets_met",
        ],
    ),
    Bench(
        "catchup",
        "catchup.py",
        "a node catching up after an outage, records and blobs, against the raw ceiling",
        quick=["--outage", "20"],
    ),
    Bench(
        "placement_cost",
        "placement_cost.py",
        "the coordinator's CPU time to place and arm every pair of 2 and 4 peers holding 1,000 databases each",
        quick=["--peers", "2", "--databases", "200"],
        headline=["cpu_seconds.2x1000", "cpu_seconds.4x1000", "cpu_seconds.2x200"],
    ),
    Bench(
        "scrape_size",
        "scrape_size.py",
        "one /metrics scrape of a node with 1,000 databases and 2 peers: bytes, series per database, time",
        quick=["--databases", "200"],
        headline=[
            "bytes",
            "gzip_bytes",
            "series",
            "series_per_database",
            "scrape_ms",
            "scrape_cpu_ms",
            "targets_met.scrape_s",
        ],
    ),
    Bench(
        "links",
        "links.py",
        "1,000 databases between 3 nodes: connections per worker and peer, PSS per idle database, idle CPU, restart",
        quick=["--databases", "100", "--idle-seconds", "5"],
        headline=[
            "connections_max_per_worker",
            "connections_max_per_direction",
            "pss_per_database_mib",
            "idle_core_percent_max",
            "restart_s",
            "restart_log_s",
            "restart.connection_opened",
            "targets_met.restart_s",
            "targets_met.connections_per_worker",
            "targets_met.pss_per_database",
        ],
    ),
    Bench(
        "spread_throughput",
        "spread_throughput.py",
        "records spread over 1,000 databases against one database: replicated rate, CPU per record, write-to-visible",
        quick=["--databases", "20", "--records", "2000", "--samples", "20"],
        headline=[
            "phases.one.rate_per_s",
            "phases.spread.rate_per_s",
            "ratios_spread_over_one.rate",
            "ratios_spread_over_one.cpu_per_record.a",
            "ratios_spread_over_one.cpu_per_record.b",
            "latency.one.p99_ms",
            "latency.spread.p99_ms",
            "ratios_spread_over_one.latency_p99",
            "targets.spread_rate_at_least_one.met",
            "targets.latency_not_worse.met",
        ],
    ),
]


def machine() -> dict[str, Any]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu or platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "revision": harness.git("describe", "--always", "--dirty", "--abbrev=12"),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def run(bench: Bench, quick: bool) -> dict[str, Any]:
    args = bench.quick if quick and bench.quick else bench.args
    command = [sys.executable, str(HERE / bench.script), *args]
    print(f"== {bench.name}: {' '.join(command[1:])}", file=sys.stderr, flush=True)
    started = time.monotonic()
    done = subprocess.run(command, cwd=harness.REPO, capture_output=True, text=True)
    seconds = round(time.monotonic() - started, 1)
    shown = " ".join([".venv/bin/python", f"benchmarks/{bench.script}", *args])
    if done.returncode != 0:
        return {"command": shown, "seconds": seconds, "failed": done.returncode, "stderr": done.stderr[-3000:]}
    try:
        result = json.loads(done.stdout)
    except json.JSONDecodeError as exc:
        return {"command": shown, "seconds": seconds, "failed": f"no JSON: {exc}", "stderr": done.stdout[-3000:]}
    return {"command": shown, "seconds": seconds, "result": result}


def _pick(result: Any, path: str) -> Any:
    for key in path.split("."):
        if not isinstance(result, dict) or key not in result:
            return None
        result = result[key]
    return result


def _scalars(result: Any, prefix: str = "", depth: int = 0) -> list[tuple[str, Any]]:
    """The scalar figures of a result, nested keys joined with dots, two levels deep (lists are left out)."""
    found: list[tuple[str, Any]] = []
    if not isinstance(result, dict) or depth > 2:
        return found
    for key, value in result.items():
        name = f"{prefix}{key}"
        if isinstance(value, bool | int | float | str) and len(str(value)) <= 80:
            found.append((name, value))
        elif isinstance(value, dict):
            found.extend(_scalars(value, f"{name}.", depth + 1))
    return found


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e6 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value).replace("|", "\\|")


def render(found: dict[str, dict[str, Any]], host: dict[str, Any], quick: bool) -> str:
    lines = [
        "# Benchmark results",
        "",
        "Written by `make bench` (`benchmarks/run_all.py`); every figure below comes from the run described here.",
        "",
        "| machine | |",
        "|---|---|",
        *(f"| {key} | {_cell(value)} |" for key, value in host.items()),
        f"| sizes | {'quick (smoke-sized options)' if quick else 'full (the default options of each script)'} |",
        "",
    ]
    for bench in BENCHES:
        if bench.name not in found:
            continue
        entry = found[bench.name]
        lines += [f"## {bench.name}", "", f"{bench.what}.", "", f"`{entry['command']}` ({entry['seconds']} s)", ""]
        if "failed" in entry:
            lines += [f"**Failed** ({entry['failed']}):", "", "```", entry["stderr"].strip(), "```", ""]
            continue
        result = entry["result"]
        rows = [(path, _pick(result, path)) for path in bench.headline]
        rows = [(path, value) for path, value in rows if value is not None] or _scalars(result)[:40]
        lines += ["| figure | value |", "|---|---|", *(f"| {path} | {_cell(value)} |" for path, value in rows), ""]
        lines += [
            "<details><summary>full output</summary>",
            "",
            "```json",
            json.dumps(result, indent=1)[:60_000],
            "```",
            "",
            "</details>",
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke-sized options for every benchmark")
    parser.add_argument("--only", help="comma-separated names: " + ", ".join(b.name for b in BENCHES))
    parser.add_argument("--output", type=Path, default=HERE / "RESULTS.md")
    options = parser.parse_args(argv)
    names = {b.name for b in BENCHES}
    chosen = set(options.only.split(",")) if options.only else names
    if unknown := chosen - names:
        parser.error(f"unknown benchmark(s) {sorted(unknown)}; known: {sorted(names)}")
    host = machine()
    found = {bench.name: run(bench, options.quick) for bench in BENCHES if bench.name in chosen}
    options.output.write_text(render(found, host, options.quick))
    failed = sorted(name for name, entry in found.items() if "failed" in entry)
    print(f"wrote {options.output}" + (f"; failed: {', '.join(failed)}" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
