"""What one scrape of `/metrics` costs on a node with many databases (issue 23, part 4); prints JSON.

A node with `--databases` N (1,000) databases and `--peers` P (2) peers that hold them all: its coordinator's
metrics are fed the state of a real node, and scraped with prometheus-client's exposition (the text format
`/metrics` serves, `generate_latest` of the node's registry, as the admin port's handler renders it). Three real
nodes with 1,000 databases each would take minutes to build on a two-core machine and would measure their own
convergence, not the scrape; so the node here is the tree's own `coordinator.node.Node` with a stand-in supervisor
(no worker process, no socket; the loop is never run, so no timer fires) and it is given, through the same calls a
running node makes, what a node in the middle of a convergence holds:

- the registry lists the P peers (`node-b`, `node-c`, ...), each holding every database; the node holds them all
  (`tenant-0000` ...) and the system database, so it has P x (N + 1) pairs;
- every pair connected (`Connected`) and copying: a `Progress` report behind its peer, with records received,
  a lag and a backlog left;
- the workers' heartbeats (`Heartbeat`): records applied, received and sent per pair, records written here per
  database, bytes per peer, one batch-apply observation per database, each with the labels the tree's own specs
  give it (`coordinator.metrics.FED_COUNTERS`, `FED_HISTOGRAMS`), as its workers send them;
- one anti-entropy round per pair through the coordinator's own path (a round started, its `AntiEntropyDone`
  answered); 1 % of them repaired records in divergent buckets, one failed on a limit, one database had a damaged
  record; each peer's setup-to-connected time.

`--state caught-up` gives every pair a caught-up report instead (lag 0, nothing left to copy).

Figures, for the tree (and the baseline with `--baseline`): `bytes` and `gzip_bytes` of one scrape, `series` (every
sample line), `series_per_database` (the samples labelled with a database, over N + 1), `by_metric` (those samples
per database, by metric family: which metrics scale with databases), `scrape_ms` (median of `--repeat-scrapes`
scrapes after a first one: assembling the series from the node's state and rendering them, as one request to the
admin port does, without the HTTP; `scrape_cpu_ms`: the CPU time of the same scrapes, which other work on the
machine disturbs less), and `targets_met` against issue 23's 200 KB and 0.5 s.

`--baseline REV` measures REV (a git revision, through `git archive`, or the path of a source tree) beside this tree
in the same invocation, each in a child process, alternating (`--repeat` rounds); the medians and the ratios
current / baseline are given.

    .venv/bin/python benchmarks/scrape_size.py [--databases 1000] [--peers 2] [--state converging|caught-up]
    .venv/bin/python benchmarks/scrape_size.py --baseline HEAD~1 [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import importlib
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness

TARGET_BYTES = 200_000  # issue 23: a scrape of a node with 1,000 databases under 200 KB and 0.5 s
TARGET_SCRAPE_S = 0.5
WORKERS = 2


@dataclass
class StandInHandle:
    slot: int
    alive: bool = True
    ready: bool = True
    retiring: bool = False
    restarts: int = 0
    pid: int = 0  # no process: the scrape reads no worker's CPU or files
    rss_bytes: int = 80 * 1024 * 1024
    exit_code: int | None = None
    boot_error: str = ""
    last_heartbeat: float = 0.0


@dataclass
class StandInSupervisor:
    """What the node asks of its supervisor, with no process behind it; `sent` keeps what it would send."""

    slots: int = WORKERS
    respawns: int = 0
    sent: list[tuple[int, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.workers = {slot: StandInHandle(slot) for slot in range(self.slots)}

    def live(self) -> list[int]:
        return [slot for slot, handle in sorted(self.workers.items()) if handle.alive and handle.ready]

    def is_live(self, slot: int | None) -> bool:
        handle = self.workers.get(slot) if slot is not None else None
        return handle is not None and handle.alive and not handle.retiring

    def all_ready(self) -> bool:
        return all(handle.alive and handle.ready for handle in self.workers.values())

    def send(self, slot: int, message: Any) -> bool:
        self.sent.append((slot, message))
        return True


def _module(name: str) -> Any:
    return importlib.import_module(f"replicator.{name}")


def build(code: Path, databases: int, peers: int, state: str) -> Any:
    """The tree's Node, fed the state of a node `state` (converging or caught-up) with these databases and peers."""
    node_module = harness.use_code(code, "coordinator.node")
    config_module = _module("shared.config")
    registry = _module("coordinator.registry")
    messages = _module("shared.messages")
    histograms = _module("shared.histograms")
    keys = _module("shared.keys")
    # The node's events while it is fed (setups armed, rounds requested) are not what is measured.
    _module("shared.logs").log.configure(level="error")
    names = [f"tenant-{index:04d}" for index in range(databases)]
    held = [*names, "system"]
    config = config_module.from_mapping(
        {"node": {"name": "node-a", "url": "wss://127.0.0.1:9925", "workers": WORKERS}}, "scrape_size"
    )
    supervisor = StandInSupervisor()
    loop = asyncio.new_event_loop()  # never run: the node's timers stay armed and nothing fires
    node = node_module.Node(config, loop=loop, rng=lambda: 0.5, supervisor=supervisor)
    node.holds = set(held)
    views = [
        registry.NodeView(
            name=f"node-{chr(ord('b') + index)}",
            url=f"wss://127.0.0.1:{9935 + 10 * index}",
            holds=tuple(held),
            replicates=True,
            static=True,
            version=1,
        )
        for index in range(peers)
    ]
    for view in views:
        node.views[view.name] = view
        node.on_node_update(view)
    caught_up = state == "caught-up"
    bounds = histograms.BUCKETS[histograms.BATCH_APPLY_SECONDS]
    specs = _module("coordinator.metrics")
    counted = {**specs.FED_COUNTERS, **specs.FED_HISTOGRAMS}

    def labels(name: str, **values: str) -> list[str]:
        """The label values a worker of the tree sends for `name`: what its spec names, in its order."""
        return [values[label] for label in counted[name][1]]

    def count(name: str, value: float, **values: str) -> Any:
        return messages.CounterDelta(name, labels(name, **values), value)

    for session, view in enumerate(views, start=1):
        key = keys.connection_key(view.url)
        entry = node.map.get(key)
        counters = []
        for database in held:
            # A tree that places each (peer, database) pair on a worker of its own has no entry-wide worker.
            worker = entry.pairs[database].placed if hasattr(entry.pairs[database], "placed") else entry.worker
            node.on_worker_message(
                worker,
                messages.Connected(key=key, database=database, worker=worker, session=session, peer_head_seq=5000),
            )
            node.on_worker_message(
                worker,
                messages.Progress(
                    key=key,
                    database=database,
                    worker=worker,
                    session=session,
                    last_received_seq=5000 if caught_up else 1200,
                    peer_head_seq=5000,
                    lag_seconds=0.0 if caught_up else 42.5,
                    applied=1200,
                    caught_up=caught_up,
                    backlog=0 if caught_up else 5000,
                    received=1200,
                    session_applied=1200,
                    received_bytes=1200 * 120,
                ),
            )
            pair = {"database": database, "peer": view.name}
            counters += [
                count("replicator_records_applied_total", 1200.0, **pair),
                count("replicator_records_received_total", 1250.0, **pair),
                count("replicator_records_sent_total", 800.0, **pair),
            ]
        counters += [
            count(name, value, peer=view.name)
            for name, value in (
                ("replicator_bytes_sent_total", 9.6e7),
                ("replicator_bytes_received_total", 1.5e8),
                ("replicator_reconnect_attempts_total", 3.0),
            )
        ]
        node.on_worker_message(worker, messages.Heartbeat(worker=worker, rss_bytes=0, counters=counters))
        node.metrics.setup_connected(view.name, 0.8)
    written = [count("replicator_records_written_total", 400.0, database=database) for database in held]
    batch = [0, 0, 3, 5] + [0] * (len(bounds) - 3)
    name = histograms.BATCH_APPLY_SECONDS
    applies = [messages.HistogramDelta(name, labels(name, database=database), batch, 0.09) for database in held]
    rare = [count("replicator_checksum_failures_total", 1.0, database=names[0])]
    node.on_worker_message(0, messages.Heartbeat(worker=0, rss_bytes=0, counters=written + rare, histograms=applies))
    _antientropy_rounds(node, supervisor, messages, limited=(views[0].name, names[2 % len(names)]))
    return node


