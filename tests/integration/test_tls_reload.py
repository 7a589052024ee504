"""TLS files reloaded with SIGHUP on real nodes: a certificate renewed and the cluster CA rotated (ops/RUNBOOK.md,
"Renewing a certificate and rotating the CA") under continuous writes, with no restart and no write lost; and bad
files that fail the reload while the node keeps serving, and keeps presenting, what it had.

What a node presents is read off the wire: handshakes with its node port, and /status, where each worker reports the
certificate it presents."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
import socket
import ssl
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
from cryptography import x509
from prometheus_client.parser import text_string_to_metric_families

from replicator.coordinator.local_cluster import HOST, LocalCluster
from replicator.shared import wire
from replicator.shared.tls import client_context, create_ca, fingerprint, issue_node_cert
from tests.certificates import BAD_FILES, install
from tests.integration.conftest import assert_identical, assert_log_is_json, cli, wait_for
from tests.integration.ledger import Ledger

DATABASE = "rotation"
HANDSHAKES = 8  # connections per check: the kernel spreads them over the node's workers (SO_REUSEPORT)


def serial_of(path: Path) -> str:
    return format(x509.load_pem_x509_certificate(path.read_bytes()).serial_number, "x")


def subject_of(path: Path) -> str:
    return x509.load_pem_x509_certificate(path.read_bytes()).subject.rfc4514_string()


def trust_file(cluster: LocalCluster, name: str) -> Path:
    """The node's CA bundle (`tls.ca`), a file of its own as on a real host (RUNBOOK.md, "Install")."""
    return cluster[name].dir / "trust.pem"


def own_trust(cluster: LocalCluster) -> None:
    for name, node in cluster.nodes.items():
        shutil.copyfile(cluster.dir / "ca" / "ca.pem", trust_file(cluster, name))
        node.extra["tls"] = {"ca": "trust.pem"}


async def status(cluster: LocalCluster, name: str) -> dict[str, Any]:
    code, body = await cluster.admin(name, "/status")
    assert code == 200, body
    return body


async def scrape(cluster: LocalCluster, name: str) -> dict[tuple[str, tuple], float]:
    node = cluster[name]
    async with cluster.http.get(node.admin_url + "/metrics", headers=node.admin_headers) as response:
        assert response.status == 200
        text = await response.text()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("replicator_")
    }


async def presented(cluster: LocalCluster, name: str, ca_file: Path) -> set[str]:
    """The serials of the certificates the node port presents to new handshakes, verified against `ca_file`."""
    context = client_context(ca_file)
    serials = set()
    for _ in range(HANDSHAKES):
        async with asyncio.timeout(30):
            _, writer = await asyncio.open_connection(HOST, cluster[name].port, ssl=context)
        try:
            der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
            serials.add(format(x509.load_der_x509_certificate(der).serial_number, "x"))
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                await writer.wait_closed()
    return serials


async def wait_presenting(cluster: LocalCluster, name: str, serial: str, cas: list[Path] | None = None) -> None:
    """Until the node has loaded the certificate `serial` (and trusts exactly the CAs of `cas`) and every one of its
    workers reports presenting that load."""

    async def loaded() -> bool:
        body = await status(cluster, name)
        tls = body["tls"]
        workers = [worker for worker in body["workers"] if worker["ready"]]
        trusted = [ca["fingerprint"] for ca in tls["cas"]]
        return (
            tls["certificate"]["serial"] == serial
            and (cas is None or trusted == [fingerprint(x509.load_pem_x509_certificate(p.read_bytes())) for p in cas])
            and len(workers) == cluster.workers
            and all(w["tls_serial"] == serial and w["tls_generation"] == tls["generation"] for w in workers)
        )

    await wait_for(loaded, 60, f"{name} to present {serial}")


async def sessions(cluster: LocalCluster) -> dict[tuple[str, str, str], int]:
    found = {}
    for name in cluster.nodes:
        for connection in (await status(cluster, name))["connections"]:
            for pair in connection["databases"]:
                found[(name, connection["peer"], pair["database"])] = pair["session"]
    return found


