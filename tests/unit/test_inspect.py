"""`replicator status` and `replicator verify`: the readable tables name what routing, recovery and anti-entropy
are doing, and `verify --json` prints one object of a fixed shape."""

from __future__ import annotations

import json

from replicator.coordinator.inspect import (
    render_status,
    render_verify,
    status_problems,
    status_summary,
    verify_document,
)


def test_status_names_failed_over_origins_and_recovering_databases() -> None:
    text = render_status(
        {
            "node": "a",
            "url": "wss://a:1",
            "workers": [],
            "connections": [],
            "failed_over": {"orders": ["c", "d"]},
            "recovery": {"orders": {"state": "recovering"}, "system": {"state": "recovered", "records": 3}},
        }
    )
    assert "failed over: orders receives c, d through other peers" in text
    assert "recovering: orders" in text
    assert "recovering: system" not in text


def test_status_of_a_node_without_routing_news_has_no_such_lines() -> None:
    text = render_status({"node": "a", "url": "wss://a:1", "workers": [], "connections": []})
    assert "failed over" not in text and "recovering" not in text


def _pair(database: str, antientropy: dict | None) -> dict:
    return {
        "database": database,
        "connected": True,
        "worker": 0,
        "setup_pending": False,
        "reconnect_attempts": 0,
        "last_received_seq": 5,
        "lag_seconds": 0.0,
        "last_error": None,
        "antientropy": antientropy,
    }


def _round(at: float, repaired: int = 0, error: str | None = None) -> dict:
    return {
        "at": at,
        "seconds": 0.2,
        "buckets_compared": 33,
        "divergent_buckets": 1 if repaired else 0,
        "repaired": repaired,
        "bytes": 900,
        "error": error,
    }


def test_status_shows_each_pairs_last_round_and_the_scrubs_findings() -> None:
    now = 1_700_000_000.0
    text = render_status(
        {
            "node": "a",
            "url": "wss://a:1",
            "workers": [],
            "connections": [
                {
                    "peer": "b",
                    "databases": [
                        _pair("orders", _round(now - 125, repaired=3)),
                        _pair("system", None),
                        _pair("users", _round(now - 30, error="peer unreachable")),
                    ],
                }
            ],
            "scrub": {
                "orders": {"at": now - 7200, "rows": 1500, "damaged": 2, "digests_fixed": 1},
                "system": {"at": now - 7200, "rows": 4, "damaged": 0, "digests_fixed": 0},
            },
        },
        now,
    )
    lines = text.splitlines()
    start = next(index for index, line in enumerate(lines) if line.startswith("peer "))
    header, _, orders, system, users = lines[start : start + 5]
    assert "anti-entropy" in header
    assert "2m ago, 3 fixed" in orders
    assert system.split()[-1] == "-"
    assert "30s ago FAILED" in users
    assert "anti-entropy failed: users with b: peer unreachable" in text
    assert "scrub: orders had 2 damaged records and 1 wrong bucket digests 2h ago" in text
    assert "scrub: system" not in text


def _digests(**by_node: str | None) -> dict:
    return {
        node: ({"items": {"count": 3, "digest": digest}} if digest is not None else None)
        for node, digest in by_node.items()
    }


def test_verify_json_document_without_and_with_repairs() -> None:
    same = verify_document(["a", "b"], {"orders": _digests(a="ff00", b="ff00")})
    assert same == {"identical": True, "nodes": ["a", "b"], "databases": 1, "differences": []}
    assert json.loads(json.dumps(same)) == same
    rounds = {
        "a": [
            {
                "peer": "b",
                "database": "orders",
                "buckets_compared": 33,
                "divergent_buckets": 2,
                "repaired": 4,
                "bytes": 900,
                "seconds": 0.1,
                "error": None,
            }
        ],
        "b": [],
    }
    differ = verify_document(
        ["a", "b"], {"orders": _digests(a="ff00", b="ee11"), "users": _digests(a="aa", b=None)}, rounds
    )
    assert differ["identical"] is False and differ["databases"] == 2
    assert differ["differences"] == ["orders/items: a=3/ff00 b=3/ee11", "users: missing on b"]
    assert differ["repairs"] == rounds


def test_verify_rendering_reports_what_each_node_repaired() -> None:
    failed = {
        "peer": "c",
        "database": "orders",
        "buckets_compared": 0,
        "divergent_buckets": 0,
        "repaired": 0,
        "bytes": 0,
        "seconds": 0.0,
        "error": "the pair is not connected",
    }
    repaired = {**failed, "peer": "b", "divergent_buckets": 2, "repaired": 4, "error": None}
    document = verify_document(
        ["a", "b", "c"],
        {"orders": _digests(a="ff00", b="ff00", c="ff00")},
        {"a": [repaired, failed], "b": [{**failed, "peer": "a", "error": None}]},
    )
    assert render_verify(document).splitlines() == [
        "repaired on a: orders from b: 4 records (2 buckets differed)",
        "round failed on a: orders with c: the pair is not connected",
        "nothing to repair on b (1 rounds)",
        "identical: 1 databases on a, b, c",
    ]
    different = verify_document(["a", "b"], {"orders": _digests(a="ff00", b="ee11")})
    assert render_verify(different).splitlines() == ["DIFFERENT on a, b:", "  orders/items: a=3/ff00 b=3/ee11"]


def _worker(slot: int, ready: bool, pid: int | None = 100, boot_error: str | None = None) -> dict:
    return {"id": slot, "pid": pid, "ready": ready, "rss_bytes": 0, "restarts": 0, "boot_error": boot_error}


def test_status_check_names_each_worker_not_ready_and_each_pair_not_connected() -> None:
    down = {**_pair("orders", None), "connected": False, "reconnect_attempts": 4, "last_error": "HTTP 403"}
    body = {
        "node": "a",
        "workers": [_worker(0, True), _worker(1, False, pid=None), _worker(2, False, boot_error="port in use")],
        "connections": [
            {"peer": "b", "databases": [_pair("system", None), down]},
            {"peer": "c", "databases": [{**_pair("system", None), "connected": False}]},
        ],
    }

    assert status_problems(body) == [
        "worker 1 is down (not running)",
        "worker 2 is down (pid 100, not ready): port in use",
        "pair b/orders is not connected (4 reconnects, last error: HTTP 403)",
        "pair c/system is not connected (0 reconnects)",
    ]
    assert status_summary(body) == "node a, workers ready 1/3, pairs connected 1/3"


def test_status_check_passes_a_healthy_node_and_fails_one_without_workers() -> None:
    healthy = {
        "node": "a",
        "workers": [_worker(0, True)],
        "connections": [{"peer": "b", "databases": [_pair("x", None)]}],
    }
    assert status_problems(healthy) == []
    assert status_problems({"node": "a", "workers": [], "connections": []}) == ["no worker is running"]
