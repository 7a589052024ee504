"""Throughput spread over many databases against one database, and write-to-visible latency (issue 23); prints JSON.

Issue 23's target: "Throughput spread over 1,000 databases at least that of one database; write-to-visible latency
not worse than today." Two nodes a and b on loopback (LocalCluster, a full mesh), `--workers` W (2) workers each,
`--databases` D (1,000: the default `data.max_databases`, so exactly D are created) databases, each created by one
write (round-robin over the nodes) and every pair connected and settled before anything is measured.

throughput    two phases of `--records` R records of `--size` bytes (the msgpack of each value) written to a through
              the data API's batch form (`POST /data/{database}/{table}`, `--batch` records a request: R / D capped
              at 500 by default, so both phases send the same requests but for their database), `--clients` at a
              time, the bodies encoded beforehand, a fresh client session each:
              "one"    every request to the first database;
              "spread" the requests round-robin over all D databases.
              A record is committed at a node as the HTTP contract shows it (section 17): as soon as a database's
              last request is acknowledged, a read of its last record on b with the merged `X-Replicator-Token`s of
              its writes as `X-Replicator-After` returns once b's position for a covers them. `rate_per_s` is R over
              the time from the first request sent to the last record committed at the slowest node (a's last
              acknowledgement or b's last such read, whichever is later); `a_ingest_per_s` is R over the time of
              a's acknowledgements; `b_after_a_s` how much later b held everything than a acknowledged it. After
              each phase (untimed) every database's digests on a and b are checked equal, with the records counted.
              `cpu_ms_per_1k_records`: the CPU (user + system) of each node's processes over the phase; `_net`
              without b's reads (a spread phase asks D of them, one database one), whose cost is measured by asking
              them again once covered. The CPU ratios are of the net figures.
latency       `--samples` N single writes (`PUT`) to a, one at a time, `--interval` apart, alternately to the first
              database ("one") and to database i mod D ("spread"): from the write's request sent (on a new
              connection each, so the node's workers take them in turn, as in write_latency.py; the TLS handshake
              is not counted) until a read of the record on b, repeated back to back, first finds it. p50 and p99.

Targets: `spread_rate_at_least_one` (rate spread / rate one >= 1.0) and `latency_not_worse` (p99 spread <= 1.1 x
p99 one). `--baseline REV` (a git revision or a source tree) measures it and this tree alternating (`--repeat`
rounds, each side in a child process with `--code`): the medians of the headline figures and current / baseline.

Two cores, other work on the machine: about 10 s for the quick size below, 45 s for 200 databases and 20,000
records, 2 minutes for the default size (of which 40 to 50 s setting up the 1,000 databases).

    .venv/bin/python benchmarks/spread_throughput.py [--databases 1000] [--records 100000] [--size 200] [--samples 200]
    .venv/bin/python benchmarks/spread_throughput.py --databases 20 --records 2000 --samples 20
    .venv/bin/python benchmarks/spread_throughput.py --baseline main --repeat 1 --databases 200 --records 20000
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import msgspec
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness

NAMES = ["a", "b"]
# The table harness.create_databases seeds each database in: every write goes to a table that exists already.
TABLE = "t"
TOKEN_HEADER = "X-Replicator-Token"
AFTER_HEADER = "X-Replicator-After"
MAX_BATCH = 500
# A token read waits at most this long per request on the node (`?timeout=` allows no more); it is asked again
# until the phase's deadline.
READ_WAIT_S = 300
# Reads waiting for their tokens on b at once: below the node's per-client connection cap (256); more wait here.
READS_IN_FLIGHT = 128
# Issue 23: the spread rate at least the one-database rate; latency "not worse": p99 within 10%.
TARGET_RATE_RATIO = 1.0
TARGET_LATENCY_RATIO = 1.1


@functools.cache
def _pad(size: int) -> str:
    overhead = len(msgspec.msgpack.encode({"i": 1 << 20, "pad": ""}))
    return "x" * max(0, size - overhead)


def _value(size: int, i: int) -> dict[str, Any]:
    """A record value whose msgpack is about `size` bytes."""
    return {"i": i, "pad": _pad(size)}


@dataclass(frozen=True)
class Request:
    """One batch write of a phase: `count` records from `start` into `database`, its body encoded beforehand."""

    database: str
    last_id: str
    count: int
    body: bytes = field(repr=False)


def plan(prefix: str, databases: list[str], records: int, batch: int, size: int) -> list[Request]:
    """`records` records (ids `prefix` and a number) in requests of `batch`, round-robin over `databases`."""
    requests: list[Request] = []
    offsets = dict.fromkeys(databases, 0)
    written = 0
    while written < records:
        database = databases[len(requests) % len(databases)]
        start, count = offsets[database], min(batch, records - written)
        items = [{"id": f"{prefix}{i:07d}", "value": _value(size, i)} for i in range(start, start + count)]
        requests.append(Request(database, items[-1]["id"], count, msgspec.json.encode(items)))
        offsets[database] += count
        written += count
    return requests


def merge_tokens(tokens: Iterable[str]) -> str:
    """Session tokens merged as a client merges them: the highest version per origin."""
    highest: dict[str, int] = {}
    for token in tokens:
        for part in token.split(","):
            origin, _, version = part.strip().partition("=")
            if origin:
                highest[origin] = max(highest.get(origin, 0), int(version))
    return ",".join(f"{origin}={version}" for origin, version in sorted(highest.items()))


def _session(cluster: Any, limit: int, force_close: bool = False, **more: Any) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=limit, force_close=force_close, enable_cleanup_closed=True)
    timeout = aiohttp.ClientTimeout(total=READ_WAIT_S + 30)
    return aiohttp.ClientSession(connector=connector, headers=cluster._headers(), timeout=timeout, **more)


def _node_cpu(processes: dict[str, dict[str, psutil.Process]]) -> dict[str, float]:
    return {name: sum(harness.cpu_seconds(found).values()) for name, found in processes.items()}


async def _visible(http: aiohttp.ClientSession, cluster: Any, request: Request, token: str, deadline: float) -> float:
    """When b first answers a read of the request's last record after `token` (its position covers the token)."""
    url = f"{cluster['b'].data_url}/data/{request.database}/{TABLE}/{request.last_id}?timeout={READ_WAIT_S}"
    while True:
        async with http.get(url, headers={AFTER_HEADER: token}, ssl=cluster.data_ssl) as response:
            await response.read()
            if response.status == 200:
                return time.monotonic()
            if response.status not in (503, 504) or time.monotonic() > deadline:
                raise RuntimeError(f"b's read of {request.database}/{request.last_id} answered {response.status}")
        await asyncio.sleep(0.01)  # a 503: too many reads wait on the node already


