"""Seeing why nodes differ, on real processes: a record's history on the data API (`?history=true`), and `replicator
diff` listing the records two nodes hold differently, found through their digest trees, until they converge."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

from replicator.coordinator.local_cluster import LocalCluster
from tests.integration.conftest import cli, wait_for, write_many

REPO = Path(__file__).resolve().parents[2]
DATABASE = "why"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return cli(*args, timeout=120)


async def _version(cluster: LocalCluster, name: str, record_id: str) -> int | None:
    status, body = await cluster.data(name, "GET", f"/data/{DATABASE}/t/{record_id}")
    return body["version"] if status == 200 else None


async def test_a_records_history_lists_its_writes_updates_and_delete_newest_first(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(["a", "b"], workers=1, token="s3cret")
    cluster.start()
    try:
        await cluster.wait_ready()
        await cluster.wait_settled()  # the boot's renewals over: nothing but the test writes
        path = f"/data/{DATABASE}/t/x"
        written = []
        for value in (1, 2):
            status, body = await cluster.data("a", "PUT", path, {"n": value})
            assert status == 200, body
            written.append(body["version"])
        await wait_for(lambda: _seen(cluster, "b", written[1]), 60, "b to hold a's second version")
        status, body = await cluster.data("b", "PUT", path, {"n": 3})
        assert status == 200, body
        by_b = body["version"]
        await wait_for(lambda: _seen(cluster, "a", by_b), 60, "a to hold b's update")
        status, body = await cluster.data("a", "DELETE", path)
        assert status == 200, body
        deleted = body["version"]

        status, answer = await cluster.data("a", "GET", path + "?history=true")
        assert status == 200, answer
        assert answer["current"] == {"version": deleted, "origin": "a", "tombstone": True, "damaged": False}
        assert [(e["version"], e["origin"], e["tombstone"], e["local"]) for e in answer["history"]] == [
            (deleted, "a", True, True),
            (by_b, "b", False, False),
            (written[1], "a", False, True),
            (written[0], "a", False, True),
        ]
        times = [e["committed_at"] for e in answer["history"]]
        assert times == sorted(times, reverse=True)
        assert answer["truncated"] is False and answer["next_before"] is None and answer["pruned_before"] is None
        # A normal read of the deleted record is a 404; its history is still there.
        assert (await cluster.data("a", "GET", path))[0] == 404

        # Pages: two at a time, then the rest from where the first page stopped.
        status, page = await cluster.data("a", "GET", path + "?history=true&limit=2")
        assert status == 200 and page["truncated"] and page["reason"] == "limit"
        assert [e["version"] for e in page["history"]] == [deleted, by_b]
        status, rest = await cluster.data("a", "GET", path + f"?history=true&limit=2&before={page['next_before']}")
        assert status == 200 and [e["version"] for e in rest["history"]] == written[::-1] and not rest["truncated"]

        # The same refusals as a normal read, and the same token.
        status, body = await cluster.data("a", "GET", f"/data/{DATABASE}/t/never?history=true")
        assert (status, body["error"]) == (404, f"no record 'never' in {DATABASE}/t")
        assert (await cluster.data("a", "GET", f"/data/{DATABASE}/t/never"))[1] == body
        status, body = await cluster.data("a", "GET", "/data/nosuchdb/t/x?history=true")
        assert status == 404 and "unknown database 'nosuchdb'" in body["error"]
        status, body = await cluster.data("a", "GET", path + "?history=true&limit=1001")
        assert status == 400 and "limit must be 1 to 1000" in body["error"]
        url = cluster["a"].data_url + path + "?history=true"
        async with cluster.http.get(url, ssl=cluster.data_ssl) as response:
            assert response.status == 401
    finally:
        await cluster.close()


async def _seen(cluster: LocalCluster, name: str, version: int) -> bool:
    found = await _version(cluster, name, "x")
    return found is not None and found >= version


async def test_diff_lists_the_records_a_cut_link_left_different_then_nothing_once_healed(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(["a", "b"], workers=2, proxied=[("a", "b")])
    link = cluster.proxy("a", "b")
    cluster.start()
    try:
        await cluster.wait_ready()
        await cluster.wait_settled()
        await write_many(cluster, "a", DATABASE, "t", [f"r{i:04d}" for i in range(300)], {"n": 0})
        await cluster.wait_converged(DATABASE, timeout=60, expect_count=300)
        config = str(cluster["a"].config_path)  # the CLI sends its listen.admin_token (one token for the cluster)
        admins = ["--admin", cluster["a"].admin_url, "--admin", cluster["b"].admin_url, "--config", config]
        same = await asyncio.to_thread(_cli, "diff", "--database", DATABASE, *admins)
        assert same.returncode == 0 and "identical" in same.stdout, same.stdout + same.stderr
        before = {record_id: await _version(cluster, "a", record_id) for record_id in ("r0005", "r0010", "r0020")}

        link.cut()
        versions: dict[str, int] = {}
        for record_id in ("new-1", "new-2", "r0005"):
            status, body = await cluster.data("a", "PUT", f"/data/{DATABASE}/t/{record_id}", {"n": 1})
            assert status == 200, body
            versions[record_id] = body["version"]
        status, body = await cluster.data("b", "PUT", f"/data/{DATABASE}/t/r0010", {"n": 2})
        assert status == 200, body
        versions["r0010"] = body["version"]
        status, body = await cluster.data("b", "DELETE", f"/data/{DATABASE}/t/r0020")
        assert status == 200, body
        versions["r0020"] = body["version"]

        result = await asyncio.to_thread(_cli, "diff", "--database", DATABASE, *admins, "--json")
        assert result.returncode == 1, result.stdout + result.stderr
        found = json.loads(result.stdout)
        assert found["identical"] is False and found["truncated"] is False
        assert [node["name"] for node in found["nodes"]] == ["a", "b"]
        sides = {
            d["id"]: {
                name: None if side is None else (side["version"], side["origin"], side["tombstone"])
                for name, side in d["sides"].items()
            }
            for d in found["differences"]
        }
        assert sides == {
            "new-1": {"a": (versions["new-1"], "a", False), "b": None},
            "new-2": {"a": (versions["new-2"], "a", False), "b": None},
            "r0005": {"a": (versions["r0005"], "a", False), "b": (before["r0005"], "a", False)},
            "r0010": {"a": (before["r0010"], "a", False), "b": (versions["r0010"], "b", False)},
            "r0020": {"a": (before["r0020"], "a", False), "b": (versions["r0020"], "b", True)},
        }
        assert {d["id"]: d["newer"] for d in found["differences"]} == {
            "new-1": None,
            "new-2": None,
            "r0005": "a",
            "r0010": "b",
            "r0020": "b",
        }
        text = await asyncio.to_thread(_cli, "diff", "--database", DATABASE, *admins, "--limit", "2")
        assert text.returncode == 1, text.stdout + text.stderr
        assert "new-1" in text.stdout and "absent" in text.stdout and "stopped after 2 records" in text.stdout

        link.heal()
        await cluster.wait_converged(DATABASE, timeout=90, expect_count=301)

        async def identical() -> bool:
            healed = await asyncio.to_thread(_cli, "diff", "--database", DATABASE, *admins, "--json")
            return healed.returncode == 0 and json.loads(healed.stdout)["differences"] == []

        await wait_for(identical, 60, "diff to find the nodes identical once healed", interval=1.0)
    finally:
        await cluster.close()


async def test_the_tree_routes_refuse_what_is_past_their_caps_and_diff_names_an_unreachable_node(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(["a"], workers=1)
    cluster.start()
    try:
        await cluster.wait_ready()
        await write_many(cluster, "a", DATABASE, "t", [f"r{i}" for i in range(20)], 1)
        status, body = await cluster.admin("a", f"/digest/{DATABASE}/t/tree?level=0&nodes=0")
        assert status == 200 and len(body["children"]) == 1 and sum(c for c, _ in body["children"][0]) == 20
        status, body = await cluster.admin("a", f"/digest/{DATABASE}/t/rows?level=0&nodes=0")
        assert status == 200 and sorted(row[0] for row in body["rows"]) == sorted(f"r{i}" for i in range(20))
        for query, reason in [
            ("level=2&nodes=3,3", "asked for twice"),
            ("level=3&nodes=" + ",".join(map(str, range(257))), "at most 256"),
            ("level=1&nodes=99", "outside level 1"),
            ("nodes=0", "level is required"),
        ]:
            status, body = await cluster.admin("a", f"/digest/{DATABASE}/t/tree?{query}")
            assert status == 400 and reason in body["error"], (query, status, body)
        status, body = await cluster.admin("a", "/digest/nosuchdb/t/tree?level=0&nodes=0")
        assert status == 404, body
        url = cluster["a"].admin_url + f"/digest/{DATABASE}/t/rows?level=0&nodes=0"
        async with cluster.http.get(url) as response:  # no admin token
            assert response.status == 401

        config = str(cluster["a"].config_path)
        gone = await asyncio.to_thread(
            _cli,
            "diff",
            "--database",
            DATABASE,
            "--admin",
            cluster["a"].admin_url,
            "--admin",
            "http://127.0.0.1:9",
            "--config",
            config,
        )
        assert gone.returncode == 2 and "cannot reach http://127.0.0.1:9" in gone.stderr, gone.stderr
        one = await asyncio.to_thread(_cli, "diff", "--database", DATABASE, "--admin", cluster["a"].admin_url)
        assert one.returncode == 2 and "exactly two --admin" in one.stderr
        unauthorized = await asyncio.to_thread(
            _cli, "diff", "--database", DATABASE, "--admin", cluster["a"].admin_url, "--admin", cluster["a"].admin_url
        )
        assert unauthorized.returncode == 2 and "admin token" in unauthorized.stderr, unauthorized.stderr
        itself = await asyncio.to_thread(
            _cli,
            "diff",
            "--database",
            DATABASE,
            "--admin",
            cluster["a"].admin_url,
            "--admin",
            cluster["a"].admin_url,
            "--config",
            config,
        )
        assert itself.returncode == 0 and "identical" in itself.stdout, itself.stdout + itself.stderr
    finally:
        await cluster.close()
