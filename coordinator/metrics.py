"""Prometheus metrics, served by the coordinator at the admin port's `/metrics` with every worker's series.

The registry lives in the coordinator and workers feed it over their pipes (counter increments in each heartbeat),
rather than prometheus-client's multiprocess mode. Why: multiprocess mode keys its files by pid, so every
replaced worker leaves files behind and the series count grows with restarts unless a stable slot identity is
forced into it, and its gauges need a merge mode per metric. Here a replaced worker only stops sending increments:
counters never go backwards, and series are bounded by the label values (peers, databases, worker slots) that
exist. Histograms observed in a worker travel the same way, as counts per fixed bucket (`shared.histograms`).
Both are kept here as plain numbers by label values and rendered at scrape time (`_FedCounters`, `_FedHistograms`),
not as prometheus-client children: a child costs about 600 bytes, and a node holds several per (peer, database)
pair.

What a scrape costs grows with the series that scale with databases (issue 23: at 1,000 databases, 57 per database
with two peers made 4.6 MB and 0.8 s of the loop's CPU per scrape). So per (peer, database) pair there are only the
series an operator reads per pair: connected, lag, records applied and sent, anti-entropy rounds, and the copy
while one runs; histograms are per node; what a pair or a database rarely has (refusals, failures, limits, repairs,
divergent buckets, damaged records, missing or refused blobs) has a series only once it happened. Each labelled
counter has its series from its first count, except those of ZERO_SERIES, shown at 0 for what the node knows
before then: they are made at each scrape from the node's state and kept by nothing, so an idle database costs the
coordinator no metrics memory at all. A counted series goes with the peer or the database it names: once the
registry no longer lists the peer, or the node neither holds the database nor wants a pair of it, the next scrape
drops it (were it to come back, Prometheus sees a counter reset).
Gauges describing the current state (connected, lag, pending, rss) are computed at scrape time from the
coordinator's own state, so a pair that is gone has no series left; so are the worker processes' CPU, open files
and memory (psutil, by the pids the supervisor knows), the certificates' expiry (of those the node loaded and
presents, not of the files as they are now) and whether the last reload took. The
coordinator's own process is the standard `process_*` and `python_info` series.
"""

from __future__ import annotations