async def _check_converged(cluster: Any, expected: dict[str, int]) -> None:
    """Every database's digests equal on a and b, with `expected` records in TABLE (untimed)."""
    gate = asyncio.Semaphore(16)

    async def one(database: str, count: int) -> None:
        async with gate:
            digests = await cluster.digests(database, NAMES)
        a, b = digests["a"], digests["b"]
        if a is None or a != b or a.get(TABLE, {}).get("count") != count:
            raise RuntimeError(f"{database} differs after the phase or lacks records: a {a}, b {b}")

    await asyncio.gather(*(one(database, count) for database, count in expected.items()))


async def _reads_cpu(
    cluster: Any, asked: list[tuple[Request, str]], processes: dict[str, psutil.Process], timeout: float
) -> float:
    """b's CPU seconds for the reads `asked` again, READS_IN_FLIGHT at a time, each covered already."""
    gate = asyncio.Semaphore(READS_IN_FLIGHT)
    deadline = time.monotonic() + timeout

    async def one(http: aiohttp.ClientSession, request: Request, token: str) -> None:
        async with gate:
            await _visible(http, cluster, request, token, deadline)

    async with _session(cluster, READS_IN_FLIGHT) as reads:
        before = sum(harness.cpu_seconds(processes).values())
        await asyncio.gather(*(one(reads, request, token) for request, token in asked))
        return sum(harness.cpu_seconds(processes).values()) - before


