"""The coordinator's side of a TLS reload, in virtual time with a fake supervisor: the files are read and checked
first, and only then does any worker hear of them; a bad file changes nothing anywhere; the gauges, the expiry
metric, the registry signer and a respawned worker's start all follow what the node loaded."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from replicator.coordinator import credentials
from replicator.coordinator.credentials import Credentials
from replicator.coordinator.node import Node
from replicator.coordinator.sd_notify import Notifier
from replicator.shared import membership, messages
from replicator.shared.config import load
from replicator.shared.tls import create_ca, issue_node_cert
from tests.certificates import BAD_FILES, install
from tests.unit.fakeloop import VirtualTimeLoop
from tests.unit.notify_receiver import datagrams
from tests.unit.test_coordinator import FakeSupervisor
from tests.unit.test_metrics import named, scrape

EXPIRY = "replicator_certificate_expiry_timestamp_seconds"


class Files:
    """A node's folder: its config (node "self", two workers), certificate, key and CA bundle (trust.pem)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca = root / "ca"
        self.folder = root / "self"
        create_ca(self.ca)
        self.cert, self.key = issue_node_cert(self.ca, "self", ["127.0.0.1"], self.folder)
        self.bundle = self.folder / "trust.pem"
        shutil.copyfile(self.ca / "ca.pem", self.bundle)
        self.config = self.folder / "node.toml"
        self.write_config()

    def write_config(self, peers: str = "") -> None:
        self.config.write_text(
            '[node]\nname = "self"\nurl = "wss://127.0.0.1:1000"\nworkers = 2\n'
            '[tls]\nca = "trust.pem"\ncert = "self.pem"\nkey = "self.key"\n' + peers
        )

    def renew(self) -> None:
        """A new certificate from the same CA, installed over the node's files."""
        cert, key = issue_node_cert(self.ca, "self", ["127.0.0.1"], self.root / "renewed", force=True)
        install(key, self.key, 0o600)
        install(cert, self.cert)


@pytest.fixture
def files(tmp_path: Path) -> Files:
    return Files(tmp_path)


def booted(loop: VirtualTimeLoop, files: Files) -> tuple[Node, FakeSupervisor]:
    """A node as its boot leaves it: the config and the TLS material loaded, the signer and verifier made."""
    config = load(files.config, env={})
    supervisor = FakeSupervisor(loop, 2)
    node = Node(config, loop=loop, rng=lambda: 0.5, supervisor=supervisor)  # type: ignore[arg-type]
    loaded = Credentials(credentials.read(config), generation=1, loaded_at=node.wall())
    node.credentials = loaded
    node.signer = loaded.signer(node.name)
    node.verifier = membership.Verifier(loaded.cas)
    return node, supervisor


def serial(path: Path) -> int:
    return x509.load_pem_x509_certificate(path.read_bytes()).serial_number


def events(capsys: pytest.CaptureFixture[str], name: str) -> list[dict]:
    lines = capsys.readouterr().err.splitlines()
    return [record for line in lines if line.startswith("{") and (record := json.loads(line))["event"] == name]


def test_a_renewed_certificate_goes_to_every_worker_and_signs_the_rows(
    loop: VirtualTimeLoop, files: Files, capsys: pytest.CaptureFixture[str]
) -> None:
    node, supervisor = booted(loop, files)
    before = node.credentials
    assert before is not None
    old_signer = node.signer
    files.renew()
    loop.run(node._reload())
    loaded = node.credentials
    assert loaded is not None and loaded.generation == 2 and loaded.certificate.serial_number == serial(files.cert)
    reloads = supervisor.of(messages.ReloadTls)
    assert [(slot, m.generation) for _, slot, m in reloads] == [(0, 2), (1, 2)]
    assert all(m.material == loaded.material for _, _, m in reloads)
    # The same CA: the verifier (and what it decided) stays; the rows are signed with the new certificate.
    assert node.signer is not None and old_signer is not None and node.signer.cert_der != old_signer.cert_der
    assert node.signer.cert_der == loaded.certificate.public_bytes(serialization.Encoding.DER)
    assert node.verifier.ca == before.cas
    # The metric follows what the node loaded; a worker started from now on starts with it.
    assert named(scrape(node), EXPIRY)[(("certificate", "node"),)] == loaded.certificate.not_valid_after_utc.timestamp()
    boot = messages.decode_boot(node._worker_boot())
    assert (boot.tls, boot.tls_generation) == (loaded.material, 2)
    assert node.reload_health.successful and node.reload_health.failures == 0
    (reloaded,) = events(capsys, "tls_reloaded")
    assert reloaded["changed"] == ["cert", "key"] and reloaded["serial"] == loaded.serial
    assert reloaded["generation"] == 2 and reloaded["issued_by_bundle"] is True


