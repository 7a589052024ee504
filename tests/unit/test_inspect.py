"""`replicator status`: the readable table names what routing and recovery are doing."""

from __future__ import annotations

from coordinator.inspect import render_status


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
