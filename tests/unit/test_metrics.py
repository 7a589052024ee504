"""The coordinator's metrics on a node in virtual time: lag only once measured, setup-to-connected timed from the
dispatch, worker histograms merged from bucket counts, worker processes read with psutil, certificate expiry of what
the node loaded, the reload gauges, build info, a copy's series only while it runs; and the byte counting of a
session's socket (`workers.frames.Metered`)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import math
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
from aiohttp import WSMsgType
from cryptography import x509
from prometheus_client.parser import text_string_to_metric_families

from replicator.coordinator import metrics
from replicator.coordinator.credentials import Credentials
from replicator.coordinator.node import Node
from replicator.shared import messages, wire
from replicator.shared.histograms import BATCH_APPLY_SECONDS, BUCKETS, bucket
from replicator.shared.keys import connection_key
from replicator.shared.tls import create_ca, issue_node_cert, read_material
from replicator.workers import frames
from replicator.workers.counters import Counters
from tests.unit.fakeloop import VirtualTimeLoop
from tests.unit.test_coordinator import add, connect, make_node, peer

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(node: Node) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(node.metrics.render().decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def named(samples: Samples, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: value for (found, labels), value in samples.items() if found == name}


LAG = "replicator_replication_lag_seconds"


def progress(view: Any, database: str, session: int, **fields: Any) -> messages.Progress:
    values: dict[str, Any] = {"last_received_seq": 0, "peer_head_seq": 0, "lag_seconds": 0.0, "applied": 0}
    values.update(fields)
    return messages.Progress(key=connection_key(view.url), database=database, worker=0, session=session, **values)


# -- lag -----------------------------------------------------------------------------------------------------------


def test_lag_is_absent_until_the_pair_receives_a_batch(loop: VirtualTimeLoop) -> None:
    node, _ = make_node(loop)
    view = peer("b", 2000)
    add(node, view)
    loop.advance(5.0)
    assert named(scrape(node), LAG) == {}  # wanted, never connected: no lag, not a lag of 0
    connect(node, view, "db", worker=0, session=7)
    # The report a session sends as it connects, before any batch: still nothing measured.
    node.on_worker_message(0, progress(view, "db", 7, peer_head_seq=40))
    assert named(scrape(node), LAG) == {}
    assert ("replicator_peer_connected", (("database", "db"), ("peer", "b"))) in scrape(node)
    node.on_worker_message(0, progress(view, "db", 7, last_received_seq=10, peer_head_seq=40, lag_seconds=12.5,
                                       applied=10, received=10))  # fmt: skip
    assert named(scrape(node), LAG) == {(("database", "db"), ("peer", "b")): 12.5}
    # The link drops and comes back: the pair keeps its last measurement through the new session's first report.
    node.on_worker_message(
        0, messages.Disconnected(key=connection_key(view.url), database="db", worker=0, session=7, error="gone")
    )
    connect(node, view, "db", worker=0, session=8)
    node.on_worker_message(0, progress(view, "db", 8, last_received_seq=10, peer_head_seq=40, lag_seconds=12.5))
    assert named(scrape(node), LAG) == {(("database", "db"), ("peer", "b")): 12.5}
    # The system pair: caught up on its first (empty) batch is a measurement too.
    connect(node, view, "system", worker=0, session=9)
    node.on_worker_message(0, progress(view, "system", 9, caught_up=True))
    assert named(scrape(node), LAG)[(("database", "system"), ("peer", "b"))] == 0.0


# -- the alerts' counters at 0 -------------------------------------------------------------------------------------

SKEW = "replicator_clock_skew_refusals_total"
ROWS = "replicator_registry_rows_refused_total"
FOREIGN = "replicator_foreign_origin_refusals_total"


def test_the_alerts_peer_counters_show_zero_and_a_pairs_refusals_appear_with_the_first(loop: VirtualTimeLoop) -> None:
    node, _ = make_node(loop)
    add(node, peer("b", 2000, holds=("db",)))
    add(node, peer("c", 3000, holds=("db", "other")))
    node.holds = {"db", "other", "system"}
    loop.advance(5.0)
    samples = scrape(node)
    peers = {(("peer", "b"),): 0.0, (("peer", "c"),): 0.0}
    assert named(samples, SKEW) == peers
    assert named(samples, ROWS) == peers
    assert named(samples, FOREIGN) == {}  # per pair, and rare: no series before the first

    refused = [messages.CounterDelta(SKEW, ["c"], 1.0), messages.CounterDelta(FOREIGN, ["c", "other"], 3.0)]
    node.on_worker_message(0, messages.Heartbeat(worker=0, rss_bytes=0, counters=refused))
    samples = scrape(node)
    assert named(samples, SKEW) == {(("peer", "b"),): 0.0, (("peer", "c"),): 1.0}
    assert named(samples, FOREIGN) == {(("database", "other"), ("peer", "c")): 3.0}


def test_a_zero_series_entry_that_does_not_fit_its_counter_is_refused_at_import(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert metrics._zero_layouts()["replicator_antientropy_rounds_total"] == (0, 1)  # (peer, database), as Known.PAIRS
    assert metrics._zero_layouts()["replicator_records_applied_total"] == (1, 0)  # (database, peer)
    monkeypatch.setitem(metrics.ZERO_SERIES, "replicator_records_written_total", metrics.Known.PEERS)
    with pytest.raises(ValueError, match="replicator_records_written_total: labels"):
        metrics._zero_layouts()
    monkeypatch.setitem(metrics.ZERO_SERIES, "replicator_records_written_total", ("a", "b"))
    monkeypatch.setitem(metrics.ZERO_SERIES, "replicator_pair_stalls_total", metrics.Known.PEERS)
    with pytest.raises(ValueError, match="replicator_pair_stalls_total, which is not a counter"):
        metrics._zero_layouts()


# -- setup to connected ----------------------------------------------------------------------------------------------


SETUP = "replicator_setup_to_connected_seconds"


def test_setup_to_connected_is_timed_from_the_dispatch(loop: VirtualTimeLoop) -> None:
    node, supervisor = make_node(loop)
    view = peer("b", 2000)
    add(node, view)
    loop.advance(1.0)
    dispatched = {m.database: t for t, _, m in supervisor.of(messages.Subscribe)}
    assert set(dispatched) == {"system", "db"}
    loop.advance_to(dispatched["db"] + 2.0)
    connect(node, view, "db", worker=0, session=1)
    samples = scrape(node)
    assert samples[(SETUP + "_count", (("peer", "b"),))] == 1
    assert samples[(SETUP + "_sum", (("peer", "b"),))] == pytest.approx(2.0)
    assert samples[(SETUP + "_bucket", (("le", "1.0"), ("peer", "b")))] == 0
    assert samples[(SETUP + "_bucket", (("le", "2.5"), ("peer", "b")))] == 1
    # A reconnect the worker makes on its own (no dispatch) is not a setup.
    node.on_worker_message(
        0, messages.Disconnected(key=connection_key(view.url), database="db", worker=0, session=1, error="gone")
    )
    loop.advance(3.0)
    connect(node, view, "db", worker=0, session=2)
    assert scrape(node)[(SETUP + "_count", (("peer", "b"),))] == 1


# -- histograms from the workers -------------------------------------------------------------------------------------


def test_worker_histograms_add_up_per_bucket(loop: VirtualTimeLoop) -> None:
    node, _ = make_node(loop)
    counters = Counters()
    for seconds in (0.003, 0.003, 0.2, 40.0):
        counters.observe(BATCH_APPLY_SECONDS, seconds)
    deltas = counters.drain_histograms()
    assert [(d.name, d.labels, sum(d.counts), d.sum) for d in deltas] == [
        (BATCH_APPLY_SECONDS, [], 4, pytest.approx(40.206))
    ]
    assert counters.drain_histograms() == []  # drained: the next heartbeat carries only what is new
    node.on_worker_message(0, messages.Heartbeat(worker=0, rss_bytes=0, histograms=deltas))
    counters.observe(BATCH_APPLY_SECONDS, 0.0005)
    node.on_worker_message(1, messages.Heartbeat(worker=1, rss_bytes=0, histograms=counters.drain_histograms()))
    buckets = {
        dict(labels)["le"]: value for labels, value in named(scrape(node), BATCH_APPLY_SECONDS + "_bucket").items()
    }
    assert buckets["0.001"] == 1
    assert buckets["0.005"] == 3
    assert buckets["0.25"] == 4
    assert buckets["30.0"] == 4
    assert buckets["+Inf"] == 5
    assert len(buckets) == len(BUCKETS[BATCH_APPLY_SECONDS]) + 1
    samples = scrape(node)
    assert samples[(BATCH_APPLY_SECONDS + "_count", ())] == 5
    assert samples[(BATCH_APPLY_SECONDS + "_sum", ())] == pytest.approx(40.2065)


def test_a_histogram_delta_that_does_not_fit_is_dropped(loop: VirtualTimeLoop) -> None:
    node, _ = make_node(loop)
    bad = [
        messages.HistogramDelta("replicator_nonexistent_seconds", ["x"], [1], 1.0),
        messages.HistogramDelta(BATCH_APPLY_SECONDS, [], [1, 2], 1.0),  # wrong bucket count
        messages.HistogramDelta(BATCH_APPLY_SECONDS, ["orders"], [0] * (len(BUCKETS[BATCH_APPLY_SECONDS]) + 1), 1.0),
    ]
    node.on_worker_message(0, messages.Heartbeat(worker=0, rss_bytes=0, histograms=bad))
    assert named(scrape(node), BATCH_APPLY_SECONDS + "_count") == {(): 0.0}  # the node's one series, empty


# -- a copy ----------------------------------------------------------------------------------------------------------

COPY = "replicator_copy_remaining_records"


def test_a_pairs_copy_has_a_series_only_while_it_runs(loop: VirtualTimeLoop) -> None:
    node, _ = make_node(loop)
    view = peer("b", 2000)
    add(node, view)
    loop.advance(5.0)
    connect(node, view, "db", worker=0, session=1)
    assert named(scrape(node), COPY) == {}  # connected, nothing to copy
    node.on_worker_message(0, progress(view, "db", 1, peer_head_seq=900, backlog=900, received=300, applied=300))
    assert named(scrape(node), COPY) == {(("database", "db"), ("peer", "b")): 600.0}
    node.on_worker_message(
        0, progress(view, "db", 1, last_received_seq=900, peer_head_seq=900, backlog=900, received=900, caught_up=True)
    )
    assert named(scrape(node), COPY) == {}


# -- worker processes ------------------------------------------------------------------------------------------------

BUSY = "import sys, time\nsum(range(3_000_000))\nprint('ready', flush=True)\ntime.sleep(60)\n"


@contextlib.contextmanager
def busy_process() -> Iterator[subprocess.Popen[str]]:
    """A Python process that used some CPU and now sleeps (its CPU time stays put), killed on the way out."""
    with subprocess.Popen([sys.executable, "-c", BUSY], stdout=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout is not None and child.stdout.readline() == "ready\n"
            yield child
        finally:
            child.kill()


def _cpu(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def test_worker_processes_are_read_at_scrape_time_and_cpu_survives_a_replacement(loop: VirtualTimeLoop) -> None:
    node, supervisor = make_node(loop, slots=1)
    handle = supervisor.workers[0]
    worker = (("worker", "0"),)
    with busy_process() as first:
        handle.pid = first.pid
        samples = scrape(node)
        used = _cpu(first.pid)
        assert used > 0
        assert samples[("replicator_worker_cpu_seconds_total", worker)] == pytest.approx(used)
        assert samples[("replicator_worker_open_fds", worker)] == psutil.Process(first.pid).num_fds()
        rss = psutil.Process(first.pid).memory_info().rss
        assert samples[("replicator_worker_resident_bytes", worker)] == pytest.approx(rss, rel=0.1)
        first.kill()
        first.wait()
    # Dead before the supervisor noticed: no gauges, no error, and the CPU counter stays.
    samples = scrape(node)
    assert ("replicator_worker_open_fds", worker) not in samples
    assert ("replicator_worker_resident_bytes", worker) not in samples
    assert samples[("replicator_worker_cpu_seconds_total", worker)] == pytest.approx(used)
    handle.alive = False
    assert scrape(node)[("replicator_worker_cpu_seconds_total", worker)] == pytest.approx(used)
    with busy_process() as second:
        handle.alive, handle.pid = True, second.pid
        samples = scrape(node)
        assert samples[("replicator_worker_cpu_seconds_total", worker)] == pytest.approx(used + _cpu(second.pid))
        assert ("replicator_worker_open_fds", worker) in samples


# -- certificates and build ------------------------------------------------------------------------------------------


def test_certificate_expiry_is_that_of_the_loaded_certificate_not_the_file(
    loop: VirtualTimeLoop, tmp_path: Path
) -> None:
    node, _ = make_node(loop)
    assert named(scrape(node), "replicator_certificate_expiry_timestamp_seconds") == {}  # nothing loaded: no series
    ca_pem, _ = create_ca(tmp_path / "ca", days=400)
    cert_pem, key_pem = issue_node_cert(tmp_path / "ca", "self", ["127.0.0.1"], tmp_path / "node", days=90)
    node.credentials = Credentials(read_material(ca_pem, cert_pem, key_pem), generation=1, loaded_at=0.0)
    expiry = named(scrape(node), "replicator_certificate_expiry_timestamp_seconds")
    cert = x509.load_pem_x509_certificate(cert_pem.read_bytes())
    ca = x509.load_pem_x509_certificate(ca_pem.read_bytes())
    loaded = {
        (("certificate", "node"),): cert.not_valid_after_utc.timestamp(),
        (("certificate", "ca"),): ca.not_valid_after_utc.timestamp(),
    }
    assert expiry == loaded
    assert 89 * 86400 < expiry[(("certificate", "node"),)] - time.time() <= 90 * 86400
    # A renewed file is not what the node presents until it is loaded (a reload): the series stays.
    issue_node_cert(tmp_path / "ca", "self", ["127.0.0.1"], tmp_path / "node", days=300, force=True)
    assert named(scrape(node), "replicator_certificate_expiry_timestamp_seconds") == loaded


def test_the_reload_gauges_start_at_the_boot_and_follow_each_reload(loop: VirtualTimeLoop) -> None:
    node, _ = make_node(loop)
    booted = node.reload_health.last_success
    samples = scrape(node)
    assert samples[("replicator_config_last_reload_successful", ())] == 1.0
    assert samples[("replicator_config_last_reload_success_timestamp_seconds", ())] == booted
    node.reload_health.failed("tls: bad file")
    samples = scrape(node)
    assert samples[("replicator_config_last_reload_successful", ())] == 0.0
    assert samples[("replicator_config_last_reload_success_timestamp_seconds", ())] == booted
    node.reload_health.succeeded(booted + 60.0)
    samples = scrape(node)
    assert samples[("replicator_config_last_reload_successful", ())] == 1.0
    assert samples[("replicator_config_last_reload_success_timestamp_seconds", ())] == booted + 60.0


def test_build_info(loop: VirtualTimeLoop) -> None:
    node, _ = make_node(loop)
    (labels,) = named(scrape(node), "replicator_build_info")
    info = dict(labels)
    assert info["version"] == importlib.metadata.version("replicator")
    assert info["python"] == platform.python_version()
    assert info["event_loop"] == "tests"  # the module of the loop's class: this virtual one, asyncio, uvloop
    assert named(scrape(node), "replicator_build_info")[labels] == 1.0


def test_the_coordinators_own_process_is_exported(loop: VirtualTimeLoop) -> None:
    node, _ = make_node(loop)
    samples = scrape(node)
    assert samples[("process_open_fds", ())] > 0
    assert samples[("process_resident_memory_bytes", ())] > 0
    assert named(samples, "python_info")


# -- bytes on a session's socket -------------------------------------------------------------------------------------


class FakeSocket:
    def __init__(self, incoming: list[Any]) -> None:
        self.incoming = incoming
        self.sent: list[bytes] = []
        self.close_code = None

    async def receive(self) -> Any:
        return self.incoming.pop(0)

    async def send_bytes(self, data: bytes) -> None:
        self.sent.append(data)


async def test_a_metered_socket_counts_the_frames_bytes_per_peer() -> None:
    ack = wire.encode(wire.Ack(seq=1))
    raw = FakeSocket([SimpleNamespace(type=WSMsgType.BINARY, data=ack, extra=None)] * 2)
    counters = Counters()
    ws = frames.Metered(raw, counters, "b")
    assert isinstance(await frames.receive(ws), wire.Ack)
    assert isinstance(await frames.receive(ws), wire.Ack)
    await frames.send(ws, wire.Ack(seq=3))
    assert ws.close_code is None  # the rest is the socket's own
    deltas = {(d.name, tuple(d.labels)): d.value for d in counters.drain()}
    assert deltas == {
        (frames.BYTES_RECEIVED, ("b",)): 2 * len(ack),
        (frames.BYTES_SENT, ("b",)): len(raw.sent[0]),
    }
    raw.incoming.append(SimpleNamespace(type=WSMsgType.TEXT, data="hello", extra=None))
    with pytest.raises(wire.MalformedFrame):
        await frames.receive(ws)
    assert counters.drain() == []  # not a replication frame


def test_buckets_hold_values_up_to_their_bound() -> None:
    bounds = BUCKETS[BATCH_APPLY_SECONDS]
    assert bucket(bounds, 0.0) == 0
    assert bucket(bounds, bounds[0]) == 0  # le: an observation equal to the bound is in its bucket
    assert bucket(bounds, math.nextafter(bounds[0], 1.0)) == 1
    assert bucket(bounds, bounds[-1] * 2) == len(bounds)