def test_a_reload_that_changes_no_file_sends_nothing(loop: VirtualTimeLoop, files: Files) -> None:
    node, supervisor = booted(loop, files)
    before = node.credentials
    loop.run(node._reload())
    assert node.credentials is before and supervisor.of(messages.ReloadTls) == []
    assert node.reload_health.successful


def test_a_new_ca_in_the_bundle_is_trusted_for_rows_and_revocations(loop: VirtualTimeLoop, files: Files) -> None:
    node, supervisor = booted(loop, files)
    create_ca(files.root / "new-ca")
    files.bundle.write_bytes(files.bundle.read_bytes() + (files.root / "new-ca" / "ca.pem").read_bytes())
    loop.run(node._reload())
    assert node.credentials is not None and len(node.credentials.cas) == 2
    assert node.verifier.ca == node.credentials.cas  # a new verifier: nothing decided with the old bundle is kept
    assert [m.generation for _, _, m in supervisor.of(messages.ReloadTls)] == [2, 2]
    # The node's certificate still comes from the old CA: its issuer is the one the expiry metric reads.
    old_ca = x509.load_pem_x509_certificate((files.ca / "ca.pem").read_bytes())
    assert named(scrape(node), EXPIRY)[(("certificate", "ca"),)] == old_ca.not_valid_after_utc.timestamp()


@pytest.mark.parametrize("kind", sorted(BAD_FILES))
def test_a_bad_file_fails_the_reload_and_changes_nothing(
    loop: VirtualTimeLoop, files: Files, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    node, supervisor = booted(loop, files)
    before, signer, verifier = node.credentials, node.signer, node.verifier
    breaker, words = BAD_FILES[kind]
    # The same reload also adds a peer: a reload that fails takes none of what it read.
    files.write_config('[[peers]]\nname = "b"\nurl = "wss://127.0.0.1:2000"\n')
    breaker(files.ca, "self", files.cert, files.key, files.bundle, files.root)
    loop.run(node._reload())
    assert node.credentials is before and node.signer is signer and node.verifier is verifier
    assert supervisor.of(messages.ReloadTls) == [] and supervisor.of(messages.Reconfigure) == []
    assert node.config.peers == []
    assert not node.reload_health.successful and words in node.reload_health.last_error
    samples = scrape(node)
    assert samples[("replicator_config_last_reload_successful", ())] == 0.0
    (failed,) = events(capsys, "reload_failed")
    assert failed["section"] == "tls" and words in failed["error"] and failed["level"] == "error"
    assert named(samples, EXPIRY)[(("certificate", "node"),)] == before.certificate.not_valid_after_utc.timestamp()
    # Fixed, the next reload takes it all.
    issue_node_cert(files.ca, "self", ["127.0.0.1"], files.folder, force=True)
    shutil.copyfile(files.ca / "ca.pem", files.bundle)
    loop.run(node._reload())
    assert node.reload_health.successful and [peer.name for peer in node.config.peers] == ["b"]
    assert node.credentials is not None and node.credentials.generation == 2
    assert [m.generation for _, _, m in supervisor.of(messages.ReloadTls)] == [2, 2]


def test_a_worker_behind_the_node_is_sent_the_current_material_and_a_failure_is_reported(
    loop: VirtualTimeLoop, files: Files, capsys: pytest.CaptureFixture[str]
) -> None:
    node, supervisor = booted(loop, files)
    files.renew()
    loop.run(node._reload())
    supervisor.sent.clear()
    # Worker 1 came up from the previous load while the reload went out (its pipe was not open yet).
    node.on_worker_message(1, messages.TlsLoaded(worker=1, generation=1, serial="abc"))
    assert [(slot, m.generation) for _, slot, m in supervisor.of(messages.ReloadTls)] == [(1, 2)]
    node.on_worker_message(0, messages.TlsLoaded(worker=0, generation=2, serial="def"))
    assert len(supervisor.of(messages.ReloadTls)) == 1  # up to date: nothing more
    assert node.reload_health.successful
    node.on_worker_message(1, messages.TlsLoaded(worker=1, generation=2, serial="abc", error="no memory"))
    assert not node.reload_health.successful and "worker 1: no memory" in node.reload_health.last_error
    assert events(capsys, "worker_tls_reload_failed")[0]["error"] == "no memory"
    assert {slot: report.serial for slot, report in node.worker_tls.items()} == {0: "def", 1: "abc"}


def test_a_reload_is_announced_to_systemd_once_the_node_is_ready(
    loop: VirtualTimeLoop, files: Files, notify_socket: tuple[str, socket.socket]
) -> None:
    address, sock = notify_socket
    node, _ = booted(loop, files)
    node.notifier = Notifier(address, None)
    loop.run(node._reload())
    assert datagrams(sock) == []  # not ready yet: READY=1 must not come from a reload
    node._announced_ready = True
    loop.advance_to(12.5)
    loop.run(node._reload())
    reloading, ready = datagrams(sock)
    assert reloading == "RELOADING=1\nMONOTONIC_USEC=12500000"
    assert ready.startswith("READY=1\nSTATUS=")