async def renew_pair(cluster: LocalCluster, name: str, peer: str) -> None:
    """End the pair's session and wait for the next one: a new handshake, both ways verified, with what each end
    presents and trusts now."""
    before = (await sessions(cluster))[(name, peer, DATABASE)]
    code, body = await cluster.admin_request(name, "POST", f"/pairs/{peer}/{DATABASE}/reset")
    assert code == 202 and body["reset"], body

    async def renewed() -> bool:
        for connection in (await status(cluster, name))["connections"]:
            for pair in connection["databases"]:
                if (connection["peer"], pair["database"]) == (peer, DATABASE):
                    return pair["connected"] and pair["session"] != before
        return False

    await wait_for(renewed, 60, f"a new session {name}->{peer}")


async def replication_answer(cluster: LocalCluster, name: str, ca_file: Path, cert: Path, key: Path) -> int | str:
    """What the node's replication endpoint does with a client presenting `cert`: an HTTP status, or "refused" when
    the TLS handshake does not take it."""
    context = client_context(ca_file)
    context.load_cert_chain(cert, key)  # client_context would refuse a certificate of a CA it does not trust
    try:
        url = cluster[name].url + "/replication"
        ws = await cluster.http.ws_connect(url, ssl=context, protocols=[wire.SUBPROTOCOL])
    except aiohttp.WSServerHandshakeError as exc:
        return exc.status
    except (aiohttp.ClientError, ssl.SSLError, ConnectionError):
        return "refused"
    await ws.close()
    return 101


async def install_bundle(cluster: LocalCluster, cas: list[Path]) -> None:
    bundle = cluster.dir / "bundle.pem"
    bundle.write_bytes(b"".join(path.read_bytes() for path in cas))
    for name in cluster.nodes:
        install(bundle, trust_file(cluster, name))
        cluster[name].signal(signal.SIGHUP)


