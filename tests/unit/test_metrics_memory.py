"""What the coordinator's metrics keep per (peer, database) pair (issue 12): the series of an idle pair are made at
each scrape, at 0, and kept by nothing; a counted series stays; a worker's delta that does not fit is dropped."""

from __future__ import annotations

from typing import Any

import pytest

from replicator.coordinator.node import Node
from replicator.shared.histograms import BATCH_APPLY_SECONDS, BUCKETS
from replicator.shared.keys import connection_key
from replicator.shared.messages import CounterDelta, HistogramDelta
from tests.unit.fakeloop import VirtualTimeLoop
from tests.unit.test_coordinator import add, make_node, peer
from tests.unit.test_metrics import named, scrape

PAIR_SERIES = (
    "replicator_records_applied_total",
    "replicator_records_sent_total",
    "replicator_antientropy_rounds_total",
    "replicator_antientropy_failures_total",
    "replicator_antientropy_records_repaired_total",
)
DATABASE_SERIES = ("replicator_checksum_failures_total", "replicator_blobs_missing_total")


def _node_holding(loop: VirtualTimeLoop, databases: list[str]) -> Node:
    node, _ = make_node(loop)
    add(node, peer("b", 2000, holds=tuple(databases)))
    node.holds = {*databases, "system"}
    loop.advance(5.0)
    return node


def _kept(node: Node) -> int:
    """Series the metrics hold between scrapes (the counters' and the apply histogram's)."""
    metrics: Any = node.metrics
    counted = sum(len(series) for series in metrics._counters._values.values())
    return counted + sum(len(series) for series in metrics._histograms._series.values())


@pytest.mark.parametrize("count", [10, 200])
def test_idle_pairs_show_every_series_at_zero_and_the_metrics_keep_none_of_them(
    loop: VirtualTimeLoop, count: int
) -> None:
    databases = [f"d{index:03d}" for index in range(count)]
    node = _node_holding(loop, databases)
    kept = _kept(node)

    samples = scrape(node)
    scrape(node)

    for database in (*databases, "system"):
        pair = (("database", database), ("peer", "b"))
        for name in PAIR_SERIES:
            assert named(samples, name)[pair] == 0.0, (name, database)
        for name in DATABASE_SERIES:
            assert named(samples, name)[(("database", database),)] == 0.0, (name, database)
        assert named(samples, f"{BATCH_APPLY_SECONDS}_count")[(("database", database),)] == 0.0
    for name in ("replicator_reconnect_attempts_total", "replicator_bytes_sent_total"):
        assert named(samples, name) == {(("peer", "b"),): 0.0}
    assert _kept(node) == kept  # whatever the number of databases: nothing per pair


def test_counted_series_stay_and_the_zeros_follow_the_wanted_pairs(loop: VirtualTimeLoop) -> None:
    node = _node_holding(loop, ["db", "other"])
    node.metrics.apply([CounterDelta("replicator_records_applied_total", ["db", "b"], 5.0)])
    counts = [1] + [0] * len(BUCKETS[BATCH_APPLY_SECONDS])
    node.metrics.apply_histograms([HistogramDelta(BATCH_APPLY_SECONDS, ["db"], counts, 0.25)])
    node.metrics.antientropy_round("b", "db", repaired=2, failed=False)
    applied = named(scrape(node), "replicator_records_applied_total")
    assert applied[(("database", "db"), ("peer", "b"))] == 5.0
    assert applied[(("database", "other"), ("peer", "b"))] == 0.0

    node.map.remove(connection_key("wss://127.0.0.1:2000"))
    node.holds = {"system"}
    samples = scrape(node)

    pair = (("database", "db"), ("peer", "b"))
    assert named(samples, "replicator_records_applied_total") == {pair: 5.0}
    assert named(samples, "replicator_antientropy_rounds_total") == {pair: 1.0}
    assert named(samples, "replicator_antientropy_records_repaired_total") == {pair: 2.0}
    assert named(samples, "replicator_records_sent_total") == {}
    system = (("database", "system"),)
    assert named(samples, f"{BATCH_APPLY_SECONDS}_count") == {(("database", "db"),): 1.0, system: 0.0}
    assert named(samples, "replicator_checksum_failures_total") == {system: 0.0}


def test_a_worker_delta_that_does_not_fit_is_dropped_and_reported_once(
    loop: VirtualTimeLoop, capsys: pytest.CaptureFixture[str]
) -> None:
    node = _node_holding(loop, ["db"])
    capsys.readouterr()
    wrong = CounterDelta("replicator_records_applied_total", ["db"], 1.0)  # one label of two
    node.metrics.apply([wrong, wrong, CounterDelta("replicator_antientropy_rounds_total", ["b", "db"], 1.0)])

    samples = scrape(node)
    assert set(named(samples, "replicator_records_applied_total").values()) == {0.0}
    assert named(samples, "replicator_antientropy_rounds_total")[(("database", "db"), ("peer", "b"))] == 0.0
    warnings = [line for line in capsys.readouterr().err.splitlines() if '"metric_unknown"' in line]
    assert len(warnings) == 2  # once per name: the workers do not feed the coordinator's own counters either