import enum
import importlib.metadata
import itertools
import math
import os
import platform
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import psutil
from prometheus_client import (
    CollectorRegistry,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from replicator.coordinator.admin_access import REASONS as ADMIN_REFUSALS
from replicator.coordinator.view import MetricsView
from replicator.shared import memory
from replicator.shared.histograms import BATCH_APPLY_SECONDS, BUCKETS, WRITE_CONFIRM_SECONDS
from replicator.shared.logs import log
from replicator.shared.messages import CounterDelta, HistogramDelta

if TYPE_CHECKING:
    from replicator.coordinator.supervisor import WorkerHandle

# The warnings most worth graphing when they are sampled; their suppressed counters start at 0 so a rate exists.
SAMPLED_EVENTS = (
    "send_auth_refused",
    "session_rejected",
    "stall_kick",
    "wedge_redrive",
    "registry_watcher_failed",
    "clock_skew_refused",
    "antientropy_failed",
    "checksum_failed",
    "request_failed",
    "connection_refused",
    "disk_full",
    "library_log",
    "registry_row_refused",
    "foreign_origin_refused",
    "commit_retry",
    "admin_request_refused",
    "admin_connection_refused",
    "blob_refused",
    "blob_transfer_aborted",
)
# The caps a refused connection names (workers.listener); their counters start at 0 so a rate exists.
CONNECTION_LIMITS = ("max_connections", "max_connections_per_client", "max_handshakes")

# Counters fed by the workers' increments: name -> (help, label names).
FED_COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "replicator_reconnect_attempts_total": ("Outbound reconnects scheduled", ("peer",)),
    "replicator_redials_deferred_total": (
        "Outbound redials that waited for the peer's redial budget (replication.redial_rate)",
        ("peer",),
    ),
    "replicator_records_applied_total": ("Records from peers that won and were applied", ("database", "peer")),
    "replicator_records_received_total": (
        "Records received from the peer in applied batches, won or not (a record received twice counts twice),"
        " all databases together",
        ("peer",),
    ),
    "replicator_commit_retries_total": (
        "Batches from peers whose commit failed (a busy or full disk) and was tried again; no series for a database"
        " until its first",
        ("database",),
    ),
    "replicator_commits_caught_by_poll_total": (
        "Commits that reached the waiting senders through the slow safety poll, not a notification"
        " (a lost doorbell, or a write made from outside the node)",
        (),
    ),
    "replicator_records_sent_total": ("Records sent to subscribers", ("database", "peer")),
    "replicator_records_written_total": (
        "Records written locally through the data API; no series for a database until its first",
        ("database",),
    ),
    "replicator_write_confirm_timeouts_total": (
        "Writes answered 504: committed here, but fewer other nodes than asked (?confirm=) held them in time; no"
        " series for a database until its first",
        ("database",),
    ),
    "replicator_read_after_timeouts_total": (
        "Reads answered 504: this node did not cover their session token (X-Replicator-After) in time; no series"
        " for a database until its first",
        ("database",),
    ),
    "replicator_clock_skew_refusals_total": (
        "Sessions refused because the peer's clock or versions ran ahead by more than max_clock_skew",
        ("peer",),
    ),
    "replicator_checksum_failures_total": (
        "Stored records found damaged (failed their checksum), each counted once when it was found; no series for"
        " a database until its first",
        ("database",),
    ),
    "replicator_blobs_missing_total": (
        "Records applied without their blob because the peer that sent them did not have it (repair-blobs); no"
        " series for a database until its first",
        ("database",),
    ),
    "replicator_blobs_refused_total": (
        "Blobs not fetched because their reference claims more than data.max_value_bytes (each record is applied"
        " without its blob); no series for a pair until its first",
        ("peer", "database"),
    ),
    "replicator_blob_transfers_aborted_total": (
        "Blob downloads cut for being slower than replication.blob_min_rate over a window or past their deadline"
        " (resumed by a later attempt); no series for a pair until its first",
        ("peer", "database"),
    ),
    "replicator_blob_check_bytes_total": (
        "Bytes of blob files hashed to check them before they are served to peers (once per version of a file and"
        " worker, not per request); no series for a database until its first",
        ("database",),
    ),
    "replicator_log_events_suppressed_total": ("Repeated identical warnings not written to the log", ("event",)),
    "replicator_registry_rows_refused_total": (
        "Registry rows a peer sent that were not signed by the node allowed to write them (not applied)",
        ("peer",),
    ),
    "replicator_foreign_origin_refusals_total": (
        "Records a peer held or sent under this node's origin at versions it never wrote; no series for a pair"
        " until its first",
        ("peer", "database"),
    ),
    "replicator_connections_refused_total": (
        "New node-port connections closed before TLS because a worker held its cap (listen.<limit>)",
        ("limit",),
    ),
    "replicator_bytes_sent_total": (
        "Bytes of replication frames sent to the peer, both ways of its sessions (WebSocket payloads)",
        ("peer",),
    ),
    "replicator_bytes_received_total": (
        "Bytes of replication frames received from the peer, both ways of its sessions (WebSocket payloads)",
        ("peer",),
    ),
    "replicator_frames_refused_total": (
        "Replication frames from the peer refused as larger than replication.max_frame_bytes (the session closed"
        " with 1009), both ways of its sessions",
        ("peer",),
    ),
}
# Counters fed by the coordinator's anti-entropy schedules (coordinator.antientropy), not by the workers.
ROUND_COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "replicator_antientropy_rounds_total": (
        "Anti-entropy rounds that ran to the end without an error",
        ("peer", "database"),
    ),
    "replicator_antientropy_failures_total": (
        "Anti-entropy rounds that ended with an error or did not answer in time; no series for a pair until its first",
        ("peer", "database"),
    ),
    "replicator_antientropy_records_repaired_total": (
        "Records anti-entropy changed on this node: pulled from the peer, or damaged ones removed; no series for a"
        " pair until its first",
        ("peer", "database"),
    ),
    "replicator_antientropy_limits_exceeded_total": (
        "Anti-entropy rounds that failed because the peer's answers took them past one of their limits"
        " (frontier, queries, bytes, time, answer); no series for a pair and limit until its first",
        ("peer", "database", "limit"),
    ),
}
# Counters of the coordinator's admin port (coordinator.admin_access, coordinator.admin_site); every reason at 0
# from the start.
ADMIN_COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "replicator_admin_refused_total": (
        "Admin requests refused (a Host or Origin that is not the admin port, no or a wrong admin token, a state"
        " change that is not JSON) and admin connections refused over listen.admin_max_connections",
        ("reason",),
    ),
}