@pytest.mark.timeout(300)
async def test_a_certificate_is_renewed_and_the_ca_rotated_without_a_restart_or_a_lost_write(
    make_cluster: Any, tmp_path: Path
) -> None:
    names = ["a", "b", "c"]
    cluster: LocalCluster = make_cluster(names, workers=2)
    own_trust(cluster)
    old_ca, new_ca = cluster.dir / "ca" / "ca.pem", tmp_path / "new-ca" / "ca.pem"
    # A certificate of the old CA, to show when the nodes stop trusting it.
    probe_old = issue_node_cert(cluster.dir / "ca", "a", [HOST], tmp_path / "probe-old")
    ledger = Ledger(cluster, DATABASE)
    stop = asyncio.Event()
    killing = asyncio.Event()  # while b's worker is killed and respawned, a write to b may lose its connection

    async def writer(name: str) -> None:
        n = 0
        while not stop.is_set():
            try:
                await ledger.put(name, f"{name}-{n:06d}", {"n": n})  # fails the test on anything but 200
            except aiohttp.ClientConnectionError:
                if not killing.is_set() or name != "b":
                    raise
                # Its connection went with the worker killed below: the same write again (an upsert of the same
                # value; the ledger holds the version acknowledged).
                await asyncio.sleep(0.1)
                continue
            n += 1
            await asyncio.sleep(0.01)

    cluster.start()
    a_admin = cluster["a"].admin_url
    writers: list[asyncio.Task[None]] = []
    try:
        await cluster.wait_ready()
        writers = [asyncio.create_task(writer(name)) for name in names]
        await wait_for(lambda: len(ledger.acked) >= 30, 60, "the first writes")
        await cluster.wait_settled(timeout=90)
        started = {name: await pids(cluster, name) for name in names}

        # 1. a's certificate renewed from the same CA: installed over its files, SIGHUP.
        live = await sessions(cluster)
        renewed_cert, renewed_key = issue_node_cert(cluster.dir / "ca", "a", [HOST, "localhost"], tmp_path / "renew")
        install(renewed_key, cluster["a"].dir / "a.key", 0o600)
        install(renewed_cert, cluster["a"].dir / "a.pem")
        assert await presented(cluster, "a", old_ca) != {serial_of(renewed_cert)}  # installed is not presented
        cluster["a"].signal(signal.SIGHUP)
        await wait_presenting(cluster, "a", serial_of(renewed_cert))
        assert await presented(cluster, "a", old_ca) == {serial_of(renewed_cert)}
        assert await sessions(cluster) == live  # the live sessions went on
        await renew_pair(cluster, "b", "a")  # a new handshake with the renewed certificate, both ways
        await renew_pair(cluster, "a", "c")

        # A revocation of the old CA, of a node long gone: it must keep counting after the rotation.
        token = cluster.admin_token
        revoked = await asyncio.to_thread(
            cli, "certs", "revoke", "--ca", str(cluster.dir / "ca"), "--name", "gone", "--admin", a_admin, token=token
        )
        assert revoked.returncode == 0, revoked.stderr

        # 2. The CA rotated. First every node trusts the old CA and the new one.
        create_ca(tmp_path / "new-ca")
        assert subject_of(new_ca) != subject_of(old_ca)
        await install_bundle(cluster, [old_ca, new_ca])
        for name in names:
            await wait_presenting(cluster, name, serial_of(cluster[name].dir / f"{name}.pem"), [old_ca, new_ca])
        cluster.trust(cluster.dir / "bundle.pem")
        # Then each node, one at a time, gets a certificate of the new CA.
        for name in names:
            cert, key = issue_node_cert(tmp_path / "new-ca", name, [HOST, "localhost"], tmp_path / f"new-{name}")
            install(key, cluster[name].dir / f"{name}.key", 0o600)
            install(cert, cluster[name].dir / f"{name}.pem")
            cluster[name].signal(signal.SIGHUP)
            await wait_presenting(cluster, name, serial_of(cert))
            await cluster.wait_connected(timeout=60)
        await renew_pair(cluster, "c", "b")  # both ends present certificates of the new CA now
        # Every node's registry row is signed with its new certificate before the old CA goes.
        await wait_for(lambda: rows_signed_by(cluster, subject_of(new_ca)), 60, "rows signed by the new CA")
        # The revocation signed again by the new CA, through one node; the same record everywhere, and once only.
        resign = ["certs", "resign", "--ca", str(tmp_path / "new-ca"), "--admin", a_admin, "--json"]
        done = await asyncio.to_thread(cli, *resign, token=token)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["signed_again"] == [gone_id(revoked.stdout)]
        await wait_for(lambda: revocations_signed_by(cluster, subject_of(new_ca)), 60, "the revocation signed again")
        again = await asyncio.to_thread(cli, *resign, token=token)
        assert json.loads(again.stdout) == {
            "ok": True,
            "ca": subject_of(new_ca),
            "signed_again": [],
            "already": [gone_id(revoked.stdout)],
        }
        # The old CA still counts: a certificate of it passes the handshake (and is refused by name, 403).
        assert await replication_answer(cluster, "a", cluster.dir / "bundle.pem", *probe_old) == 403
        # Last, the old CA leaves every bundle.
        await install_bundle(cluster, [new_ca])
        for name in names:
            await wait_presenting(cluster, name, serial_of(cluster[name].dir / f"{name}.pem"), [new_ca])
        cluster.trust(new_ca)
        assert await replication_answer(cluster, "a", new_ca, *probe_old) == "refused"
        probe_new = issue_node_cert(tmp_path / "new-ca", "a", [HOST], tmp_path / "probe-new")
        assert await replication_answer(cluster, "a", new_ca, *probe_new) == 403
        for name in names:
            assert await presented(cluster, name, new_ca) == {serial_of(cluster[name].dir / f"{name}.pem")}
        assert await revocations_signed_by(cluster, subject_of(new_ca))  # it still counts on every node
        await renew_pair(cluster, "a", "b")
        await renew_pair(cluster, "b", "c")

        # 3. A worker respawned after the reloads presents what its node loaded.
        body = await status(cluster, "b")
        victim = body["workers"][0]
        killing.set()
        psutil.Process(victim["pid"]).send_signal(signal.SIGKILL)
        await wait_for(lambda: respawned(cluster, "b", victim["pid"]), 60, "b's worker respawned")
        await wait_presenting(cluster, "b", serial_of(cluster["b"].dir / "b.pem"))
        await cluster.wait_connected(timeout=90)
        killing.clear()

        stop.set()
        await asyncio.gather(*writers)
        await cluster.wait_converged(DATABASE, timeout=120, expect_count=len(ledger.acked))
        await ledger.check()
        await assert_identical(cluster, [DATABASE])
        for name in names:
            assert (await pids(cluster, name))[0] == started[name][0]  # the same coordinator: no restart
            samples = await scrape(cluster, name)
            assert samples[("replicator_config_last_reload_successful", ())] == 1.0
            node_cert = x509.load_pem_x509_certificate((cluster[name].dir / f"{name}.pem").read_bytes())
            expiry = ("replicator_certificate_expiry_timestamp_seconds", (("certificate", "node"),))
            assert samples[expiry] == node_cert.not_valid_after_utc.timestamp()
            assert len(cluster[name].events("tls_reloaded")) == (4 if name == "a" else 3)
            assert not cluster[name].events("reload_failed")
            # Rows signed with certificates of the new CA were taken everywhere: each worker checks them against the
            # bundle it was sent.
            assert not cluster[name].events("registry_row_refused")
            assert_log_is_json(cluster[name])
        print(f"{len(ledger.acked)} writes acknowledged across the renewal and the rotation")
    finally:
        stop.set()
        await asyncio.gather(*writers, return_exceptions=True)
        await cluster.close()