async def throughput(
    cluster: Any,
    requests: list[Request],
    held: dict[str, int],
    clients: int,
    processes: dict[str, dict[str, psutil.Process]],
    timeout: float,
) -> dict[str, Any]:
    """Write `requests` to a, `clients` at a time; the rates, the times, each node's CPU per 1,000 records.
    `held`: the records of TABLE in each database before, counted on."""
    left: dict[str, int] = {}
    for request in requests:
        left[request.database] = left.get(request.database, 0) + 1
    tokens: dict[str, list[str]] = {database: [] for database in left}
    acked: list[float] = []
    seen: list[asyncio.Task[float]] = []
    asked: list[tuple[Request, str]] = []  # each database's read on b: its last request, its writes' tokens
    pending = list(reversed(requests))
    url = cluster["a"].data_url
    cpu_before = _node_cpu(processes)
    async with (
        _session(cluster, clients) as writes,
        _session(cluster, READS_IN_FLIGHT) as reads,
        asyncio.TaskGroup() as readers,
    ):
        deadline = time.monotonic() + timeout

        async def writer() -> None:
            while pending:
                request = pending.pop()
                path = f"{url}/data/{request.database}/{TABLE}"
                async with writes.post(path, data=request.body, ssl=cluster.data_ssl) as response:
                    body = await response.read()
                    if response.status != 200:
                        raise RuntimeError(f"POST {request.database}/{TABLE} answered {response.status}: {body[:300]}")
                    token = response.headers.get(TOKEN_HEADER)
                acked.append(time.monotonic())
                if token is None:
                    raise RuntimeError(f"the write answer has no {TOKEN_HEADER}: this tree has no session tokens")
                tokens[request.database].append(token)
                left[request.database] -= 1
                if not left[request.database]:
                    merged = merge_tokens(tokens[request.database])
                    asked.append((request, merged))
                    seen.append(readers.create_task(_visible(reads, cluster, request, merged, deadline)))

        started = time.monotonic()
        await asyncio.gather(*(writer() for _ in range(clients)))
    cpu_after = _node_cpu(processes)
    records = sum(request.count for request in requests)
    visible = [task.result() for task in seen]
    if len(visible) != len(left):
        raise RuntimeError(f"b showed {len(visible)} of {len(left)} databases")
    for request in requests:
        held[request.database] += request.count
    await _check_converged(cluster, {database: held[database] for database in left})
    reads_cpu = await _reads_cpu(cluster, asked, processes["b"], timeout)
    a_done, b_done = max(acked) - started, max(visible) - started
    used = {name: cpu_after[name] - cpu_before[name] for name in processes}
    seconds = max(a_done, b_done)
    return {
        "databases": len(left),
        "requests": len(requests),
        "records": records,
        "seconds": round(seconds, 3),
        "rate_per_s": round(records / seconds),
        "a_ingest_s": round(a_done, 3),
        "a_ingest_per_s": round(records / a_done),
        "b_finished_s": round(b_done, 3),
        "b_after_a_s": round(b_done - a_done, 3),
        "cpu_ms_per_1k_records": {name: round(used[name] * 1e6 / records, 1) for name in processes},
        # b's CPU for the phase's reads alone (one per database), measured again once they are covered: a phase
        # over D databases asks b D reads, one database one. `net` is b's figure without them.
        "b_reads": len(asked),
        "b_reads_cpu_ms_per_1k_records": round(reads_cpu * 1e6 / records, 1),
        "cpu_ms_per_1k_records_net": {
            name: round((used[name] - (reads_cpu if name == "b" else 0.0)) * 1e6 / records, 1) for name in processes
        },
    }


def _sent_trace() -> aiohttp.TraceConfig:
    """Marks in each request's `trace_request_ctx` (a dict) when its headers went out: after any TLS handshake."""

    async def headers_sent(session: Any, context: SimpleNamespace, params: Any) -> None:
        if isinstance(context.trace_request_ctx, dict):
            context.trace_request_ctx["sent"] = time.monotonic()

    trace = aiohttp.TraceConfig()
    trace.on_request_headers_sent.append(headers_sent)
    return trace


async def _one_sample(
    cluster: Any, write: aiohttp.ClientSession, poll: aiohttp.ClientSession, database: str, record_id: str, i: int
) -> tuple[float, float]:
    """Milliseconds from a single write's request sent to a until a read on b first finds the record, and until
    a's answer."""
    path = f"/data/{database}/{TABLE}/{record_id}"
    marks: dict[str, float] = {}
    body = msgspec.json.encode({"i": i})
    async with write.put(
        cluster["a"].data_url + path, data=body, ssl=cluster.data_ssl, trace_request_ctx=marks
    ) as response:
        if response.status not in (200, 201):
            raise RuntimeError(f"PUT {path} answered {response.status}: {await response.text()}")
        await response.read()
    answered = time.monotonic()
    deadline = answered + 30
    while True:
        async with poll.get(cluster["b"].data_url + path, ssl=cluster.data_ssl) as response:
            await response.read()
            found = time.monotonic()
            if response.status == 200:
                return (found - marks["sent"]) * 1000, (answered - marks["sent"]) * 1000
            if response.status != 404 or found > deadline:
                raise RuntimeError(f"b's read of {path} answered {response.status}")