def _antientropy_rounds(node: Any, supervisor: StandInSupervisor, messages: Any, limited: tuple[str, str]) -> None:
    """One round per pair, started by the coordinator and answered as a worker answers it; the pair `limited`
    (peer, database) failed on a limit."""
    for entry in node.map:
        for index, database in enumerate(sorted(entry.pairs)):
            supervisor.sent.clear()
            node.antientropy.run_soon(entry.key, database, reason="scrape_size")
            started = [message for _, message in supervisor.sent if isinstance(message, messages.AntiEntropy)]
            if not started:
                continue
            divergent = index % 100 == 1  # 1 %: a round that found something and repaired it
            limit = "queries" if (entry.peer, database) == limited else ""
            node.on_worker_message(
                0,
                messages.AntiEntropyDone(
                    key=entry.key,
                    database=database,
                    round=started[0].round,
                    peer=entry.peer,
                    buckets_compared=300,
                    divergent_buckets=4 if divergent else 0,
                    repaired=7 if divergent else 0,
                    error="past its queries limit" if limit else "",
                    limit=limit,
                    seconds=0.05,
                ),
            )


def scrape(node: Any) -> bytes:
    """One scrape as the admin port's handler makes it: the scrape-time series prepared, then the text format of
    the node's registry (prometheus-client's exposition)."""
    exposition = importlib.import_module("prometheus_client.exposition")
    node.metrics.prepare()
    return exposition.generate_latest(node.metrics.registry)