class Known(enum.Enum):
    """Label values a counter's zero series take from the node's state at each scrape; the value names the labels."""

    PEERS = ("peer",)  # each wanted peer: the replication map, built from the registry and the config's [[peers]]
    PAIRS = ("peer", "database")  # each wanted (peer, database) pair


# Every counter shown at 0 before its first event, and what for: the node's wanted peers or pairs, or fixed values.
# A series that appears with its first event has no earlier sample to rise from, so increase() and rate() see
# nothing of that event: an alert in ops/alerts.yml that takes the increase() of a labelled counter that is not
# here must also catch the series that just appeared (`x unless last_over_time(x[1h] offset 15m)`;
# tests/integration/test_ops_files.py checks it). A counter without labels has its one series from the start. Per
# pair only what every pair has anyway is here (records applied and sent, rounds): a zero per pair of what a pair
# rarely has would be most of a scrape of a node with many databases. The zeros are made at each scrape and kept
# by nothing: a peer or pair the node no longer wants gets none, so they stay bounded by peers x databases.
ZERO_SERIES: dict[str, Known | tuple[str, ...]] = {
    # The alerts' counters.
    "replicator_clock_skew_refusals_total": Known.PEERS,  # ReplicatorClockSkew
    "replicator_registry_rows_refused_total": Known.PEERS,  # ReplicatorPeerForgery
    # Other counters worth a rate from the start (the dashboard's).
    "replicator_reconnect_attempts_total": Known.PEERS,
    "replicator_redials_deferred_total": Known.PEERS,
    "replicator_bytes_sent_total": Known.PEERS,
    "replicator_bytes_received_total": Known.PEERS,
    "replicator_frames_refused_total": Known.PEERS,
    "replicator_records_received_total": Known.PEERS,
    "replicator_records_applied_total": Known.PAIRS,
    "replicator_records_sent_total": Known.PAIRS,
    "replicator_antientropy_rounds_total": Known.PAIRS,
    "replicator_log_events_suppressed_total": SAMPLED_EVENTS,
    "replicator_connections_refused_total": CONNECTION_LIMITS,
    "replicator_admin_refused_total": ADMIN_REFUSALS,
}


def _zero_layouts() -> dict[str, tuple[int, ...]]:
    """For each counter of ZERO_SERIES shown for the node's state, where each of its labels sits in the `Known`
    values (a pair counter may put `database` first); a counter whose labels do not fit its entry is an error here,
    at import, not a scrape that fails later."""
    specs = {**FED_COUNTERS, **ROUND_COUNTERS, **ADMIN_COUNTERS}
    layouts: dict[str, tuple[int, ...]] = {}
    for name, source in ZERO_SERIES.items():
        if name not in specs:
            raise ValueError(f"ZERO_SERIES names {name}, which is not a counter of coordinator/metrics.py")
        labelnames = specs[name][1]
        if not isinstance(source, Known):
            if len(labelnames) != 1:
                raise ValueError(f"{name}: fixed zero series need exactly one label, it has {labelnames}")
            continue
        if sorted(labelnames) != sorted(source.value):
            raise ValueError(f"{name}: labels {labelnames} do not fit {source.name} {source.value}")
        layouts[name] = tuple(source.value.index(label) for label in labelnames)
    return layouts


_ZERO_LAYOUTS = _zero_layouts()


