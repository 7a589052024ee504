"""Revocation signed by the CA holds: every session of the revoked certificate ends, inbound and outbound, and
stays refused; a revocation not signed by the CA is refused; the node is re-admitted with a new certificate."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import msgspec

from replicator.coordinator.local_cluster import LocalCluster
from replicator.shared import revocation
from replicator.shared.tls import create_ca, issue_node_cert
from tests.integration.conftest import FAST, cli, wait_for

DATABASE = "guarded"


_cli = cli


async def _pairs_with(cluster: LocalCluster, name: str, peer: str) -> list[dict[str, Any]]:
    status, body = await cluster.admin(name, "/status")
    assert status == 200, body
    return [pair for c in body["connections"] if c["peer"] == peer for pair in c["databases"]]


async def test_a_revoked_certificate_loses_every_session_and_stays_out(make_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(["a", "b", "c"], workers=1, replication=dict(FAST))
    cluster.start()
    try:
        await cluster.wait_ready()
        assert (await cluster.data("a", "PUT", f"/data/{DATABASE}/t/x", {"v": 1}))[0] == 200
        await cluster.wait_converged(DATABASE, timeout=60, expect_count=1)
        await cluster.wait_connected(timeout=60, databases=[DATABASE])

        # A revocation signed by another CA is refused.
        create_ca(tmp_path / "other-ca")
        forged = revocation.sign(tmp_path / "other-ca", "c")
        status, body = await cluster.admin_request("a", "PUT", "/nodes/c/revocations", json.loads(_json(forged)))
        assert status == 400 and "not signed by the cluster CA" in body["error"]

        revoked_at = time.monotonic()
        revoked_wall = time.time()
        done = _cli(
            *("certs", "revoke", "--ca", str(cluster.dir / "ca"), "--name", "c", "--admin", cluster["a"].admin_url),
            *("--config", str(cluster["a"].config_path)),
        )
        assert done.returncode == 0, done.stderr

        async def cut_off() -> bool:
            pairs = [p for name in ("a", "b") for p in await _pairs_with(cluster, name, "c")]
            pairs += [p for name in ("a", "b") for p in await _pairs_with(cluster, "c", name)]
            return bool(pairs) and not any(p["connected"] for p in pairs)

        await wait_for(cut_off, 60, "every session with c's certificate to end")
        print(f"c cut off {time.monotonic() - revoked_at:.2f} s after the revocation was stored on a")
        # a and b still replicate with each other; c stays out.
        assert (await cluster.data("b", "PUT", f"/data/{DATABASE}/t/y", {"v": 2}))[0] == 200
        await cluster.wait_converged(DATABASE, ["a", "b"], timeout=30, expect_count=2)
        await _still_out(cluster)
        reasons = [
            e.get("reason", "") for e in cluster["a"].events() if e["event"] in ("session_revoked", "send_auth_refused")
        ]
        assert any("revoked" in reason for reason in reasons), reasons

        # Re-admitted with a certificate issued after the revocation. Certificate times have one-second precision:
        # one issued within the revocation's second counts as issued before it.
        assert cluster["c"].stop() == 0
        await asyncio.sleep(max(0.0, revoked_wall + 1.5 - time.time()))
        issue_node_cert(cluster.dir / "ca", "c", ["127.0.0.1", "localhost"], cluster["c"].dir, force=True)
        cluster["c"].start()
        await cluster.wait_ready(["c"])
        try:
            await cluster.wait_converged(DATABASE, timeout=40, expect_count=2)
        except TimeoutError:
            for name in ("a", "b", "c"):  # say why c is still out
                for event in cluster[name].events()[-300:]:
                    if "revoked" in str(event) or "refused" in str(event):
                        print(name, event)
            raise
    finally:
        await cluster.close()


def _json(found: revocation.Revocation) -> bytes:
    return msgspec.json.encode(found)


async def _still_out(cluster: LocalCluster) -> None:
    for name in ("a", "b"):
        assert not any(p["connected"] for p in await _pairs_with(cluster, name, "c")), name