def figures(text: bytes, databases: int) -> dict[str, Any]:
    parser = importlib.import_module("prometheus_client.parser")
    series = 0
    by_metric: Counter[str] = Counter()
    for family in parser.text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            series += 1
            if "database" in sample.labels:
                by_metric[family.name] += 1
    per_database = sum(by_metric.values()) / databases
    return {
        "bytes": len(text),
        "gzip_bytes": len(gzip.compress(text)),
        "series": series,
        "series_with_database": sum(by_metric.values()),
        "series_per_database": round(per_database, 2),
        "by_metric": {name: round(count / databases, 3) for name, count in sorted(by_metric.items())},
    }


def measure(options: argparse.Namespace) -> dict[str, Any]:
    code = options.code.resolve()
    started = time.perf_counter()
    node = build(code, options.databases, options.peers, options.state)
    built_s = time.perf_counter() - started
    scrape(node)  # the first scrape reads the certificate files and warms the collectors
    times, cpu = [], []
    text = b""
    for _ in range(options.repeat_scrapes):
        begin, begin_cpu = time.perf_counter(), time.process_time()
        text = scrape(node)
        times.append(time.perf_counter() - begin)
        cpu.append(time.process_time() - begin_cpu)
    result = {
        "code": str(code),
        "databases": options.databases,
        "peers": options.peers,
        "state": options.state,
        "build_s": round(built_s, 2),
        "scrape_ms": round(statistics.median(times) * 1000, 1),
        "scrape_ms_max": round(max(times) * 1000, 1),
        "scrape_cpu_ms": round(statistics.median(cpu) * 1000, 1),
        **figures(text, options.databases + 1),
    }
    result["targets_met"] = {
        "bytes": result["bytes"] < TARGET_BYTES,
        "scrape_s": result["scrape_ms"] / 1000 < TARGET_SCRAPE_S,
    }
    return result


FIGURES = ("bytes", "gzip_bytes", "series", "series_per_database", "scrape_ms", "scrape_cpu_ms")


def compare(options: argparse.Namespace, args: list[str]) -> dict[str, Any]:
    baseline_rev, current_rev, runs = harness.alternate(__file__, options.baseline, args, options.repeat)
    medians = {
        side: {name: harness.median([run[name] for run in found], 2) for name in FIGURES}
        for side, found in runs.items()
    }
    ratios = {name: harness.ratio(medians["current"][name], medians["baseline"][name]) for name in FIGURES}
    summary = {"baseline": medians["baseline"], "current": medians["current"], "ratios": ratios}
    return harness.comparison("scrape_size", options.repeat, baseline_rev, current_rev, summary, runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--databases", type=int, default=1000, help="databases the node and its peers hold (1000)")
    parser.add_argument("--peers", type=int, default=2, help="peers holding every database (default 2)")
    parser.add_argument("--state", choices=["converging", "caught-up"], default="converging")
    parser.add_argument("--repeat-scrapes", type=int, default=7, help="scrapes timed per measurement (default 7)")
    harness.comparison_options(parser)
    options = parser.parse_args()
    result = compare(options, harness.side_args(sys.argv[1:])) if options.baseline else measure(options)
    harness.print_json(result)


if __name__ == "__main__":
    main()
