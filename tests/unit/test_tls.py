"""Certificates, TLS contexts and peer identity, with real handshakes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import ipaddress
import os
import ssl
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import NamedTuple

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from replicator.coordinator.certs_cmd import cmd_certs_ca, cmd_certs_node, cmd_init
from replicator.shared.config import load, resolve_path
from replicator.shared.tls import (
    KEY_MODE,
    PeerIdentity,
    TlsConfigError,
    client_context,
    create_ca,
    issue_node_cert,
    key_mode_refused,
    peer_identity,
    server_context,
)

HANDSHAKE_DEADLINE = 10.0


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


@pytest.fixture
def ca_dir(tmp_path: Path) -> Path:
    create_ca(tmp_path / "ca")
    return tmp_path / "ca"


@pytest.fixture
def certs(ca_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "certs"
    issue_node_cert(ca_dir, "a", ["127.0.0.1"], out)
    issue_node_cert(ca_dir, "b", ["127.0.0.1"], out)
    return out


# Files


def test_create_ca_writes_a_self_signed_ca_with_a_private_key(tmp_path: Path) -> None:
    cert_path, key_path = create_ca(tmp_path / "ca")

    assert (cert_path, key_path) == (tmp_path / "ca" / "ca.pem", tmp_path / "ca" / "ca.key")
    assert _mode(key_path) == 0o600
    assert _mode(tmp_path / "ca") == 0o700
    cert = _cert(cert_path)
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    cert.verify_directly_issued_by(cert)
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    assert key.public_key() == cert.public_key()


def test_key_files_are_private_whatever_the_umask(tmp_path: Path) -> None:
    previous = os.umask(0)
    try:
        _, ca_key = create_ca(tmp_path / "ca")
        node_cert, node_key = issue_node_cert(tmp_path / "ca", "a", [], tmp_path / "certs")
    finally:
        os.umask(previous)

    assert _mode(ca_key) == 0o600
    assert _mode(node_key) == 0o600
    assert _mode(node_cert) == 0o644
    assert not [p for p in (tmp_path / "certs").iterdir() if p.name.startswith(".")], "temporary files left"


def test_create_ca_refuses_to_overwrite_a_key_unless_forced(ca_dir: Path) -> None:
    before = (ca_dir / "ca.key").read_bytes()

    with pytest.raises(FileExistsError, match=r"ca\.key.*refusing to overwrite"):
        create_ca(ca_dir)
    assert (ca_dir / "ca.key").read_bytes() == before

    create_ca(ca_dir, force=True)
    assert (ca_dir / "ca.key").read_bytes() != before
    assert _mode(ca_dir / "ca.key") == 0o600


def test_node_certificate_names_the_node_and_its_hosts(ca_dir: Path, tmp_path: Path) -> None:
    cert_path, key_path = issue_node_cert(
        ca_dir, "node-a", ["127.0.0.1", "Proxy.Example.com", "[::1]", "127.0.0.1"], tmp_path / "certs"
    )

    assert (cert_path.name, key_path.name) == ("node-a.pem", "node-a.key")
    assert _mode(key_path) == 0o600
    cert = _cert(cert_path)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "node-a"
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["node-a", "proxy.example.com"]
    assert san.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    ]
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    cert.verify_directly_issued_by(_cert(ca_dir / "ca.pem"))


def test_node_serials_are_random(ca_dir: Path, tmp_path: Path) -> None:
    first, _ = issue_node_cert(ca_dir, "a", [], tmp_path / "one")
    second, _ = issue_node_cert(ca_dir, "a", [], tmp_path / "two")

    assert _cert(first).serial_number != _cert(second).serial_number


def test_certificates_outlast_a_clock_400_days_ahead(tmp_path: Path) -> None:
    # A node whose clock runs 400 days ahead must still accept every certificate the tooling made today
    # (issue 7 runs one under libfaketime); the margin covers a test run that starts a while after issuing.
    ahead = dt.timedelta(days=400 + 30)
    assert cmd_certs_ca(str(tmp_path / "ca")) == 0
    assert cmd_certs_node(str(tmp_path / "ca"), "a", ["127.0.0.1"], str(tmp_path / "a")) == 0
    now = dt.datetime.now(dt.UTC)

    for path in (tmp_path / "ca" / "ca.pem", tmp_path / "a" / "a.pem"):
        cert = _cert(path)
        assert cert.not_valid_before_utc <= now
        assert cert.not_valid_after_utc > now + ahead, path


@pytest.mark.parametrize(
    ("name", "hosts", "message"),
    [
        ("a.b", [], "not a valid node name"),
        ("", [], "not a valid node name"),
        ("a", ["two words"], "neither a host name nor an IP address"),
        ("a", [""], "neither a host name nor an IP address"),
    ],
)
def test_issue_node_cert_rejects_bad_names_and_hosts(
    ca_dir: Path, tmp_path: Path, name: str, hosts: list[str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        issue_node_cert(ca_dir, name, hosts, tmp_path / "certs")
    assert not (tmp_path / "certs").exists()


def test_issue_node_cert_refuses_to_overwrite_a_key(ca_dir: Path, certs: Path) -> None:
    before = (certs / "a.key").read_bytes()

    with pytest.raises(FileExistsError, match=r"a\.key"):
        issue_node_cert(ca_dir, "a", ["127.0.0.1"], certs)
    assert (certs / "a.key").read_bytes() == before


def test_issue_node_cert_never_overwrites_the_ca_files(ca_dir: Path) -> None:
    with pytest.raises(ValueError, match="CA files"):
        issue_node_cert(ca_dir, "ca", [], ca_dir, force=True)


def test_issue_node_cert_from_a_missing_ca_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(TlsConfigError, match=r"nowhere/ca\.pem: CA certificate file not found"):
        issue_node_cert(tmp_path / "nowhere", "a", [], tmp_path / "certs")


# Context errors


def test_missing_certificate_is_a_config_error_naming_the_file(ca_dir: Path, certs: Path) -> None:
    with pytest.raises(TlsConfigError, match=r"missing\.pem: certificate file not found"):
        server_context(ca_dir / "ca.pem", certs / "missing.pem", certs / "a.key")


def test_mismatched_key_is_a_config_error(ca_dir: Path, certs: Path) -> None:
    with pytest.raises(TlsConfigError, match=r"b\.key: the key does not match the certificate .*a\.pem"):
        server_context(ca_dir / "ca.pem", certs / "a.pem", certs / "b.key")


def test_garbage_files_are_config_errors(ca_dir: Path, certs: Path, tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    garbage.chmod(KEY_MODE)  # it stands for a key too: a private one, or its mode would be what is refused

    with pytest.raises(TlsConfigError, match=r"garbage\.pem: not a PEM CA certificate"):
        client_context(garbage)
    with pytest.raises(TlsConfigError, match=r"garbage\.pem: no PEM private key"):
        server_context(ca_dir / "ca.pem", certs / "a.pem", garbage)


@pytest.mark.parametrize(
    ("mode", "owner", "refused"),
    [
        (0o600, 1000, False),
        (0o400, 1000, False),
        (0o700, 1000, False),
        (0o640, 1000, True),
        (0o644, 1000, True),
        (0o604, 1000, True),
        (0o620, 1000, True),
        (0o602, 1000, True),
        (0o610, 1000, True),
        # Owned by root, at most group-readable passes (PostgreSQL's rule for a key shared with a group).
        (0o600, 0, False),
        (0o640, 0, False),
        (0o440, 0, False),
        (0o644, 0, True),
        (0o660, 0, True),
        (0o650, 0, True),
        (0o604, 0, True),
    ],
)
def test_which_key_modes_are_refused(mode: int, owner: int, refused: bool) -> None:
    assert key_mode_refused(mode, owner) is refused


@pytest.mark.parametrize("mode", [0o644, 0o604, 0o666])
def test_a_key_others_can_read_is_refused_naming_the_file_its_mode_and_the_fix(
    ca_dir: Path, certs: Path, mode: int
) -> None:
    key = certs / "a.key"
    key.chmod(mode)
    expected = rf"a\.key: the private key has mode {mode:04o}, open to group or others; .*: chmod 600 .*a\.key"
    with pytest.raises(TlsConfigError, match=expected):
        server_context(ca_dir / "ca.pem", certs / "a.pem", key)
    with pytest.raises(TlsConfigError, match=expected):
        client_context(ca_dir / "ca.pem", certs / "a.pem", key)
    key.chmod(0o600)
    server_context(ca_dir / "ca.pem", certs / "a.pem", key)
    key.chmod(0o400)
    client_context(ca_dir / "ca.pem", certs / "a.pem", key)


def test_a_group_readable_key_is_refused_unless_root_owns_it(ca_dir: Path, certs: Path) -> None:
    key = certs / "a.key"
    key.chmod(0o640)
    if os.geteuid() == 0:
        server_context(ca_dir / "ca.pem", certs / "a.pem", key)  # root's own 0640 key: allowed
        os.chown(key, 65534, -1)  # root still reads it, now as someone else's key
    with pytest.raises(TlsConfigError, match=r"a\.key: the private key has mode 0640"):
        server_context(ca_dir / "ca.pem", certs / "a.pem", key)


def test_a_key_kept_in_the_certificate_file_makes_that_file_private(ca_dir: Path, certs: Path, tmp_path: Path) -> None:
    both = tmp_path / "both.pem"
    both.write_bytes((certs / "a.pem").read_bytes() + (certs / "a.key").read_bytes())
    both.chmod(0o644)
    with pytest.raises(TlsConfigError, match=r"both\.pem: the private key has mode 0644"):
        server_context(ca_dir / "ca.pem", both, None)
    both.chmod(0o600)
    server_context(ca_dir / "ca.pem", both, None)
    client_context(ca_dir / "ca.pem", both)


def test_certificate_from_another_ca_is_a_config_error(ca_dir: Path, tmp_path: Path) -> None:
    create_ca(tmp_path / "other-ca")
    cert, key = issue_node_cert(tmp_path / "other-ca", "a", [], tmp_path / "other")

    with pytest.raises(TlsConfigError, match=r"a\.pem: not issued by the cluster CA"):
        server_context(ca_dir / "ca.pem", cert, key)


def test_expired_certificate_is_a_config_error(ca_dir: Path, tmp_path: Path) -> None:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "a")])
    _signed_by_ca(ca_dir, subject, [x509.DNSName("a")], out=tmp_path / "old", days=-1)

    with pytest.raises(TlsConfigError, match=r"old\.pem: the certificate expired on"):
        server_context(ca_dir / "ca.pem", tmp_path / "old.pem", tmp_path / "old.key")


def test_contexts_require_tls12_and_verify(ca_dir: Path, certs: Path) -> None:
    server = server_context(ca_dir / "ca.pem", certs / "a.pem", certs / "a.key")
    client = client_context(ca_dir, certs / "b.pem", certs / "b.key")

    assert server.minimum_version == client.minimum_version == ssl.TLSVersion.TLSv1_2
    assert server.verify_mode == ssl.CERT_OPTIONAL
    assert client.verify_mode == ssl.CERT_REQUIRED
    assert client.check_hostname


# Identity


def test_peer_identity_from_der_and_from_the_peercert_dict(certs: Path) -> None:
    cert = _cert(certs / "a.pem")
    issued = cert.not_valid_before_utc.timestamp()
    expected = PeerIdentity(name="a", serial=format(cert.serial_number, "x"), not_before=issued)
    peercert = {
        "subject": ((("organizationName", "x"),), (("commonName", "a"),)),
        "serialNumber": format(cert.serial_number, "X"),
        "notBefore": cert.not_valid_before_utc.strftime("%b %d %H:%M:%S %Y GMT"),
        "subjectAltName": (("DNS", "a"), ("IP Address", "127.0.0.1")),
    }

    assert peer_identity(cert.public_bytes(serialization.Encoding.DER)) == expected
    assert peer_identity(peercert) == expected
    assert peer_identity(None) is None
    assert peer_identity({}) is None


def _signed_by_ca(
    ca_dir: Path, subject: x509.Name, sans: list[x509.GeneralName], out: Path | None = None, days: int = 1
) -> x509.Certificate:
    """A hand-built certificate, of a shape issue_node_cert never makes; written to `out`.pem/.key if set."""
    ca_cert = _cert(ca_dir / "ca.pem")
    ca_key = serialization.load_pem_private_key((ca_dir / "ca.key").read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(0xABC)
        .not_valid_before(now - dt.timedelta(days=30))
        .not_valid_after(now + dt.timedelta(days=days))
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=True)
    cert = builder.sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    if out is not None:
        out.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path = out.with_suffix(".key")
        key_path.touch(mode=KEY_MODE)  # private before it holds the key, as the node requires
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    return cert


def test_peer_identity_falls_back_to_the_first_dns_san(ca_dir: Path) -> None:
    cert = _signed_by_ca(ca_dir, x509.Name([]), [x509.DNSName("node_b"), x509.DNSName("other")])

    identity = peer_identity(cert.public_bytes(serialization.Encoding.DER))
    assert identity is not None and (identity.name, identity.serial) == ("node_b", "abc")


def test_peer_identity_refuses_names_that_cannot_be_nodes(ca_dir: Path) -> None:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "replicator cluster CA")])
    cert = _signed_by_ca(ca_dir, subject, [x509.DNSName("a")])

    assert peer_identity(cert.public_bytes(serialization.Encoding.DER)) is None
    assert peer_identity(b"not DER") is None


# Handshakes


class _Session(NamedTuple):
    # The identity read both ways asyncio offers it, or the server's handshake error.
    from_object: PeerIdentity | None = None
    from_dict: PeerIdentity | None = None
    error: BaseException | None = None


class _Server:
    def __init__(self, port: int) -> None:
        self.port = port
        self.sessions: asyncio.Queue[_Session] = asyncio.Queue()

    async def next_session(self) -> _Session:
        async with asyncio.timeout(HANDSHAKE_DEADLINE):
            return await self.sessions.get()


@contextlib.asynccontextmanager
async def _serve(context: ssl.SSLContext) -> AsyncIterator[_Server]:
    """A TLS server running the handshake in its handler (start_tls), so a test sees the server's verdict."""
    state: _Server | None = None

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert state is not None
        session = _Session()
        try:
            await writer.start_tls(context)
            session = _Session(
                peer_identity(writer.get_extra_info("ssl_object")),
                peer_identity(writer.get_extra_info("peercert")),
            )
            writer.write(b"hello\n")
            await writer.drain()
        except (ssl.SSLError, ConnectionError) as exc:
            session = _Session(error=exc)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                await writer.wait_closed()
            state.sessions.put_nowait(session)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    state = _Server(server.sockets[0].getsockname()[1])
    try:
        yield state
    finally:
        server.close()
        await server.wait_closed()


