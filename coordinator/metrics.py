"""Prometheus metrics, served by the coordinator at the admin port's `/metrics` with every worker's series.

The registry lives in the coordinator and workers feed it over their pipes (counter increments in each heartbeat),
rather than prometheus-client's multiprocess mode. Why: multiprocess mode keys its files by pid, so every
replaced worker leaves files behind and the series count grows with restarts unless a stable slot identity is
forced into it, and its gauges need a merge mode per metric. Here a replaced worker only stops sending increments:
counters never go backwards, and series are bounded by the label values (peers, databases, worker slots) that
exist. Gauges describing the current state (connected, lag, pending, rss) are computed at scrape time from the
coordinator's own state, so a pair that is gone has no series left.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from coordinator.view import MetricsView
from shared.logs import log
from shared.messages import CounterDelta

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
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
)
# The caps a refused connection names (workers.listener); their counters start at 0 so a rate exists.
CONNECTION_LIMITS = ("max_connections", "max_connections_per_client")
ANTIENTROPY_COUNTERS = (
    "replicator_antientropy_rounds_total",
    "replicator_antientropy_failures_total",
    "replicator_antientropy_records_repaired_total",
)

# `_created` series would double the series count for no use here.
disable_created_metrics()


class Metrics:
    def __init__(self, node: MetricsView) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        # Fed by the workers' increments.
        self._fed: dict[str, Counter] = {
            "replicator_reconnect_attempts_total": Counter(
                "replicator_reconnect_attempts_total",
                "Outbound reconnects scheduled",
                ["peer"],
                registry=registry,
            ),
            "replicator_records_applied_total": Counter(
                "replicator_records_applied_total",
                "Records from peers that won and were applied",
                ["database", "peer"],
                registry=registry,
            ),
            "replicator_records_received_total": Counter(
                "replicator_records_received_total",
                "Records received from peers in applied batches, won or not (a record received twice counts twice)",
                ["database", "peer"],
                registry=registry,
            ),
            "replicator_commit_retries_total": Counter(
                "replicator_commit_retries_total",
                "Batches from peers whose commit failed (a busy or full disk) and was tried again",
                ["database"],
                registry=registry,
            ),
            "replicator_records_sent_total": Counter(
                "replicator_records_sent_total",
                "Records sent to subscribers",
                ["database", "peer"],
                registry=registry,
            ),
            "replicator_records_written_total": Counter(
                "replicator_records_written_total",
                "Records written locally through the data API",
                ["database"],
                registry=registry,
            ),
            "replicator_clock_skew_refusals_total": Counter(
                "replicator_clock_skew_refusals_total",
                "Sessions refused because the peer's clock or versions ran ahead by more than max_clock_skew",
                ["peer"],
                registry=registry,
            ),
            "replicator_checksum_failures_total": Counter(
                "replicator_checksum_failures_total",
                "Stored records found damaged (failed their checksum), each counted once when it was found",
                ["database"],
                registry=registry,
            ),
            "replicator_blobs_missing_total": Counter(
                "replicator_blobs_missing_total",
                "Records applied without their blob because the peer that sent them did not have it (repair-blobs)",
                ["database"],
                registry=registry,
            ),
            "replicator_log_events_suppressed_total": Counter(
                "replicator_log_events_suppressed_total",
                "Repeated identical warnings not written to the log",
                ["event"],
                registry=registry,
            ),
            "replicator_registry_rows_refused_total": Counter(
                "replicator_registry_rows_refused_total",
                "Registry rows a peer sent that were not signed by the node allowed to write them (not applied)",
                ["peer"],
                registry=registry,
            ),
            "replicator_foreign_origin_refusals_total": Counter(
                "replicator_foreign_origin_refusals_total",
                "Records a peer held or sent under this node's origin at versions it never wrote",
                ["peer", "database"],
                registry=registry,
            ),
            "replicator_connections_refused_total": Counter(
                "replicator_connections_refused_total",
                "New node-port connections closed before TLS because a worker held its cap (listen.<limit>)",
                ["limit"],
                registry=registry,
            ),
        }
        # Fed by the coordinator's anti-entropy schedules (coordinator.antientropy).
        self._rounds: dict[str, Counter] = {
            "replicator_antientropy_rounds_total": Counter(
                "replicator_antientropy_rounds_total",
                "Anti-entropy rounds that ran to the end without an error",
                ["peer", "database"],
                registry=registry,
            ),
            "replicator_antientropy_failures_total": Counter(
                "replicator_antientropy_failures_total",
                "Anti-entropy rounds that ended with an error or did not answer in time",
                ["peer", "database"],
                registry=registry,
            ),
            "replicator_antientropy_records_repaired_total": Counter(
                "replicator_antientropy_records_repaired_total",
                "Records anti-entropy changed on this node: pulled from the peer, or damaged ones removed",
                ["peer", "database"],
                registry=registry,
            ),
        }
        self._unknown_reported: set[str] = set()
        for event in SAMPLED_EVENTS:
            self._fed["replicator_log_events_suppressed_total"].labels(event)
        for limit in CONNECTION_LIMITS:
            self._fed["replicator_connections_refused_total"].labels(limit)
        registry.register(_StateCollector(node))
        self._node = node
        log.on_suppressed = lambda event, n: self.suppressed(event, n)

    def suppressed(self, event: str, count: int) -> None:
        self._fed["replicator_log_events_suppressed_total"].labels(event).inc(count)

    def antientropy_round(self, peer: str, database: str, *, repaired: int, failed: bool) -> None:
        name = "replicator_antientropy_failures_total" if failed else "replicator_antientropy_rounds_total"
        self._rounds[name].labels(peer, database).inc()
        if repaired > 0:
            self._rounds["replicator_antientropy_records_repaired_total"].labels(peer, database).inc(repaired)

    def checksum_failures(self, database: str, count: int) -> None:
        if count > 0:
            self._fed["replicator_checksum_failures_total"].labels(database).inc(count)

    def apply(self, deltas: list[CounterDelta]) -> None:
        for delta in deltas:
            counter = self._fed.get(delta.name)
            if counter is None:
                if delta.name not in self._unknown_reported:
                    self._unknown_reported.add(delta.name)
                    log.warning("metric_unknown", name=delta.name)
                continue
            if delta.value > 0:
                counter.labels(*delta.labels).inc(delta.value)

    def render(self) -> bytes:
        # Every wanted pair has its counters from the start, at 0, so rate() works before the first record.
        for entry in self._node.map:
            self._fed["replicator_reconnect_attempts_total"].labels(entry.peer)
            for database in entry.pairs:
                self._fed["replicator_records_applied_total"].labels(database, entry.peer)
                self._fed["replicator_records_sent_total"].labels(database, entry.peer)
                for name in ANTIENTROPY_COUNTERS:
                    self._rounds[name].labels(entry.peer, database)
        for database in self._node.holds:
            self._fed["replicator_checksum_failures_total"].labels(database)
            self._fed["replicator_blobs_missing_total"].labels(database)
        return generate_latest(self.registry)


class _StateCollector(Collector):
    """Series computed at scrape time from the coordinator's state."""

    def __init__(self, node: MetricsView) -> None:
        self._node = node

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        node = self._node
        scheduler = node.scheduler
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
        rss = GaugeMetricFamily("replicator_worker_rss_bytes", "Resident memory of each worker", labels=["worker"])
        for slot, handle in sorted(node.supervisor.workers.items()):
            if handle.alive:
                rss.add_metric([str(slot)], handle.rss_bytes)
        yield rss
        connected = GaugeMetricFamily(
            "replicator_peer_connected", "1 when the pair's session is connected", labels=["peer", "database"]
        )
        lag = GaugeMetricFamily(
            "replicator_replication_lag_seconds",
            "Age of the newest applied record while behind the peer; 0 when caught up",
            labels=["database", "peer"],
        )
        divergent = GaugeMetricFamily(
            "replicator_antientropy_divergent_buckets",
            "Buckets that differed from the peer in the pair's last completed anti-entropy round",
            labels=["peer", "database"],
        )
        remaining = GaugeMetricFamily(
            "replicator_copy_remaining_records",
            "Records the pair's session still has to receive of what the sender held when it started (0 when caught"
            " up): a copy's progress",
            labels=["peer", "database"],
        )
        now = node.loop.time()
        for entry in node.map:
            for database, pair in sorted(entry.pairs.items()):
                copying = pair.copy(now)
                remaining.add_metric([entry.peer, database], copying["remaining"] if copying else 0.0)
                connected.add_metric([entry.peer, database], 1.0 if pair.connected else 0.0)
                lag.add_metric([database, entry.peer], pair.lag_seconds)
                completed = node.antientropy.last_completed(entry.key, database)
                if completed is not None:
                    divergent.add_metric([entry.peer, database], completed.divergent_buckets)
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
        recovering.add_metric([], len(node.recovering))
        yield recovering


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)
