"""`replicator node list|add|remove` against a running cluster: a node is removed from the registry and added back
with the commands, with or without revoking its certificate, and the cluster ends with the same data everywhere.

Three nodes, one worker each, `replication.mesh` on: a and b list each other in `[[peers]]`, c lists only a, so a
and b know c from the registry alone, which is what the commands change. Every step goes through the command line in
a real process; the checks read the admin ports.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from replicator.coordinator.local_cluster import LocalCluster
from replicator.shared import revocation
from replicator.shared.tls import certificate_identity, issue_node_cert
from tests.integration.conftest import FAST, assert_identical, cli, wait_for, write_many

DATABASE = "registry_test"
REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def _cluster(make_cluster: Callable[..., LocalCluster]) -> LocalCluster:
    return make_cluster(
        ["a", "b", "c"],
        workers=1,
        topology={"a": ["b"], "b": ["a"], "c": ["a"]},
        replication={**FAST, "mesh": True},
    )


async def replicator(cluster: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(cli, *args, token=cluster.admin_token, timeout=90)


async def node_list(cluster: LocalCluster, name: str) -> dict[str, dict[str, Any]]:
    done = await replicator(cluster, "node", "list", "--admin", cluster[name].admin_url, "--json")
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert document["node"] == name
    return {item["name"]: item for item in document["nodes"]}


async def _sessions_with(cluster: LocalCluster, name: str, peer: str) -> list[bool]:
    status, body = await cluster.admin(name, "/status")
    assert status == 200, body
    pairs = [d["connected"] for c in body["connections"] if c["peer"] == peer for d in c["databases"]]
    return pairs + [s["connected"] for s in body["sending"] if s["peer"] == peer]


async def _introduce_c(cluster: LocalCluster) -> None:
    """`node add c` on a, then wait until a and b both list c as connected."""
    done = await replicator(cluster, "node", "add", "c", "--url", cluster["c"].url, "--admin", cluster["a"].admin_url)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"introduced c ({cluster['c'].url}) through a"), done.stdout

    async def connected() -> bool:
        lists = [await node_list(cluster, name) for name in ("a", "b")]
        return all(listed.get("c", {}).get("connected") for listed in lists)

    await wait_for(connected, 90, "a and b to list c as connected")


async def _gone(cluster: LocalCluster, names: tuple[str, ...] = ("a", "b")) -> bool:
    for name in names:
        if "c" in await node_list(cluster, name) or any(await _sessions_with(cluster, name, "c")):
            return False
    return True


async def test_a_node_is_removed_and_added_back_with_the_commands(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = _cluster(make_cluster)
    a = cluster["a"].admin_url
    try:
        cluster.start()
        await cluster.wait_ready()
        await _introduce_c(cluster)
        for name in ("a", "b", "c"):
            await write_many(cluster, name, DATABASE, "t", [f"{name}-{i}" for i in range(20)], {"by": name})
        await cluster.wait_converged(DATABASE, timeout=60, expect_count=60)

        listed = await node_list(cluster, "b")
        assert sorted(listed) == ["a", "b", "c"]
        assert listed["b"]["self"] and listed["a"]["static"] and not listed["c"]["static"]
        assert listed["c"]["source"] == "own" and listed["c"]["last_seen_s"] == 0.0
        assert listed["c"]["pairs_connected"] == listed["c"]["pairs"] >= 2 and not listed["c"]["revoked"]
        table = await replicator(cluster, "node", "list", "--admin", a)
        assert table.returncode == 0 and "registry of node a" in table.stdout, table.stderr

        # Refused, each with what to do: c still runs; a is the node asked; no node zz.
        refused = await replicator(cluster, "node", "remove", "c", "--admin", a)
        assert refused.returncode == 2, refused.stderr
        assert "c is connected to a" in refused.stderr and "--revoke --ca DIR" in refused.stderr
        refused = await replicator(cluster, "node", "remove", "a", "--admin", a)
        assert refused.returncode == 2 and "a node cannot remove its own row" in refused.stderr
        refused = await replicator(cluster, "node", "remove", "zz", "--admin", a, "--json")
        assert refused.returncode == 2
        assert json.loads(refused.stdout)["error"] == (f"no node 'zz' in the registry of a at {a} (known: a, b, c)")
        assert "c" in await node_list(cluster, "a")  # nothing changed

        # Stopped, c is not connected and goes; its last session is remembered.
        assert cluster["c"].stop() == 0
        await wait_for(lambda: _not_connected(cluster), 60, "a and b to see c down")
        seen = (await node_list(cluster, "a"))["c"]
        assert seen["connected"] is False and seen["last_seen_s"] is not None and seen["last_seen_s"] >= 0
        removed = await replicator(cluster, "node", "remove", "c", "--admin", a, "--json")
        assert removed.returncode == 0, removed.stderr
        assert json.loads(removed.stdout) == {
            "ok": True,
            "name": "c",
            "through": "a",
            "removed": True,
            "revoked": None,
            "warnings": [],
        }
        await wait_for(lambda: _gone(cluster), 60, "c gone from the registry and the pairs of a and b")

        # Written while c is out, then c comes back: started, and introduced again.
        await write_many(cluster, "a", DATABASE, "t", [f"while-out-{i}" for i in range(10)], {"by": "a"})
        cluster["c"].start()
        await cluster.wait_ready(["c"])
        await _introduce_c(cluster)
        await write_many(cluster, "c", DATABASE, "t", ["back"], {"by": "c"})
        await cluster.wait_converged(DATABASE, timeout=90, expect_count=71)
        await assert_identical(cluster, [DATABASE])
    finally:
        await cluster.close()


async def _not_connected(cluster: LocalCluster) -> bool:
    lists = [await node_list(cluster, name) for name in ("a", "b")]
    return all(listed.get("c", {}).get("connected") is False for listed in lists)


async def test_a_running_node_is_revoked_and_removed_then_readmitted_with_a_new_certificate(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = _cluster(make_cluster)
    a, ca = cluster["a"].admin_url, str(cluster.dir / "ca")
    try:
        cluster.start()
        await cluster.wait_ready()
        await _introduce_c(cluster)
        await write_many(cluster, "c", DATABASE, "t", [f"c-{i}" for i in range(10)], {"by": "c"})
        await cluster.wait_converged(DATABASE, timeout=60, expect_count=10)

        # A bad CA folder changes nothing.
        refused = await replicator(cluster, "node", "remove", "c", "--admin", a, "--revoke", "--ca", "/nonexistent")
        assert refused.returncode == 2 and "--ca" in refused.stderr, refused.stderr
        assert (await node_list(cluster, "a"))["c"]["connected"]

        removed = await replicator(cluster, "node", "remove", "c", "--admin", a, "--revoke", "--ca", ca, "--json")
        assert removed.returncode == 0, removed.stderr
        document = json.loads(removed.stdout)
        assert document["removed"] is True and document["revoked"]["revokes"].startswith("c: every certificate")
        # Every session with c ends, c is in no registry, and it cannot write its way back in.
        await wait_for(lambda: _gone(cluster), 60, "c cut off and gone from the registry of a and b")
        await write_many(cluster, "b", DATABASE, "t", ["after-revoke"], {"by": "b"})
        await cluster.wait_converged(DATABASE, ["a", "b"], timeout=60, expect_count=11)
        assert not any(await _sessions_with(cluster, "a", "c"))

        # Re-admitted: a certificate issued after the revocation (certificate times have one-second precision, so
        # one issued within the revocation's second counts as revoked), a restart, and an introduction.
        assert cluster["c"].stop() == 0
        signed = int(document["revoked"]["id"].rsplit(".", 1)[1])  # NAME.all.SECONDS
        await wait_for(lambda: _issued_after(cluster, signed), 30, "a certificate of c the revocation spares")
        cluster["c"].start()
        await cluster.wait_ready(["c"])
        await _introduce_c(cluster)
        await cluster.wait_converged(DATABASE, timeout=90, expect_count=11)
        await assert_identical(cluster, [DATABASE])
        assert (await node_list(cluster, "b"))["c"]["revocations"] != []
    finally:
        await cluster.close()


def _issued_after(cluster: LocalCluster, signed: int) -> bool:
    """Issue c a new certificate; True once a revocation signed within second `signed` spares it."""
    cert_path, _ = issue_node_cert(cluster.dir / "ca", "c", ["127.0.0.1", "localhost"], cluster["c"].dir, force=True)
    identity = certificate_identity(x509.load_pem_x509_certificate(cert_path.read_bytes()))
    assert identity is not None
    latest = revocation.Revocation(name="c", issued_before=signed + 1.0, signature="")
    return not latest.revokes(identity)