async def _exchange(port: int, context: ssl.SSLContext, server_hostname: str | None = None) -> bytes:
    """Dial, check the server is node a, read the greeting, close."""
    async with asyncio.timeout(HANDSHAKE_DEADLINE):
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context, server_hostname=server_hostname)
        try:
            server = peer_identity(writer.get_extra_info("ssl_object"))
            assert server is not None and server.name == "a"
            line = await reader.readline()
            if not line:
                raise ConnectionError("closed by the server")
            return line
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                await writer.wait_closed()


async def test_mutual_handshake_gives_the_server_the_client_identity(ca_dir: Path, certs: Path) -> None:
    client_serial = format(_cert(certs / "b.pem").serial_number, "x")
    async with _serve(server_context(ca_dir / "ca.pem", certs / "a.pem", certs / "a.key")) as server:
        line = await _exchange(server.port, client_context(ca_dir / "ca.pem", certs / "b.pem", certs / "b.key"))
        session = await server.next_session()

    assert line == b"hello\n"
    assert session.error is None
    assert session.from_object == session.from_dict
    assert session.from_object is not None
    assert (session.from_object.name, session.from_object.serial) == ("b", client_serial)


async def test_client_without_certificate_connects_without_identity(ca_dir: Path, certs: Path) -> None:
    async with _serve(server_context(ca_dir / "ca.pem", certs / "a.pem", certs / "a.key")) as server:
        line = await _exchange(server.port, client_context(ca_dir / "ca.pem"))
        session = await server.next_session()

    assert line == b"hello\n"
    assert session == _Session(None, None, None)