async def pids(cluster: LocalCluster, name: str) -> tuple[int, list[int]]:
    body = await status(cluster, name)
    return body["coordinator"]["pid"], [worker["pid"] for worker in body["workers"]]


async def respawned(cluster: LocalCluster, name: str, gone: int) -> bool:
    body = await status(cluster, name)
    workers = body["workers"]
    return all(w["ready"] and w["pid"] != gone for w in workers) and len(workers) == cluster.workers


def gone_id(printed: str) -> str:
    """The id of the revocation `certs revoke --name gone` printed (its JSON document comes first)."""
    found = json.loads(printed.splitlines()[0])
    return f"gone.all.{int(found['issued_before'])}"


async def revocations_signed_by(cluster: LocalCluster, subject: str) -> bool:
    """Every node holds the revocation of `gone`, signed by the CA of `subject` and by no other."""
    for name in cluster.nodes:
        code, listing = await cluster.admin(name, "/revocations")
        assert code == 200, listing
        gone = [item for item in listing if item["revocation"]["name"] == "gone"]
        if len(gone) != 1 or (gone[0]["signed_by"] or {}).get("subject") != subject:
            return False
    return True


async def rows_signed_by(cluster: LocalCluster, issuer: str) -> bool:
    for name in cluster.nodes:
        code, rows = await cluster.admin(name, "/nodes")
        assert code == 200, rows
        own = {row["name"]: row["certificate"] or {} for row in rows if row.get("source") == "own"}
        if set(own) != set(cluster.nodes) or any(signer.get("issuer") != issuer for signer in own.values()):
            return False
    return True


# The bad files an operator may install, each refused at the reload (the unit tests go through all of them).
REFUSED = ["not PEM", "key of another certificate", "another node's name", "expired", "missing"]