async def latency(cluster: Any, databases: list[str], samples: int, interval: float) -> dict[str, Any]:
    """Single writes alternating between the first database and the next of all of them; p50 / p99 of each."""
    found: dict[str, list[float]] = {"one": [], "spread": []}
    answers: dict[str, list[float]] = {"one": [], "spread": []}
    async with (
        _session(cluster, 1, force_close=True, trace_configs=[_sent_trace()]) as write_one,
        _session(cluster, 1, force_close=True, trace_configs=[_sent_trace()]) as write_spread,
        _session(cluster, 1) as poll_one,
        _session(cluster, 1) as poll_spread,
    ):
        sessions = {"one": (write_one, poll_one), "spread": (write_spread, poll_spread)}
        for i in range(samples):
            for kind, database in (("one", databases[0]), ("spread", databases[i % len(databases)])):
                started = time.monotonic()
                write, poll = sessions[kind]
                visible, answered = await _one_sample(cluster, write, poll, database, f"l{kind}{i:06d}", i)
                found[kind].append(visible)
                answers[kind].append(answered)
                await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))
    return {
        kind: {
            "samples": len(values),
            "p50_ms": round(statistics.median(values), 3),
            "p99_ms": round(harness.percentile(values, 0.99), 3),
            "max_ms": round(max(values), 3),
            # a's answer to the write: the part of the latency before b could be asked.
            "write_answer_p50_ms": round(statistics.median(answers[kind]), 3),
        }
        for kind, values in found.items()
    }


