"""TLS material read once and checked (`read_material`), contexts made from its bytes (`contexts`), and CAs of
subjects of their own, so that a bundle of an old and a new CA verifies every certificate of either."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
from pathlib import Path

import pytest
from cryptography import x509

from replicator.shared.tls import (
    MAX_PEM_BYTES,
    TlsConfigError,
    contexts,
    create_ca,
    issue_node_cert,
    peer_identity,
    read_material,
)
from tests.certificates import BAD_FILES, hand_made

DEADLINE = 10.0


@pytest.fixture
def node(tmp_path: Path) -> tuple[Path, Path, Path]:
    """The CA folder, the node's certificate and key (node "a"), and a CA bundle file of the node's own."""
    create_ca(tmp_path / "ca")
    cert, key = issue_node_cert(tmp_path / "ca", "a", ["127.0.0.1"], tmp_path / "a")
    bundle = tmp_path / "a" / "trust.pem"
    shutil.copyfile(tmp_path / "ca" / "ca.pem", bundle)
    return cert, key, bundle


def _subject(ca_dir: Path) -> str:
    cert = x509.load_pem_x509_certificate((ca_dir / "ca.pem").read_bytes())
    return cert.subject.rfc4514_string()


def test_material_holds_the_files_checked_and_nothing_else(node: tuple[Path, Path, Path], tmp_path: Path) -> None:
    cert, key, bundle = node
    # A key file may carry more than the key (a certificate, comments): only the key block is taken.
    key.write_bytes(b"# the node's key\n" + key.read_bytes())
    material = read_material(bundle, cert, key, node="a")
    assert [c.subject.rfc4514_string() for c in material.chain()] == ["CN=a"]
    assert material.authorities() == x509.load_pem_x509_certificates(bundle.read_bytes())
    assert material.key.startswith(b"-----BEGIN PRIVATE KEY-----") and b"#" not in material.key
    assert (material.ca_path, material.cert_path, material.key_path) == (str(bundle), str(cert), str(key))
    assert material.same_content(read_material(bundle, cert, key))
    assert not material.same_content(None)


@pytest.mark.parametrize("kind", sorted(BAD_FILES))
def test_every_bad_file_is_refused_naming_the_file_and_what_is_wrong(
    kind: str, node: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    cert, key, bundle = node
    breaker, words = BAD_FILES[kind]
    breaker(tmp_path / "ca", "a", cert, key, bundle, tmp_path)
    with pytest.raises(TlsConfigError, match=words) as refused:
        read_material(bundle, cert, key, node="a")
    assert any(str(path) in str(refused.value) for path in (cert, key, bundle)), refused.value


def test_a_file_too_large_to_be_a_certificate_is_refused(node: tuple[Path, Path, Path]) -> None:
    cert, key, bundle = node
    bundle.write_bytes(bundle.read_bytes() + b"\n" * MAX_PEM_BYTES)
    with pytest.raises(TlsConfigError, match=f"trust.pem: larger than {MAX_PEM_BYTES} bytes"):
        read_material(bundle, cert, key)


def test_the_name_is_only_checked_when_asked(node: tuple[Path, Path, Path]) -> None:
    cert, key, bundle = node
    read_material(bundle, cert, key)
    with pytest.raises(TlsConfigError, match=r"names 'a', not this node \('b', node.name\)"):
        read_material(bundle, cert, key, node="b")


def test_each_ca_gets_a_subject_of_its_own(tmp_path: Path) -> None:
    subjects = set()
    for index in range(3):
        create_ca(tmp_path / f"ca{index}")
        subjects.add(_subject(tmp_path / f"ca{index}"))
    assert len(subjects) == 3
    assert all(subject.startswith("CN=replicator cluster CA ") for subject in subjects)
    create_ca(tmp_path / "long", name="x" * 80)
    common_name = x509.load_pem_x509_certificate((tmp_path / "long" / "ca.pem").read_bytes()).subject
    assert len(common_name.rfc4514_string()) == len("CN=") + 64  # X.509's upper bound for a CN
    create_ca(tmp_path / "plain", name="exactly this", unique=False)
    assert _subject(tmp_path / "plain") == "CN=exactly this"


async def _handshake(server: ssl.SSLContext, client: ssl.SSLContext) -> tuple[str | None, str | None]:
    """One TLS connection on loopback: the name the client read off the server's certificate, and the server's off
    the client's (None: none, or the handshake failed on that side)."""
    seen: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await writer.start_tls(server)
            identity = peer_identity(writer.get_extra_info("ssl_object"))
            seen.set_result(identity.name if identity else None)
            writer.write(b"ok\n")
            await writer.drain()
        except (ssl.SSLError, ConnectionError):
            seen.set_result(None)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                await writer.wait_closed()

    listener = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        async with asyncio.timeout(DEADLINE):
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client)
            except (ssl.SSLError, ConnectionError):
                return None, await seen
            try:
                identity = peer_identity(writer.get_extra_info("ssl_object"))
                line = await reader.readline()
                client_saw = identity.name if identity is not None and line == b"ok\n" else None
            except (ssl.SSLError, ConnectionError):
                client_saw = None
            finally:
                writer.close()
                with contextlib.suppress(ConnectionError, ssl.SSLError):
                    await writer.wait_closed()
            return client_saw, await seen
    finally:
        listener.close()
        await listener.wait_closed()