@pytest.mark.parametrize("tls_version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3])
async def test_client_certificate_from_another_ca_is_rejected_by_the_handshake(
    ca_dir: Path, certs: Path, tmp_path: Path, tls_version: ssl.TLSVersion
) -> None:
    create_ca(tmp_path / "rogue-ca")
    rogue_cert, rogue_key = issue_node_cert(tmp_path / "rogue-ca", "b", ["127.0.0.1"], tmp_path / "rogue")
    # The rogue client trusts the real CA (so it accepts the server) but presents a foreign certificate;
    # client_context would refuse to build that, so the chain is loaded by hand.
    rogue = client_context(ca_dir / "ca.pem")
    rogue.load_cert_chain(rogue_cert, rogue_key)
    rogue.maximum_version = tls_version

    async with _serve(server_context(ca_dir / "ca.pem", certs / "a.pem", certs / "a.key")) as server:
        # Under TLS 1.3 the client finishes its side before the server checks its certificate, so the
        # client may only notice on its first read.
        with pytest.raises((ssl.SSLError, ConnectionError)):
            await _exchange(server.port, rogue)
        session = await server.next_session()

    assert isinstance(session.error, ssl.SSLCertVerificationError), session
    assert session.from_object is None


async def test_hostname_verification_fails_when_the_san_lacks_the_dialled_host(ca_dir: Path, tmp_path: Path) -> None:
    cert, key = issue_node_cert(ca_dir, "a", ["localhost"], tmp_path / "certs")
    context = client_context(ca_dir / "ca.pem")

    async with _serve(server_context(ca_dir / "ca.pem", cert, key)) as server:
        with pytest.raises(ssl.SSLCertVerificationError, match=r"127\.0\.0\.1"):
            await _exchange(server.port, context)
        # The same server passes under a name its certificate holds, so the failure above is the host check.
        assert (await server.next_session()).error is not None
        assert await _exchange(server.port, context, server_hostname="localhost") == b"hello\n"
        assert (await server.next_session()).error is None


# Commands


def test_cmd_init_writes_a_config_that_loads(
    ca_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)

    code = cmd_init(
        name="a",
        url="wss://127.0.0.1:9925",
        port=9925,
        admin_port=9926,
        data="data/a",
        ca="ca",
        config="nodes/a.toml",
        peers=["b=wss://127.0.0.1:9935", "c=wss://localhost:9945"],
        workers=2,
    )

    assert code == 0, capsys.readouterr().err
    config = load(tmp_path / "nodes" / "a.toml", env={})
    assert (config.node.name, config.node.url, config.node.workers) == ("a", "wss://127.0.0.1:9925", 2)
    assert (config.listen.host, config.listen.port, config.listen.admin_port) == ("127.0.0.1", 9925, 9926)
    assert [(p.name, p.url, p.databases) for p in config.peers] == [
        ("b", "wss://127.0.0.1:9935", ["*"]),
        ("c", "wss://localhost:9945", ["*"]),
    ]
    assert config.replication.databases == ["*"]
    assert len(config.data.token) >= 32  # init writes a random data token
    # Written relative to the file's folder, and resolving to the right files: the CA certificate is a copy beside
    # the config, out of the folder that holds the CA key.
    assert (config.tls.ca, config.tls.cert, config.tls.key) == ("ca.pem", "a.pem", "a.key")
    root = tmp_path.resolve()
    assert resolve_path(config, config.tls.ca).resolve() == root / "nodes" / "ca.pem"
    assert (root / "nodes" / "ca.pem").read_bytes() == (root / "ca" / "ca.pem").read_bytes()
    assert resolve_path(config, config.node.data_dir).resolve() == root / "data" / "a"
    cert_path = resolve_path(config, config.tls.cert)
    assert cert_path.resolve() == root / "nodes" / "a.pem"
    assert _mode(resolve_path(config, config.tls.key)) == 0o600
    san = _cert(cert_path).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert san.get_values_for_type(x509.DNSName) == ["a"]
    server_context(resolve_path(config, config.tls.ca), cert_path, resolve_path(config, config.tls.key))


def test_cmd_init_refuses_to_overwrite_a_config(
    ca_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "a.toml"
    config.write_text("# mine\n")

    code = cmd_init("a", "wss://127.0.0.1:9925", 9925, 9926, "data", str(ca_dir), str(config), [])

    assert code == 1
    assert "already exists" in capsys.readouterr().err
    assert config.read_text() == "# mine\n"
    assert not (tmp_path / "a.key").exists()


@pytest.mark.parametrize(
    ("overrides", "argument"),
    [
        ({"peers": ["x"]}, "--peer"),
        ({"peers": ["b=http://127.0.0.1:1"]}, "--peer"),
        ({"peers": ["a=wss://127.0.0.1:9935"]}, "--peer"),
        ({"name": "a.b"}, "--name"),
        ({"url": "127.0.0.1:9925"}, "--url"),
        ({"port": 70000}, "--port"),
        ({"admin_port": 0}, "--admin-port"),
        ({"admin_port": 9925}, "--admin-port"),
        ({"workers": -1}, "--workers"),
    ],
)
def test_cmd_init_bad_arguments_exit_2_naming_the_argument(
    ca_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    overrides: dict[str, object],
    argument: str,
) -> None:
    arguments: dict[str, object] = {
        "name": "a",
        "url": "wss://127.0.0.1:9925",
        "port": 9925,
        "admin_port": 9926,
        "data": str(tmp_path / "data"),
        "ca": str(ca_dir),
        "config": str(tmp_path / "node" / "a.toml"),
        "peers": [],
    }
    arguments.update(overrides)

    assert cmd_init(**arguments) == 2  # type: ignore[arg-type]
    assert argument in capsys.readouterr().err
    assert not (tmp_path / "node").exists()


def test_cmd_init_with_a_missing_ca_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cmd_init("a", "wss://127.0.0.1:9925", 9925, 9926, "data", str(tmp_path / "nope"), "a.toml", [])

    assert code == 2
    assert "--ca" in capsys.readouterr().err


def test_cmd_certs_ca_and_node(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cmd_certs_ca(str(tmp_path / "ca")) == 0
    assert cmd_certs_ca(str(tmp_path / "ca")) == 1
    assert cmd_certs_node(str(tmp_path / "ca"), "a", ["127.0.0.1", "a.example"], str(tmp_path / "certs")) == 0
    assert cmd_certs_node(str(tmp_path / "ca"), "a", ["127.0.0.1"], str(tmp_path / "certs")) == 1
    assert cmd_certs_node(str(tmp_path / "ca"), "a b", [], str(tmp_path / "certs")) == 2
    assert cmd_certs_node(str(tmp_path / "nope"), "b", [], str(tmp_path / "certs")) == 2

    out = capsys.readouterr().out
    assert "ca.pem" in out and "a.pem" in out
    san = _cert(tmp_path / "certs" / "a.pem").extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert san.value.get_values_for_type(x509.DNSName) == ["a", "a.example"]
