"""Refusals and bad input at the replication endpoint: the session ends with a reason, the node keeps serving."""

from __future__ import annotations

import ssl
from pathlib import Path

import aiohttp
import msgspec
import pytest
from cryptography import x509

from replicator.coordinator.local_cluster import LocalCluster
from replicator.shared import revocation, wire
from replicator.shared.tls import client_context, create_ca, issue_node_cert
from tests.integration.conftest import wait_for


def _context_with(ca_pem: Path, cert: Path, key: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca_pem))
    context.load_cert_chain(str(cert), str(key))
    return context


async def _sessions(cluster: LocalCluster, name: str) -> dict[tuple[str, str], int]:
    """The node's sessions, leaving out the databases these tests create: a pair of a database that is still
    spreading legitimately reconnects once its excluded origins change as more peers come to hold it."""
    _, body = await cluster.admin(name, "/status")
    return {
        (c["peer"], d["database"]): d["session"]
        for c in body["connections"]
        for d in c["databases"]
        if not d["database"].startswith("after_")
    }


async def _worker_pids(cluster: LocalCluster, name: str) -> list[int]:
    _, body = await cluster.admin(name, "/status")
    return [w["pid"] for w in body["workers"]]


async def _dial(cluster: LocalCluster, context: ssl.SSLContext) -> aiohttp.ClientWebSocketResponse:
    return await cluster.http.ws_connect(
        cluster["a"].url + "/replication", protocols=[wire.SUBPROTOCOL], ssl=context, autoclose=False
    )


async def test_peers_without_a_valid_identity_are_refused_with_a_reason(mesh: LocalCluster, tmp_path: Path) -> None:
    ca_pem = mesh.dir / "ca" / "ca.pem"
    before = await _sessions(mesh, "b")
    pids = await _worker_pids(mesh, "a")

    # No client certificate at all.
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await _dial(mesh, client_context(ca_pem))
    assert refused.value.status == 401

    # A certificate from the cluster CA whose name is not in the registry.
    cert, key = issue_node_cert(mesh.dir / "ca", "mallory", ["127.0.0.1"], tmp_path)
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await _dial(mesh, client_context(ca_pem, cert, key))
    assert refused.value.status == 403
    reasons = [e["reason"] for e in mesh["a"].events("send_auth_refused") if e["peer"] == "mallory"]
    assert reasons and "not in the registry" in reasons[-1]

    # A certificate with a registered name, from another CA: the TLS handshake itself fails.
    create_ca(tmp_path / "other-ca")
    other_cert, other_key = issue_node_cert(tmp_path / "other-ca", "b", ["127.0.0.1"], tmp_path / "other")
    with pytest.raises((aiohttp.ClientError, ConnectionError)):
        await _dial(mesh, _context_with(ca_pem, other_cert, other_key))

    # A registered name whose certificate serial is revoked.
    revoked_cert, revoked_key = issue_node_cert(mesh.dir / "ca", "dora", ["127.0.0.1"], tmp_path / "dora")
    serial = format(x509.load_pem_x509_certificate(revoked_cert.read_bytes()).serial_number, "x")
    dora = {"url": "wss://127.0.0.1:9", "replicates": False}
    status, _ = await mesh.admin_request("a", "PUT", "/nodes/dora", dora)
    assert status == 200
    signed = msgspec.to_builtins(revocation.sign(mesh.dir / "ca", "dora", serial))
    status, _ = await mesh.admin_request("a", "PUT", "/nodes/dora/revocations", signed)
    assert status == 200
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await _dial(mesh, client_context(ca_pem, revoked_cert, revoked_key))
    assert refused.value.status == 403

    # The node kept serving everyone else: same workers, same sessions, data still flows.
    assert await _worker_pids(mesh, "a") == pids
    assert await _sessions(mesh, "b") == before
    assert (await mesh.data("b", "PUT", "/data/after_refusals/t/x", {"ok": True}))[0] == 200
    await mesh.wait_converged("after_refusals", timeout=30, expect_count=1)


@pytest.mark.parametrize(
    ("frame", "code", "reason"),
    [
        (b"\xc1\xff not msgpack", wire.CLOSE_MALFORMED, "malformed"),
        (msgspec.msgpack.encode({"type": "teleport", "to": "mars"}), wire.CLOSE_UNSUPPORTED, "unknown message type"),
        (wire.encode(wire.Ack(seq=1)), wire.CLOSE_MALFORMED, "expected Hello"),
        (b"x" * (2 * 1024 * 1024), wire.CLOSE_TOO_BIG, ""),
        ("a text frame", wire.CLOSE_UNSUPPORTED, "text frames"),
    ],
    ids=["malformed", "unknown-type", "out-of-order", "oversized", "text"],
)
async def test_bad_frames_close_that_session_only(
    mesh: LocalCluster, tmp_path: Path, frame: bytes | str, code: int, reason: str
) -> None:
    cert, key = issue_node_cert(mesh.dir / "ca", "probe", ["127.0.0.1"], tmp_path)
    probe = {"url": "wss://127.0.0.1:9", "replicates": False}
    status, _ = await mesh.admin_request("a", "PUT", "/nodes/probe", probe)
    assert status == 200
    before = await _sessions(mesh, "b")
    pids = await _worker_pids(mesh, "a")

    ws = await _dial(mesh, client_context(mesh.dir / "ca" / "ca.pem", cert, key))
    try:
        if isinstance(frame, str):
            await ws.send_str(frame)
        else:
            await ws.send_bytes(frame)
        message = await ws.receive(timeout=10)
    finally:
        await ws.close()
    assert message.type == aiohttp.WSMsgType.CLOSE
    assert message.data == code
    assert reason in (message.extra or "")

    assert await _worker_pids(mesh, "a") == pids
    assert await _sessions(mesh, "b") == before
    record = f"/data/after_frames/t/{code}-{len(reason)}"
    assert (await mesh.data("c", "PUT", record, {"ok": True}))[0] == 200

    async def arrived() -> bool:
        return (await mesh.data("a", "GET", record))[0] == 200

    await wait_for(arrived, 30, "a write on c to reach a")