@dataclass(frozen=True)
class Scope:
    """What the node knows at one scrape: the peers and databases a counted series may name, and the label values
    of the zero series.

    `peers`: every node of the registry (with the config's [[peers]]) and every wanted peer; None before the first
    registry pass, when a peer is not yet known to be gone. `databases`: those the node holds and those of a
    wanted pair (a database deleted here that a peer still holds)."""

    peers: frozenset[str] | None
    databases: frozenset[str]
    known: Mapping[Known, list[tuple[str, ...]]]
    # (source, layout) -> the label values of `source` in that order, made once per scrape (`zeros`)
    _ordered: dict[tuple[Known, tuple[int, ...]], list[tuple[str, ...]]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @classmethod
    def of(cls, node: MetricsView) -> Scope:
        wanted = [(entry.peer,) for entry in node.map]
        pairs = [(entry.peer, database) for entry in node.map for database in entry.pairs]
        peers = frozenset([*node.views, *(peer for (peer,) in wanted)]) if node.views else None
        databases = frozenset([*node.holds, *(database for _, database in pairs)])
        return cls(peers, databases, {Known.PEERS: wanted, Known.PAIRS: pairs})

    def zeros(self, source: Known, layout: tuple[int, ...]) -> list[tuple[str, ...]]:
        """The label values of `source` in a counter's label order (`layout`), made once per scrape."""
        values = self.known[source]
        if layout == tuple(range(len(layout))):
            return values
        key = (source, layout)
        found = self._ordered.get(key)
        if found is None:
            found = self._ordered[key] = [tuple(each[index] for index in layout) for each in values]
        return found

    def gone(self, labels: tuple[str, ...], peer_at: int | None, database_at: int | None) -> bool:
        """Does the series name a peer or a database the node no longer knows?"""
        if peer_at is not None and self.peers is not None and labels[peer_at] not in self.peers:
            return True
        return database_at is not None and labels[database_at] not in self.databases


# Histograms fed by the workers: name -> (help, label names); their buckets are shared.histograms.BUCKETS[name].
# Per node: 16 series of buckets per database would be most of a scrape of a node with many databases, and a slow
# commit or confirmation is the disk's or the network's before it is one database's.
FED_HISTOGRAMS: dict[str, tuple[str, tuple[str, ...]]] = {
    BATCH_APPLY_SECONDS: (
        "Time to commit one batch from a peer (its records and marks in one transaction, retries included), all"
        " databases together",
        (),
    ),
    WRITE_CONFIRM_SECONDS: (
        "From a write's commit here to its last confirmation from other nodes (?confirm=), all databases together",
        (),
    ),
}
# From a subscribe dispatched to a worker while the pair was not connected to the pair's connected report: the
# dial, TLS, the handshake and any reconnects the worker's schedule made in between.
SETUP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

# `_created` series would double the series count for no use here.
disable_created_metrics()


def _version() -> str:
    try:
        return importlib.metadata.version("replicator")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


VERSION = _version()


class Metrics:
    def __init__(self, node: MetricsView) -> None:
        # The collectors of scrape-time series describe nothing (the node is not built yet when they register);
        # without names they are still asked when a scrape selects families with `?name[]=`.
        self.registry = CollectorRegistry(auto_describe=True, support_collectors_without_names=True)
        registry = self.registry
        self._counters = _FedCounters({**FED_COUNTERS, **ROUND_COUNTERS, **ADMIN_COUNTERS}, lambda: Scope.of(node))
        registry.register(self._counters)
        self._histograms = _FedHistograms()
        registry.register(self._histograms)
        self._setup_connected = Histogram(
            "replicator_setup_to_connected_seconds",
            "From a subscription setup dispatched to a worker (the pair not connected) to its session connected",
            ["peer"],
            buckets=SETUP_BUCKETS,
            registry=registry,
        )
        self._setup_peers: set[str] = set()  # the peers _setup_connected has a series of
        self._unknown_reported: set[str] = set()
        registry.register(_StateCollector(node))
        # The coordinator's own process: process_cpu_seconds_total, process_resident_memory_bytes, process_open_fds...
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        self._node = node
        log.on_suppressed = lambda event, n: self.suppressed(event, n)

    def suppressed(self, event: str, count: int) -> None:
        self._counters.inc("replicator_log_events_suppressed_total", (event,), count)

    def admin_refused(self, reason: str) -> None:
        self._counters.inc("replicator_admin_refused_total", (reason,), 1.0)

    def antientropy_round(self, peer: str, database: str, *, repaired: int, failed: bool) -> None:
        name = "replicator_antientropy_failures_total" if failed else "replicator_antientropy_rounds_total"
        self._counters.inc(name, (peer, database), 1.0)
        if repaired > 0:
            self._counters.inc("replicator_antientropy_records_repaired_total", (peer, database), repaired)

    def antientropy_limit(self, peer: str, database: str, limit: str) -> None:
        self._counters.inc("replicator_antientropy_limits_exceeded_total", (peer, database, limit), 1.0)

    def checksum_failures(self, database: str, count: int) -> None:
        if count > 0:
            self._counters.inc("replicator_checksum_failures_total", (database,), count)

    def apply(self, deltas: list[CounterDelta]) -> None:
        for delta in deltas:
            if delta.name not in FED_COUNTERS or not self._counters.fits(delta.name, delta.labels):
                if delta.name not in self._unknown_reported:
                    self._unknown_reported.add(delta.name)
                    log.warning("metric_unknown", name=delta.name, labels=len(delta.labels))
                continue
            if delta.value > 0:
                self._counters.inc(delta.name, tuple(delta.labels), delta.value)

    def apply_histograms(self, deltas: list[HistogramDelta]) -> None:
        for delta in deltas:
            if not self._histograms.add(delta) and delta.name not in self._unknown_reported:
                self._unknown_reported.add(delta.name)
                log.warning("metric_unknown", name=delta.name, labels=len(delta.labels), buckets=len(delta.counts))

    def setup_connected(self, peer: str, seconds: float) -> None:
        self._setup_connected.labels(peer).observe(max(0.0, seconds))
        self._setup_peers.add(peer)

    def prepare(self) -> None:
        """Bring the setup histogram in line with the node's peers; call it before each scrape.

        Each wanted peer has its series, empty before its first setup; a peer the registry no longer lists has none.
        The counters' zeros and the series they drop are the scrape's own (`_FedCounters.collect`)."""
        scope = Scope.of(self._node)
        if scope.peers is not None:
            for peer in sorted(self._setup_peers - scope.peers):
                self._setup_connected.remove(peer)
                self._setup_peers.discard(peer)
        for (peer,) in scope.known[Known.PEERS]:
            if peer not in self._setup_peers:
                self._setup_connected.labels(peer)
                self._setup_peers.add(peer)

    def render(self) -> bytes:
        """The Prometheus text format (the admin server negotiates the format itself, with `registry`)."""
        self.prepare()
        return generate_latest(self.registry)


class _FedCounters(Collector):
    """Counters kept as a number per label values and rendered at each scrape. A replaced worker only stops sending
    increments, so no counter goes backwards. A counted series stays while the node knows the peer and the
    database it names (`Scope`), and is dropped at the first scrape after. The zero series of ZERO_SERIES are
    shown for the node's wanted peers and pairs while they have not been counted: made for the scrape and kept by
    nothing."""

    def __init__(self, specs: Mapping[str, tuple[str, tuple[str, ...]]], scope: Callable[[], Scope]) -> None:
        self._specs = dict(specs)
        self._scope = scope
        self._lock = threading.Lock()  # a sampled warning logged from a thread counts its suppressed lines
        # name -> label values -> value; a metric without labels has its one series from the start
        self._values: dict[str, dict[tuple[str, ...], float]] = {
            name: ({(): 0.0} if not labelnames else {}) for name, (_, labelnames) in self._specs.items()
        }
        # name -> where its `peer` and `database` labels sit (None: it has none), for the counters with either
        self._named: dict[str, tuple[int | None, int | None]] = {
            name: (_index(labelnames, "peer"), _index(labelnames, "database"))
            for name, (_, labelnames) in self._specs.items()
            if {"peer", "database"} & set(labelnames)
        }
        # name -> the fixed label values of its zero series (ZERO_SERIES entries that are not `Known`)
        self._fixed: dict[str, list[tuple[str, ...]]] = {
            name: [(value,) for value in source]
            for name, source in ZERO_SERIES.items()
            if not isinstance(source, Known) and name in self._specs
        }

    def fits(self, name: str, labels: Iterable[str]) -> bool:
        spec = self._specs.get(name)
        return spec is not None and len(tuple(labels)) == len(spec[1])

    def inc(self, name: str, labels: tuple[str, ...], value: float) -> None:
        series = self._series(name, labels)
        with self._lock:
            series[labels] = series.get(labels, 0.0) + value

    def _series(self, name: str, labels: tuple[str, ...]) -> dict[tuple[str, ...], float]:
        if not self.fits(name, labels):
            raise ValueError(f"no counter {name} with {len(labels)} labels")
        return self._values[name]

    def _zeros(self, name: str, scope: Scope) -> list[tuple[str, ...]]:
        source = ZERO_SERIES.get(name)
        if isinstance(source, Known):
            return scope.zeros(source, _ZERO_LAYOUTS[name])
        return self._fixed.get(name, [])

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        scope = self._scope()
        for name, (documentation, labelnames) in self._specs.items():
            family = CounterMetricFamily(name, documentation, labels=labelnames)
            values = self._values[name]
            zeros = self._zeros(name, scope)
            with self._lock:
                named = self._named.get(name)
                if named is not None:
                    for labels in [labels for labels in values if scope.gone(labels, *named)]:
                        del values[labels]
                shown = dict.fromkeys(zeros, 0.0) if zeros else {}
                shown.update(values)
            for labels, value in sorted(shown.items()):
                family.add_metric(labels, value)
            yield family


def _index(labelnames: tuple[str, ...], label: str) -> int | None:
    return labelnames.index(label) if label in labelnames else None


class _FedHistograms(Collector):
    """The histograms workers observe, kept here as cumulative counts per bucket, like the fed counters: a replaced
    worker only stops sending, so no bucket goes backwards. A histogram without labels has its one series, empty,
    from the start."""

    def __init__(self) -> None:
        # name -> label values -> (count per bucket, +Inf last, not cumulative; sum)
        self._series: dict[str, dict[tuple[str, ...], tuple[list[float], list[float]]]] = {
            name: {} for name in FED_HISTOGRAMS
        }
        for name, (_, labelnames) in FED_HISTOGRAMS.items():
            if not labelnames:
                self.touch(name, ())

    def touch(self, name: str, labels: tuple[str, ...]) -> tuple[list[float], list[float]]:
        series = self._series[name]
        found = series.get(labels)
        if found is None:
            found = series[labels] = ([0.0] * (len(BUCKETS[name]) + 1), [0.0])
        return found

    def add(self, delta: HistogramDelta) -> bool:
        """Add a worker's counts; False when they do not fit the metric (name, labels or buckets)."""
        spec = FED_HISTOGRAMS.get(delta.name)
        if (
            spec is None
            or len(delta.labels) != len(spec[1])
            or len(delta.counts) != len(BUCKETS[delta.name]) + 1
            or any(count < 0 for count in delta.counts)
        ):
            return False
        counts, total = self.touch(delta.name, tuple(delta.labels))
        for index, count in enumerate(delta.counts):
            counts[index] += count
        total[0] += delta.sum
        return True

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        for name, (documentation, labelnames) in FED_HISTOGRAMS.items():
            family = HistogramMetricFamily(name, documentation, labels=labelnames)
            bounds = [floatToGoString(bound) for bound in (*BUCKETS[name], math.inf)]
            for labels, (counts, total) in sorted(self._series[name].items()):
                buckets = list(zip(bounds, itertools.accumulate(counts), strict=True))
                family.add_metric(labels, buckets, total[0])
            yield family


class _StateCollector(Collector):
    """Series computed at scrape time from the coordinator's state."""

    def __init__(self, node: MetricsView) -> None:
        self._node = node
        self._processes = _WorkerProcesses()

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        node = self._node
        scheduler = node.scheduler
        build = GaugeMetricFamily(
            "replicator_build_info",
            "Always 1: the replicator version, the Python version and the event loop the coordinator runs on",
            labels=["version", "python", "event_loop"],
        )
        build.add_metric([VERSION, platform.python_version(), type(node.loop).__module__.split(".")[0]], 1.0)
        yield build
        yield _counter(
            "replicator_setup_requests",
            "Subscription setup requests (node-update events)",
            scheduler.requests,
        )
        yield _counter("replicator_setup_armed", "Subscription setups newly armed", scheduler.armed)
        yield _counter(
            "replicator_setup_dispatched", "Subscription setups dispatched to a worker", scheduler.dispatched
        )
        yield _gauge("replicator_setup_pending", "Subscription setups armed and not yet fired", scheduler.pending)
        yield _counter("replicator_worker_restarts", "Workers respawned after an exit", node.supervisor.respawns)
        yield _gauge("replicator_workers_ready", "Workers running and ready", len(node.supervisor.live()))
        yield _gauge("replicator_workers_configured", "Workers the node is configured to run", node.config.worker_count)
        yield _counter("replicator_reassignments", "Pairs moved off a dead or missing worker", node.reassignments)
        redrives = CounterMetricFamily("replicator_redrives", "Recovery re-drives fired", labels=["kind"])
        for kind in ("wedge", "stall"):
            redrives.add_metric([kind], node.redrives[kind])
        yield redrives
        stalls = CounterMetricFamily(
            "replicator_pair_stalls",
            "Pairs found connected but not receiving while their peer was ahead, and renewed",
            labels=["peer"],
        )
        for peer, count in sorted(node.stalls.items()):
            stalls.add_metric([peer], count)
        yield stalls
        rss = GaugeMetricFamily("replicator_worker_rss_bytes", "Resident memory of each worker", labels=["worker"])
        for slot, handle in sorted(node.supervisor.workers.items()):
            if handle.alive:
                rss.add_metric([str(slot)], handle.rss_bytes)
        yield rss
        live = {slot: handle.pid for slot, handle in node.supervisor.workers.items() if handle.alive and handle.pid}
        found = memory.node_memory(os.getpid(), live)
        pss = GaugeMetricFamily(
            "replicator_worker_pss_bytes",
            "Proportional set size of each worker: its private pages and its share of the shared ones",
            labels=["worker"],
        )
        for slot, size in sorted(found.workers.items()):
            pss.add_metric([str(slot)], size)
        yield pss
        if found.coordinator is not None:
            own = found.coordinator
            yield _gauge("replicator_coordinator_pss_bytes", "Proportional set size of the coordinator", own)
        # The other processes the coordinator started (the worker template), and the node's total, as /status has it.
        yield _gauge(
            "replicator_helpers_pss_bytes",
            "Proportional set size of the other processes the coordinator started (the worker template)",
            sum(found.helpers.values()),
        )
        yield _gauge(
            "replicator_node_pss_bytes",
            "Proportional set size of the whole node: coordinator, workers and helpers; what it takes from the machine",
            found.total,
        )
        yield from self._processes.collect(node.supervisor.workers)
        yield _certificate_expiry(node)
        health = node.reload_health
        yield _gauge(
            "replicator_config_last_reload_successful",
            "1 when the last load of the config and TLS files (the boot, or a reload: SIGHUP) took; 0 when a reload"
            " failed and the node runs on what it had",
            1.0 if health.successful else 0.0,
        )
        yield _gauge(
            "replicator_config_last_reload_success_timestamp_seconds",
            "When the config and TLS files were last loaded successfully (the boot, or a reload), seconds since the"
            " epoch",
            health.last_success,
        )
        connected = GaugeMetricFamily(
            "replicator_peer_connected", "1 when the pair's session is connected", labels=["peer", "database"]
        )
        lag = GaugeMetricFamily(
            "replicator_replication_lag_seconds",
            "Age of the newest applied record while behind the peer; 0 when caught up; absent until the pair's"
            " first batch",
            labels=["database", "peer"],
        )
        divergent = GaugeMetricFamily(
            "replicator_antientropy_divergent_buckets",
            "Buckets that differed from the peer in the pair's last completed anti-entropy round; only for pairs"
            " whose last completed round found any (no series: none, or no round completed yet)",
            labels=["peer", "database"],
        )
        remaining = GaugeMetricFamily(
            "replicator_copy_remaining_records",
            "Records the pair's session still has to receive of what the sender held when it started: a copy's"
            " progress; only while the pair copies (no series: caught up, or not connected)",
            labels=["peer", "database"],
        )
        last_completed = node.antientropy.last_completed
        for entry in node.map:
            peer, key = entry.peer, entry.key
            for database, pair in sorted(entry.pairs.items()):
                connected.add_metric((peer, database), 1.0 if pair.connected else 0.0)
                if pair.progressed:  # a pair that never received a batch has no lag to report, not 0
                    lag.add_metric((database, peer), pair.lag_seconds)
                left = pair.copy_remaining
                if left > 0:
                    remaining.add_metric((peer, database), left)
                completed = last_completed(key, database)
                if completed is not None and completed.divergent_buckets > 0:
                    divergent.add_metric((peer, database), completed.divergent_buckets)
        yield connected
        yield remaining
        yield lag
        yield divergent
        offset = GaugeMetricFamily(
            "replicator_peer_clock_offset_seconds",
            "The peer's wall clock minus ours, measured at the last session handshake",
            labels=["peer"],
        )
        for peer, seconds in sorted(node.peer_clock.items()):
            offset.add_metric([peer], seconds)
        yield offset
        routed = GaugeMetricFamily(
            "replicator_origins_failed_over",
            "Direct peers whose writes other peers carry because their own link has been down",
            labels=["database"],
        )
        for database, origins in sorted(node.router.failed_over().items()):
            routed.add_metric([database], len(origins))
        yield routed
        recovering = GaugeMetricFamily(
            "replicator_databases_recovering", "Databases waiting for peers to serve this node's own writes back"
        )
        recovering.add_metric([], len(node.recoveries.recovering()))
        yield recovering
        yield _gauge(
            "replicator_databases_over_limit",
            "Databases peers hold that this node does not take: it holds data.max_databases already",
            len(node.database_limit.left_out()),
        )


class _WorkerProcesses:
    """CPU time, open files and resident memory of each worker process, read with psutil at scrape time by the pid
    the supervisor knows. A process that just exited has no gauges. A slot's CPU counter goes on from what its
    previous processes used (as last read), so it never goes backwards when a worker is replaced; what a process
    used after the last scrape before it exited is not counted."""

    def __init__(self) -> None:
        self._process: dict[int, psutil.Process] = {}  # slot -> its process as last read
        self._cpu_before: dict[int, float] = {}  # slot -> CPU seconds of its earlier processes
        self._cpu_last: dict[int, float] = {}  # slot -> CPU seconds of its current process, as last read

    def collect(self, workers: Mapping[int, WorkerHandle]) -> Iterator[Metric]:
        cpu = CounterMetricFamily(
            "replicator_worker_cpu_seconds",
            "CPU time (user and system) of each worker slot's processes",
            labels=["worker"],
        )
        fds = GaugeMetricFamily("replicator_worker_open_fds", "Open file descriptors of each worker", labels=["worker"])
        resident = GaugeMetricFamily(
            "replicator_worker_resident_bytes", "Resident memory of each worker, read at scrape time", labels=["worker"]
        )
        for slot, handle in sorted(workers.items()):
            reading = self._read(slot, handle.pid if handle.alive else 0)
            if reading is not None:
                fds.add_metric([str(slot)], reading[0])
                resident.add_metric([str(slot)], reading[1])
            if slot in self._cpu_last or slot in self._cpu_before:
                cpu.add_metric([str(slot)], self._cpu_before.get(slot, 0.0) + self._cpu_last.get(slot, 0.0))
        yield cpu
        yield fds
        yield resident

    def _read(self, slot: int, pid: int) -> tuple[int, int] | None:
        """(open fds, resident bytes) of the slot's process, its CPU noted; None when there is none to read."""
        if pid <= 0:
            return None
        process = self._process.get(slot)
        if process is None or process.pid != pid:
            if process is not None:  # the slot's process was replaced: what the old one used stays counted
                del self._process[slot]
                self._cpu_before[slot] = self._cpu_before.get(slot, 0.0) + self._cpu_last.pop(slot, 0.0)
            try:
                process = self._process[slot] = psutil.Process(pid)
            except psutil.Error:
                return None
        try:
            with process.oneshot():
                times = process.cpu_times()
                fds = process.num_fds()
                rss = process.memory_info().rss
        except psutil.Error:  # exited (or a zombie) since the supervisor last heard of it
            return None
        self._cpu_last[slot] = times.user + times.system
        return fds, rss


def _certificate_expiry(node: MetricsView) -> GaugeMetricFamily:
    """When the certificate the node presents and the CA that issued it stop being valid: those it loaded at boot or
    by its latest reload (coordinator.credentials), not the files, so the series moves when the node presents a
    renewed certificate. No series before the node has loaded them."""
    family = GaugeMetricFamily(
        "replicator_certificate_expiry_timestamp_seconds",
        "When the certificate stops being valid (not after), seconds since the epoch: the node's own (tls.cert) and"
        " the CA of tls.ca that issued it, as the node loaded them (boot or latest reload)",
        labels=["certificate"],
    )
    loaded = node.credentials
    if loaded is None:
        return family
    family.add_metric(["node"], loaded.certificate.not_valid_after_utc.timestamp())
    # A CA re-issued with the same key (a renewal) signs the same certificates: the one valid longest counts.
    issuers = loaded.issuers()
    if issuers:
        family.add_metric(["ca"], max(ca.not_valid_after_utc.timestamp() for ca in issuers))
    return family


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)
