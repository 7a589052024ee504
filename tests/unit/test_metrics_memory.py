"""What the coordinator's metrics show and keep per (peer, database) pair (issues 12 and 23): an idle pair has only
the series every pair has, at 0, made at each scrape and kept by nothing; what a pair or a database rarely has
appears with its first count; the series of a node removed from the registry and of a database deleted here
disappear; a worker's delta that does not fit is dropped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from replicator.coordinator.node import Node
from replicator.coordinator.registry import NodeView
from replicator.shared import messages
from replicator.shared.histograms import BATCH_APPLY_SECONDS, BUCKETS
from replicator.shared.messages import CounterDelta, HistogramDelta
from replicator.shared.store import Store
from tests.unit.fakeloop import VirtualTimeLoop
from tests.unit.test_coordinator import add, connect, make_node, peer
from tests.unit.test_metrics import Samples, named, scrape

# Every pair has these: shown at 0 until counted.
PAIR_SERIES = (
    "replicator_records_applied_total",
    "replicator_records_sent_total",
    "replicator_antientropy_rounds_total",
)
# What a pair or a database rarely has: no series until the first count.
RARE_SERIES = (
    "replicator_antientropy_failures_total",
    "replicator_antientropy_records_repaired_total",
    "replicator_antientropy_limits_exceeded_total",
    "replicator_antientropy_divergent_buckets",
    "replicator_foreign_origin_refusals_total",
    "replicator_blobs_refused_total",
    "replicator_blob_transfers_aborted_total",
    "replicator_copy_remaining_records",
    "replicator_checksum_failures_total",
    "replicator_blobs_missing_total",
    "replicator_blob_check_bytes_total",
    "replicator_commit_retries_total",
    "replicator_records_written_total",
)


def _node_holding(loop: VirtualTimeLoop, databases: list[str], peers: tuple[str, ...] = ("b",)) -> Node:
    node, _ = make_node(loop)
    for index, name in enumerate(peers):
        add(node, peer(name, 2000 + 1000 * index, holds=tuple(databases)))
    node.holds = {*databases, "system"}
    loop.advance(5.0)
    return node


def _kept(node: Node) -> int:
    """Series the metrics hold between scrapes (the counters' and the worker histograms')."""
    metrics: Any = node.metrics
    counted = sum(len(series) for series in metrics._counters._values.values())
    return counted + sum(len(series) for series in metrics._histograms._series.values())


def _naming(samples: Samples, label: str, value: str) -> list[str]:
    """The samples that carry `label`=`value`, by name."""
    return sorted({name for (name, labels) in samples if (label, value) in labels})


@pytest.mark.parametrize("count", [10, 200])
def test_idle_pairs_show_only_what_every_pair_has_and_the_metrics_keep_none_of_it(
    loop: VirtualTimeLoop, count: int
) -> None:
    databases = [f"d{index:03d}" for index in range(count)]
    node = _node_holding(loop, databases, peers=("b", "c"))
    for database in (*databases, "system"):
        connect(node, peer("b", 2000), database, worker=0, session=1)
    kept = _kept(node)

    samples = scrape(node)
    scrape(node)

    for database in (*databases, "system"):
        for name in PAIR_SERIES:
            for name_of_peer in ("b", "c"):
                assert named(samples, name)[(("database", database), ("peer", name_of_peer))] == 0.0, (name, database)
    for name in RARE_SERIES:
        assert named(samples, name) == {}, name
    # Two peers: connected, records applied and sent, rounds, per pair; nothing else names a database.
    with_database = [key for key in samples if any(label == "database" for label, _ in key[1])]
    assert len(with_database) == 4 * 2 * (count + 1)
    # The batch histogram is the node's: one series whatever the number of databases.
    assert named(samples, f"{BATCH_APPLY_SECONDS}_count") == {(): 0.0}
    for name in ("replicator_reconnect_attempts_total", "replicator_bytes_sent_total"):
        assert named(samples, name) == {(("peer", "b"),): 0.0, (("peer", "c"),): 0.0}
    assert _kept(node) == kept  # whatever the number of databases: nothing per pair


def test_rare_series_appear_with_their_first_count(loop: VirtualTimeLoop) -> None:
    node = _node_holding(loop, ["db", "other"])
    node.metrics.apply(
        [
            CounterDelta("replicator_blobs_refused_total", ["b", "db"], 1.0),
            CounterDelta("replicator_checksum_failures_total", ["other"], 2.0),
            CounterDelta("replicator_records_written_total", ["db"], 3.0),
        ]
    )
    node.metrics.antientropy_round("b", "other", repaired=4, failed=True)
    node.metrics.antientropy_limit("b", "other", "queries")
    samples = scrape(node)
    assert named(samples, "replicator_blobs_refused_total") == {(("database", "db"), ("peer", "b")): 1.0}
    assert named(samples, "replicator_checksum_failures_total") == {(("database", "other"),): 2.0}
    assert named(samples, "replicator_records_written_total") == {(("database", "db"),): 3.0}
    assert named(samples, "replicator_antientropy_failures_total") == {(("database", "other"), ("peer", "b")): 1.0}
    assert named(samples, "replicator_antientropy_records_repaired_total") == {
        (("database", "other"), ("peer", "b")): 4.0
    }
    assert named(samples, "replicator_antientropy_limits_exceeded_total") == {
        (("database", "other"), ("limit", "queries"), ("peer", "b")): 1.0
    }


def test_the_series_of_a_removed_node_and_a_deleted_database_disappear(loop: VirtualTimeLoop, tmp_path: Path) -> None:
    node = _node_holding(loop, ["db", "other"], peers=("b", "c"))
    node.store = Store(tmp_path, "self")  # the deletion rewrites the node's own registry row
    # A registered node this one does not dial, subscribed to it: what it is sent is counted under its name.
    node.views["d"] = NodeView(name="d", url="wss://127.0.0.1:4000", holds=("other",))
    counted = [
        CounterDelta("replicator_records_applied_total", ["db", "c"], 5.0),
        CounterDelta("replicator_records_applied_total", ["other", "c"], 2.0),
        CounterDelta("replicator_records_applied_total", ["other", "b"], 8.0),
        CounterDelta("replicator_records_sent_total", ["db", "b"], 4.0),
        CounterDelta("replicator_records_sent_total", ["other", "d"], 6.0),
        CounterDelta("replicator_records_received_total", ["c"], 7.0),
        CounterDelta("replicator_bytes_sent_total", ["c"], 900.0),
        CounterDelta("replicator_foreign_origin_refusals_total", ["c", "other"], 1.0),
        CounterDelta("replicator_records_written_total", ["db"], 3.0),
        CounterDelta("replicator_records_written_total", ["other"], 9.0),
        CounterDelta("replicator_checksum_failures_total", ["db"], 1.0),
        CounterDelta("replicator_blob_check_bytes_total", ["other"], 10.0),
    ]
    node.on_worker_message(0, messages.Heartbeat(worker=0, rss_bytes=0, counters=counted))
    node.on_worker_message(0, messages.PeerClock(peer="c", offset_seconds=0.25))
    node.metrics.antientropy_round("c", "db", repaired=2, failed=False)
    node.metrics.antientropy_limit("b", "db", "queries")
    node.metrics.setup_connected("c", 1.5)
    node.stalls["c"] = 1
    samples = scrape(node)
    assert "replicator_setup_to_connected_seconds_count" in _naming(samples, "peer", "c")
    assert "replicator_checksum_failures_total" in _naming(samples, "database", "db")
    kept = _kept(node)

    # db is deleted here (coordinator.drops): its pairs go, then its file.
    node.drop_database_pairs("db")
    node.on_database_removed("db")
    # c leaves the registry (sync_registry: the views without it, then the removal).
    del node.views["c"]
    node.on_node_removed("c")
    # What the workers counted before they heard of either, in a heartbeat that arrives after.
    late = [
        CounterDelta("replicator_bytes_sent_total", ["c"], 100.0),
        CounterDelta("replicator_records_applied_total", ["db", "b"], 1.0),
    ]
    node.on_worker_message(0, messages.Heartbeat(worker=0, rss_bytes=0, counters=late))
    samples = scrape(node)

    assert _naming(samples, "peer", "c") == []
    assert _naming(samples, "database", "db") == []
    assert _kept(node) < kept  # dropped, not only hidden
    # What names a peer and a database the node still knows stays.
    assert named(samples, "replicator_records_applied_total") == {
        (("database", "other"), ("peer", "b")): 8.0,
        (("database", "system"), ("peer", "b")): 0.0,
    }
    assert named(samples, "replicator_records_sent_total")[(("database", "other"), ("peer", "d"))] == 6.0
    assert named(samples, "replicator_records_written_total") == {(("database", "other"),): 9.0}
    assert named(samples, "replicator_blob_check_bytes_total") == {(("database", "other"),): 10.0}
    assert named(samples, "replicator_setup_to_connected_seconds_count") == {(("peer", "b"),): 0.0}

    # The database made again and c back: their series start over.
    node.on_worker_message(0, messages.DatabaseOpened(name="db"))
    node.views["c"] = peer("c", 3000, holds=("db",))
    node.on_node_update(node.views["c"])
    samples = scrape(node)
    assert named(samples, "replicator_records_applied_total")[(("database", "db"), ("peer", "c"))] == 0.0
    assert named(samples, "replicator_bytes_sent_total")[(("peer", "c"),)] == 0.0


def test_a_worker_delta_that_does_not_fit_is_dropped_and_reported_once(
    loop: VirtualTimeLoop, capsys: pytest.CaptureFixture[str]
) -> None:
    node = _node_holding(loop, ["db"])
    capsys.readouterr()
    wrong = CounterDelta("replicator_records_applied_total", ["db"], 1.0)  # one label of two
    node.metrics.apply([wrong, wrong, CounterDelta("replicator_antientropy_rounds_total", ["b", "db"], 1.0)])
    counts = [1] + [0] * len(BUCKETS[BATCH_APPLY_SECONDS])
    node.metrics.apply_histograms([HistogramDelta(BATCH_APPLY_SECONDS, ["db"], counts, 0.25)])  # a label of none

    samples = scrape(node)
    assert set(named(samples, "replicator_records_applied_total").values()) == {0.0}
    assert named(samples, "replicator_antientropy_rounds_total")[(("database", "db"), ("peer", "b"))] == 0.0
    assert named(samples, f"{BATCH_APPLY_SECONDS}_count") == {(): 0.0}
    warnings = [line for line in capsys.readouterr().err.splitlines() if '"metric_unknown"' in line]
    assert len(warnings) == 3  # once per name: the workers do not feed the coordinator's own counters either