async def test_contexts_made_from_the_bytes_handshake_with_no_file_left(tmp_path: Path) -> None:
    create_ca(tmp_path / "ca")
    a = read_material(tmp_path / "ca", *issue_node_cert(tmp_path / "ca", "a", ["127.0.0.1"], tmp_path / "a"))
    b = read_material(tmp_path / "ca", *issue_node_cert(tmp_path / "ca", "b", ["127.0.0.1"], tmp_path / "b"))
    shutil.rmtree(tmp_path / "a")
    shutil.rmtree(tmp_path / "b")  # the contexts come from the bytes alone
    server, _ = contexts(a)
    _, client = contexts(b)
    assert server.verify_mode == ssl.CERT_OPTIONAL and client.verify_mode == ssl.CERT_REQUIRED
    assert server.minimum_version == client.minimum_version == ssl.TLSVersion.TLSv1_2
    assert await _handshake(server, client) == ("a", "b")


@pytest.mark.parametrize("unique", [True, False])
async def test_a_bundle_of_two_cas_verifies_a_certificate_without_key_identifiers_of_the_new_one(
    tmp_path: Path, unique: bool
) -> None:
    """OpenSSL looks a certificate's issuer up by subject name, and without an authority key identifier it has
    nothing else to tell two CAs of one name apart: it may check the new CA's certificate against the old one's key
    and refuse it (it does with the old CA first in the bundle). CAs of subjects of their own (`unique`) never meet
    that, whatever the order of the bundle."""
    create_ca(tmp_path / "old", unique=unique)
    create_ca(tmp_path / "new", unique=unique)
    a_cert, a_key = hand_made(tmp_path / "new", "a", tmp_path / "a", key_identifiers=False)
    b_cert, b_key = hand_made(tmp_path / "new", "b", tmp_path / "b", key_identifiers=False)
    outcomes = []
    for order in (("old", "new"), ("new", "old")):
        bundle = tmp_path / f"bundle-{order[0]}-first.pem"
        bundle.write_bytes(b"".join((tmp_path / ca / "ca.pem").read_bytes() for ca in order))
        # Our own checks look for the CA that signed the chain among all of the bundle: they take it either way.
        server, _ = contexts(read_material(bundle, a_cert, a_key))
        _, client = contexts(read_material(bundle, b_cert, b_key))
        outcomes.append(await _handshake(server, client))
    if unique:
        assert outcomes == [("a", "b"), ("a", "b")]
    else:
        assert (None, None) in outcomes, outcomes  # refused in at least one order