async def test_a_bad_file_fails_the_reload_and_the_node_keeps_serving_what_it_had(
    make_cluster: Any, tmp_path: Path
) -> None:
    cluster: LocalCluster = make_cluster(["a", "b"], workers=2)
    own_trust(cluster)
    a = cluster["a"]
    cert, key, bundle = a.dir / "a.pem", a.dir / "a.key", trust_file(cluster, "a")
    good = tmp_path / "good"
    good.mkdir()
    for path in (cert, key, bundle):
        shutil.copy2(path, good / path.name)
    ca = cluster.dir / "ca" / "ca.pem"
    serial = serial_of(cert)
    address = str(tmp_path / "notify.sock")
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(address)
    receiver.setblocking(False)
    loop = asyncio.get_running_loop()
    notified: list[str] = []

    def collect() -> None:
        while True:
            try:
                notified.extend(receiver.recv(65536).decode().splitlines())
            except BlockingIOError:
                return

    loop.add_reader(receiver.fileno(), collect)
    ledger = Ledger(cluster, DATABASE)
    try:
        a.start(env={"NOTIFY_SOCKET": address}, args=["--check-integrity"])
        cluster["b"].start()
        await cluster.wait_ready()
        await wait_for(lambda: "READY=1" in notified, 60, "READY=1")
        # The boot's file check asked systemd for more time before the node was ready.
        assert notified.index("EXTEND_TIMEOUT_USEC=30000000") < notified.index("READY=1"), notified
        booted_at = (await scrape(cluster, "a"))[("replicator_config_last_reload_success_timestamp_seconds", ())]
        await cluster.wait_connected()

        for round_, kind in enumerate(REFUSED):
            breaker, words = BAD_FILES[kind]
            scratch = tmp_path / kind.replace(" ", "-").replace("'", "")
            scratch.mkdir()
            breaker(cluster.dir / "ca", "a", cert, key, bundle, scratch)
            failures = len(a.events("reload_failed"))
            notified.clear()
            a.signal(signal.SIGHUP)
            await wait_for(lambda n=failures: len(a.events("reload_failed")) > n, 60, f"the reload with {kind}")
            refused = a.events("reload_failed")[-1]
            assert refused["section"] == "tls" and words in refused["error"], refused
            samples = await scrape(cluster, "a")
            assert samples[("replicator_config_last_reload_successful", ())] == 0.0
            assert samples[("replicator_config_last_reload_success_timestamp_seconds", ())] == booted_at
            assert (await status(cluster, "a"))["reload"]["last_error"] == refused["error"]
            # Still presenting what it had, on every worker, and still replicating both ways.
            assert await presented(cluster, "a", ca) == {serial}
            await wait_presenting(cluster, "a", serial)
            await ledger.put("a", f"a-{round_}", {"kind": kind})
            await ledger.put("b", f"b-{round_}", {"kind": kind})
            await cluster.wait_converged(DATABASE, timeout=60, expect_count=len(ledger.acked))
            # systemd saw the reload begin and end.
            await wait_for(lambda: "READY=1" in notified, 30, "READY=1 after the reload")
            began = notified.index("RELOADING=1")
            assert notified[began + 1].startswith("MONOTONIC_USEC=") and "READY=1" in notified[began:], notified
            if kind == "not PEM":
                # A worker respawned while the files are bad starts from what the node loaded, not from them:
                # the node does not halt on a boot error.
                victim = (await status(cluster, "a"))["workers"][1]
                psutil.Process(victim["pid"]).send_signal(signal.SIGKILL)
                await wait_for(lambda v=victim["pid"]: respawned(cluster, "a", v), 60, "a's worker respawned")
                await wait_presenting(cluster, "a", serial)
            for path in (cert, key, bundle):
                install(good / path.name, path, 0o600 if path == key else 0o644)

        # Fixed (renewed, in fact): the next reload takes it, and the gauges say so.
        renewed_cert, renewed_key = issue_node_cert(cluster.dir / "ca", "a", [HOST, "localhost"], tmp_path / "renew")
        install(renewed_key, key, 0o600)
        install(renewed_cert, cert)
        a.signal(signal.SIGHUP)
        await wait_presenting(cluster, "a", serial_of(renewed_cert))
        assert await presented(cluster, "a", ca) == {serial_of(renewed_cert)}
        samples = await scrape(cluster, "a")
        assert samples[("replicator_config_last_reload_successful", ())] == 1.0
        assert samples[("replicator_config_last_reload_success_timestamp_seconds", ())] > booted_at
        await ledger.put("b", "after", {"renewed": True})
        await cluster.wait_converged(DATABASE, timeout=60, expect_count=len(ledger.acked))
        await ledger.check()
        await assert_identical(cluster, [DATABASE])
        assert a.running and not a.events("worker_boot_failed")
        assert_log_is_json(a)
    finally:
        loop.remove_reader(receiver.fileno())
        receiver.close()
        await cluster.close()