async def measure(options: argparse.Namespace) -> dict[str, Any]:
    harness.raise_fd_limit()
    code = options.code.resolve()
    local_cluster = harness.use_code(code)
    load_before = os.getloadavg()[0]
    databases = [f"s{index:04d}" for index in range(options.databases)]
    batch = options.batch or max(1, min(MAX_BATCH, options.records // options.databases))
    one = plan("one", databases[:1], options.records, batch, options.size)
    spread = plan("spread", databases, options.records, batch, options.size)
    held = dict.fromkeys(databases, 1)  # the seed record
    with tempfile.TemporaryDirectory(prefix="replicator-spread-") as folder:
        replication = {"shutdown_timeout": 20.0}
        cluster = local_cluster.LocalCluster(folder, NAMES, workers=options.workers, replication=replication)
        cluster.prepare()
        cluster.start()
        try:
            await cluster.wait_ready(timeout=120)
            started = time.monotonic()
            await harness.create_databases(cluster, NAMES, list(enumerate(databases)), 8)
            wanted = harness.full_mesh_pairs(NAMES, databases)
            _, documents = await harness.wait_connected(cluster, wanted, options.timeout, 0.5, databases)
            await cluster.wait_settled(timeout=options.timeout)
            setup_s = time.monotonic() - started
            processes = {name: harness.node_processes(cluster[name], documents[name]) for name in NAMES}
            phases = {
                "one": await throughput(cluster, one, held, options.clients, processes, options.timeout),
                "spread": await throughput(cluster, spread, held, options.clients, processes, options.timeout),
            }
            latencies = await latency(cluster, databases, options.samples, options.interval)
        finally:
            cluster.stop()
            await cluster.close()
            harness.keep_logs(cluster, options.keep_logs, "current" if code == harness.REPO else "baseline")
    rate_ratio = harness.ratio(phases["spread"]["rate_per_s"], phases["one"]["rate_per_s"])
    p99_ratio = harness.ratio(latencies["spread"]["p99_ms"], latencies["one"]["p99_ms"])
    return {
        "benchmark": "spread_throughput",
        "code": str(code),
        "nodes": len(NAMES),
        "workers": options.workers,
        "databases": options.databases,
        "records": options.records,
        "record_bytes": options.size,
        "batch": batch,
        "clients": options.clients,
        "setup_s": round(setup_s, 3),
        "phases": phases,
        "latency": latencies,
        "ratios_spread_over_one": {
            "rate": rate_ratio,
            "a_ingest": harness.ratio(phases["spread"]["a_ingest_per_s"], phases["one"]["a_ingest_per_s"]),
            # Without b's reads (`cpu_ms_per_1k_records_net`): what writing and replicating the records cost.
            "cpu_per_record": {
                name: harness.ratio(
                    phases["spread"]["cpu_ms_per_1k_records_net"][name],
                    phases["one"]["cpu_ms_per_1k_records_net"][name],
                )
                for name in NAMES
            },
            "latency_p50": harness.ratio(latencies["spread"]["p50_ms"], latencies["one"]["p50_ms"]),
            "latency_p99": p99_ratio,
        },
        "targets": {
            "spread_rate_at_least_one": {
                "ratio": rate_ratio,
                "at_least": TARGET_RATE_RATIO,
                "met": rate_ratio is not None and rate_ratio >= TARGET_RATE_RATIO,
            },
            "latency_not_worse": {
                "ratio": p99_ratio,
                "at_most": TARGET_LATENCY_RATIO,
                "met": p99_ratio is not None and p99_ratio <= TARGET_LATENCY_RATIO,
            },
        },
        # Other work on the machine skews a run, and shows here.
        "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


# -- comparing ------------------------------------------------------------------------------------------------------

# The headline figures (dot-separated keys of a run's result) the comparison gives medians and ratios of.
FIGURES = [
    "phases.one.rate_per_s",
    "phases.spread.rate_per_s",
    "phases.one.a_ingest_per_s",
    "phases.spread.a_ingest_per_s",
    "phases.spread.b_after_a_s",
    "latency.one.p99_ms",
    "latency.spread.p99_ms",
    "ratios_spread_over_one.rate",
    "ratios_spread_over_one.latency_p99",
]


def _figure(result: dict[str, Any], path: str) -> Any:
    for key in path.split("."):
        result = result.get(key) if isinstance(result, dict) else None
    return result


def compare(options: argparse.Namespace, args: list[str]) -> dict[str, Any]:
    baseline_rev, current_rev, runs = harness.alternate(__file__, options.baseline, args, options.repeat)
    medians = {
        side: {figure: harness.median([_figure(run, figure) for run in found], 3) for figure in FIGURES}
        for side, found in runs.items()
    }
    ratios = {figure: harness.ratio(medians["current"][figure], medians["baseline"][figure]) for figure in FIGURES}
    return harness.comparison(
        "spread_throughput",
        options.repeat,
        baseline_rev,
        current_rev,
        {"baseline": medians["baseline"], "current": medians["current"], "ratios": ratios},
        runs,
        # "Not worse than today": this tree's single-write p99 against the baseline's, one database and spread.
        latency_not_worse_than_baseline={
            kind: ratios[f"latency.{kind}.p99_ms"] is not None and ratios[f"latency.{kind}.p99_ms"] <= 1.1
            for kind in ("one", "spread")
        },
        targets_met={side: [run["targets"] for run in found] for side, found in runs.items()},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--databases", type=int, default=1000, help="databases, all created (default 1000)")
    parser.add_argument("--records", type=int, default=100_000, help="records written per phase (default 100000)")
    parser.add_argument("--size", type=int, default=200, help="bytes per record, msgpack of the value (default 200)")
    parser.add_argument("--batch", type=int, default=0, help="records per request (default records / databases)")
    parser.add_argument("--clients", type=int, default=4, help="concurrent write requests (default 4)")
    parser.add_argument("--workers", type=int, default=2, help="workers per node (default 2)")
    parser.add_argument("--samples", type=int, default=200, help="single writes per latency kind (default 200)")
    parser.add_argument("--interval", type=float, default=0.02, help="seconds between single writes (default 0.02)")
    parser.add_argument("--timeout", type=float, default=900.0, help="give up on a phase after this (default 900)")
    parser.add_argument("--keep-logs", metavar="DIR", help="copy the nodes' logs into DIR")
    harness.comparison_options(parser)
    options = parser.parse_args()
    if options.databases < 1 or options.records < 1 or options.samples < 1 or options.size < 16:
        parser.error("--databases, --records and --samples must be at least 1, --size at least 16")
    if options.keep_logs:  # the run works in the measured tree's folder (harness.use_code)
        options.keep_logs = str(Path(options.keep_logs).resolve())
    if options.baseline:
        args = harness.side_args(sys.argv[1:])
        if options.keep_logs:
            args = [*harness.without(args, "--keep-logs"), "--keep-logs", options.keep_logs]
        result = compare(options, args)
    else:
        result = asyncio.run(measure(options))
    harness.print_json(result)


if __name__ == "__main__":
    main()
