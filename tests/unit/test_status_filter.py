"""`replicator status --peer/--database/--problems`: the status document narrowed the same way for the table and for
--json, an unknown peer or a database pattern matching nothing is a usage error naming what there is, and --check
checks what is shown."""

from __future__ import annotations

import pytest

from replicator.coordinator.inspect import (
    StatusFilterError,
    filter_status,
    pair_problem,
    render_status,
    status_problems,
)


def _pair(database: str, connected: bool = True, antientropy: dict | None = None) -> dict:
    return {
        "database": database,
        "connected": connected,
        "worker": 0,
        "setup_pending": False,
        "reconnect_attempts": 0 if connected else 3,
        "last_received_seq": 5,
        "lag_seconds": 0.0,
        "last_error": None if connected else "connection refused",
        "antientropy": antientropy,
    }


def _body() -> dict:
    return {
        "node": "a",
        "url": "wss://a:1",
        "workers": [{"id": 0, "pid": 10, "ready": True, "rss_bytes": 0, "restarts": 0}],
        "holds": ["orders-1", "orders-2", "system", "users"],
        "connections": [
            {
                "peer": "b",
                "url": "wss://b:1",
                "databases": [_pair("orders-1"), _pair("orders-2"), _pair("system"), _pair("users")],
            },
            {
                "peer": "c",
                "url": "wss://c:1",
                "databases": [
                    _pair("orders-1", connected=False),
                    _pair("orders-2"),
                    _pair("system", antientropy={"at": 0.0, "repaired": 0, "error": "peer unreachable"}),
                    _pair("users"),
                ],
            },
        ],
        "sending": [
            {"peer": "b", "database": "users", "connected": True, "error": None},
            {"peer": "c", "database": "orders-1", "connected": False, "error": "closed by peer"},
        ],
        "recovery": {"users": {"state": "recovering"}, "system": {"state": "recovered"}},
        "scrub": {"orders-2": {"at": 0.0, "damaged": 1, "digests_fixed": 0}, "users": {"at": 0.0, "damaged": 0}},
        "failed_over": {"orders-1": ["c"]},
        "clock_offsets": {"b": 0.1, "c": -0.2},
    }


def _pairs(body: dict) -> list[str]:
    return [f"{c['peer']}/{d['database']}" for c in body["connections"] for d in c["databases"]]


def test_peer_keeps_only_its_pairs_and_says_so() -> None:
    narrowed = filter_status(_body(), peers=["c"])

    assert _pairs(narrowed) == ["c/orders-1", "c/orders-2", "c/system", "c/users"]
    assert [s["peer"] for s in narrowed["sending"]] == ["c"]
    assert narrowed["clock_offsets"] == {"c": -0.2}
    assert narrowed["workers"] == _body()["workers"]  # not a pair's: always shown
    assert narrowed["filter"] == {
        "peers": ["c"],
        "databases": [],
        "problems": False,
        "pairs_shown": 4,
        "pairs_total": 8,
    }


def test_database_takes_names_and_shell_patterns() -> None:
    narrowed = filter_status(_body(), databases=["orders-*"])

    assert _pairs(narrowed) == ["b/orders-1", "b/orders-2", "c/orders-1", "c/orders-2"]
    assert narrowed["holds"] == ["orders-1", "orders-2"]
    assert narrowed["recovery"] == {} and list(narrowed["scrub"]) == ["orders-2"]
    assert narrowed["failed_over"] == {"orders-1": ["c"]}
    assert _pairs(filter_status(_body(), databases=["users"], peers=["b"])) == ["b/users"]


def test_problems_keeps_what_is_not_healthy() -> None:
    narrowed = filter_status(_body(), problems=True)

    assert _pairs(narrowed) == ["c/orders-1", "c/system"]
    assert [(s["peer"], s["database"]) for s in narrowed["sending"]] == [("c", "orders-1")]
    assert narrowed["recovery"] == {"users": {"state": "recovering"}}
    assert list(narrowed["scrub"]) == ["orders-2"]
    assert pair_problem(_pair("x")) is None
    assert pair_problem(_pair("x", connected=False)) == "not connected (3 reconnects, last error: connection refused)"


def test_a_healthy_node_shows_no_problems_in_the_table() -> None:
    body = {**_body(), "sending": [], "recovery": {}, "scrub": {}, "failed_over": {}}
    body["connections"] = [{"peer": "b", "url": "wss://b:1", "databases": [_pair("users")]}]
    text = render_status(filter_status(body, problems=True))

    assert "showing 0 of 1 pairs: problems only" in text
    assert text.rstrip().endswith("no problems")


def test_the_table_shows_only_the_pairs_kept() -> None:
    text = render_status(filter_status(_body(), peers=["b"], databases=["users"]))

    assert "showing 1 of 8 pairs: peer b, database users" in text
    rows = [line.split()[:2] for line in text.splitlines() if line.startswith(("b ", "c "))]
    assert rows == [["b", "users"]]


def test_check_fails_only_on_what_is_shown() -> None:
    assert status_problems(filter_status(_body(), peers=["b"])) == []
    assert status_problems(filter_status(_body(), peers=["c"], databases=["orders-1"])) == [
        "pair c/orders-1 is not connected (3 reconnects, last error: connection refused)"
    ]


@pytest.mark.parametrize(
    ("filters", "message"),
    [
        ({"peers": ["zz"]}, "--peer zz: node a has no pair with 'zz' (peers: b, c)"),
        (
            {"databases": ["nope*"]},
            "--database nope*: matches none of the 4 databases of node a (orders-1, orders-2, system, users)",
        ),
    ],
)
def test_an_unknown_peer_or_database_names_what_there_is(filters: dict, message: str) -> None:
    with pytest.raises(StatusFilterError) as caught:
        filter_status(_body(), **filters)
    assert str(caught.value) == message
