"""Cluster certificates and TLS contexts.

One private CA per cluster signs every node certificate. A node certificate carries the node name as its CN
and in its SAN, with both serverAuth and clientAuth usages, because the same certificate serves the node port
and dials peers. The peer's node name is read back from the verified certificate (`peer_identity`).

`TlsConfigError` covers certificate and key files that are missing, unreadable, malformed, do not belong together,
or (a private key) can be read by others than its owner; the message names the file and what is wrong, and the CLI
turns it into exit code 3 at boot (2 from `check-config`).

A running node reads its files once per load (the boot, each SIGHUP) into `TlsMaterial` (`read_material`: every check
above, and the certificate naming the node), and every one of its processes builds its contexts from those bytes
(`contexts`): the coordinator checks a reload before any worker hears of it, and a worker respawned later presents
what the node loaded, whatever the files hold by then.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import functools
import ipaddress
import itertools
import os
import re
import secrets
import ssl
import stat
import tempfile
import threading
from asyncio import selector_events, sslproto
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import msgspec
from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import dsa, ec, ed448, ed25519, rsa
from cryptography.hazmat.primitives.asymmetric.types import CertificateIssuerPrivateKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from replicator.shared.config import NAME_RE

PathLike = str | os.PathLike[str]

CA_CERT_FILE = "ca.pem"
CA_KEY_FILE = "ca.key"
KEY_MODE = 0o600
# A private key with any of these permission bits is refused, as PostgreSQL and OpenSSH refuse one: group or others
# may read (or replace) it. A key owned by root may be readable by its group (0640 at most): PostgreSQL's exception,
# for a key root installs for a service's group (Debian's ssl-cert; the RUNBOOK's root:replicator 0640).
KEY_REFUSED_BITS = 0o077
ROOT_KEY_REFUSED_BITS = 0o037
CERT_MODE = 0o644
DIR_MODE = 0o700
# What a TLS connection reads at a time (`limit_read_buffers`).
READ_BUFFER_BYTES = 32 * 1024
# TLS 1.3 session tickets a server sends after each handshake. None of our clients resumes a session (aiohttp never
# passes one), and a client that receives tickets keeps about 17 KB per connection for them (OpenSSL's handshake
# buffer and the new sessions), so the node sends none.
SESSION_TICKETS = 0
# The most a certificate, key or CA bundle file may hold: a bundle of a hundred CAs is about 100 KB, and a file this
# size is not one (the material travels to every worker in one pipe frame).
MAX_PEM_BYTES = 1024 * 1024
# Backdating notBefore lets a peer whose clock runs a little behind accept a certificate issued a moment ago.
_CLOCK_SKEW = dt.timedelta(minutes=5)
# DNS labels; '_' is tolerated because node names may contain it and the name goes into the SAN.
_HOST_RE = re.compile(
    r"^(\*\.)?([A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?\.)*[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?\.?$"
)
_ISSUER_KEY_TYPES = (
    rsa.RSAPrivateKey,
    dsa.DSAPrivateKey,
    ec.EllipticCurvePrivateKey,
    ed25519.Ed25519PrivateKey,
    ed448.Ed448PrivateKey,
)
_PEM_KEY_RE = re.compile(rb"-----BEGIN ([A-Z ]*)PRIVATE KEY-----.+?-----END \1PRIVATE KEY-----\s*", re.S)


class TlsConfigError(Exception):
    """A certificate or key file is missing, unreadable, malformed, does not match, or is a private key others may
    read; the message names it."""


class PeerIdentity(msgspec.Struct, frozen=True):
    """Who is at the other end of a verified TLS session: the node name and the certificate serial (hex)."""

    name: str
    serial: str
    not_before: float = 0.0  # when the certificate became valid (its issue time), seconds since the epoch


class TlsMaterial(msgspec.Struct, frozen=True, kw_only=True):
    """What a node presents and trusts, as `read_material` read and checked it: PEM bytes, and the files they came
    from (for messages only). Every process of the node builds its contexts from the bytes (`contexts`)."""

    ca: bytes  # the CA bundle: every CA the node trusts (two during a rotation)
    cert: bytes  # the node's certificate chain, leaf first
    key: bytes  # the private key of the leaf
    ca_path: str = ""
    cert_path: str = ""
    key_path: str = ""

    def chain(self) -> list[x509.Certificate]:
        return x509.load_pem_x509_certificates(self.cert)

    def authorities(self) -> list[x509.Certificate]:
        return x509.load_pem_x509_certificates(self.ca)

    def same_content(self, other: TlsMaterial | None) -> bool:
        return other is not None and (self.ca, self.cert, self.key) == (other.ca, other.cert, other.key)


def create_ca(
    out_dir: PathLike,
    name: str = "replicator cluster CA",
    days: int = 3650,
    *,
    force: bool = False,
    unique: bool = True,
) -> tuple[Path, Path]:
    """Create a cluster CA: `out_dir/ca.pem` and `out_dir/ca.key` (mode 0600).

    `unique`: the subject's CN is `name` followed by the date and a random suffix, so that no two CAs share a
    subject. OpenSSL picks a certificate's issuer among the CAs it trusts by subject name, so with two CAs of one
    name in a bundle (a rotation) a certificate without key identifiers could be checked against the wrong CA and
    refused.

    An existing `ca.key` is only replaced with `force=True`: replacing it orphans every node certificate the
    old key signed, so it must be deliberate.
    """
    if not name.strip():
        raise ValueError("the CA name must not be empty")
    _check_days(days)
    out = _make_dir(out_dir)
    cert_path, key_path = out / CA_CERT_FILE, out / CA_KEY_FILE
    if not force:
        _refuse_existing_key(key_path)

    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_common_name(name, now) if unique else name)])
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(now + dt.timedelta(days=days))
        # path_length=0: this CA signs node certificates only, never an intermediate.
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(digital_signature=True, key_cert_sign=True, crl_sign=True), critical=True)
        .add_extension(ski, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_file(key_path, _key_pem(key), KEY_MODE, replace=force)
    _write_file(cert_path, cert.public_bytes(serialization.Encoding.PEM), CERT_MODE, replace=True)
    return cert_path, key_path


def ca_common_name(name: str, now: dt.datetime) -> str:
    """A CA's CN of its own: `name`, the day it is made and 8 random hex digits (64 characters at most, as X.509
    allows)."""
    suffix = f" {now:%Y-%m-%d} {secrets.token_hex(4)}"
    return name.strip()[: 64 - len(suffix)] + suffix


def issue_node_cert(
    ca_dir: PathLike,
    name: str,
    hosts: Iterable[str],
    out_dir: PathLike,
    days: int = 825,
    *,
    force: bool = False,
) -> tuple[Path, Path]:
    """Issue a node certificate signed by the CA in `ca_dir`: `out_dir/NAME.pem`, `out_dir/NAME.key` (0600).

    The SAN holds the node name and every host (IP literals as IP addresses), so hostname verification works
    whether peers dial an address, a DNS name or a proxy in front of the node. An existing key is only
    replaced with `force=True`. Raises ValueError for a bad name or host, TlsConfigError for an unusable CA.
    """
    if not NAME_RE.match(name):
        raise ValueError(f"{name!r} is not a valid node name (letters, digits, '_' and '-', 1 to 64)")
    _check_days(days)
    sans = _san_entries([name, *hosts])
    ca_cert_path, ca_key_path = ca_paths(ca_dir)
    ca_cert, ca_key = _load_ca(ca_cert_path, ca_key_path)

    out = Path(out_dir)
    cert_path, key_path = out / f"{name}.pem", out / f"{name}.key"
    if _same_file(cert_path, ca_cert_path) or _same_file(key_path, ca_key_path):
        raise ValueError(f"node name {name!r} would overwrite the CA files in {out}")
    out = _make_dir(out)
    if not force:
        _refuse_existing_key(key_path)

    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    # A certificate outliving its CA would fail verification anyway; ending with the CA makes that visible.
    not_after = min(now + dt.timedelta(days=days), ca_cert.not_valid_after_utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(digital_signature=True), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(_authority_key_identifier(ca_cert), critical=False)
        .sign(ca_key, _signature_hash(ca_key))
    )
    _write_file(key_path, _key_pem(key), KEY_MODE, replace=force)
    _write_file(cert_path, cert.public_bytes(serialization.Encoding.PEM), CERT_MODE, replace=True)
    return cert_path, key_path


def ca_paths(ca: PathLike) -> tuple[Path, Path]:
    """The CA certificate and key paths for a CA directory (or for the path of its `ca.pem`)."""
    path = Path(ca)
    if path.is_file():
        return path, path.with_suffix(".key")
    return path / CA_CERT_FILE, path / CA_KEY_FILE


def server_context(ca: PathLike, cert: PathLike, key: PathLike | None) -> ssl.SSLContext:
    """The node port's context: TLS 1.2+, this node's certificate, client certificates checked against the CA.

    Client certificates are optional at the TLS layer because the data API on the same port accepts clients
    without one; the replication handler refuses a session whose `peer_identity` is None.
    """
    ca_pem = _check_files(ca, cert, key)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_into(context, ca, ca_pem, cert, key)
    context.verify_mode = ssl.CERT_OPTIONAL
    context.num_tickets = SESSION_TICKETS
    return context


def client_context(ca: PathLike, cert: PathLike | None = None, key: PathLike | None = None) -> ssl.SSLContext:
    """A dialling context: TLS 1.2+, the server verified against the cluster CA including its host name, and
    this node's certificate presented when `cert` is given (`key` None: the key is in the cert file)."""
    if cert is None and key is not None:
        raise TlsConfigError(f"{key}: a key was given without its certificate")
    ca_pem = _check_files(ca, cert, key)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED and check_hostname by default
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_into(context, ca, ca_pem, cert, key)
    return context


def limit_read_buffers(size: int = READ_BUFFER_BYTES) -> None:
    """Make every TLS connection this process opens or accepts from now on read through a buffer of `size` bytes,
    one buffer per thread shared by all of them.

    asyncio's TLS transport allocates its read buffer (`SSLProtocol.max_size`, 256 KiB) with each connection and
    keeps it, filled with zeros, for the connection's life. A node holds one connection per (peer, database) in each
    direction: that buffer alone was half a megabyte per replicated database (issue 12). Reading 32 KiB at a time
    (two TLS records) costs nothing measurable at replication rates; a subclass may read more (`max_size`).

    The buffer only ever holds bytes between two calls the loop makes back to back: the socket transport has the
    kernel write into it (`recv_into`) and hands it straight to `buffer_updated`, which copies it into the TLS
    object's input before anything else runs. So the connections of one event loop can all read through one buffer
    (`_share_read_buffer`), and an idle connection holds none. uvloop has its own transport and ignores this.
    """
    sslproto.SSLProtocol.max_size = size
    init = sslproto.SSLProtocol.__init__
    if getattr(init, "__wrapped__", None) is None:
        sslproto.SSLProtocol.__init__ = _sharing_read_buffer(init)  # type: ignore[method-assign]


_read_buffers = threading.local()


def _sharing_read_buffer(init: Any) -> Any:
    def __init__(self: sslproto.SSLProtocol, loop: Any, *args: Any, **kwargs: Any) -> None:
        init(self, loop, *args, **kwargs)
        _share_read_buffer(self, loop)

    __init__.__wrapped__ = init  # type: ignore[attr-defined]
    __init__.__doc__ = init.__doc__
    return __init__


def _share_read_buffer(protocol: sslproto.SSLProtocol, loop: Any) -> None:
    """Give `protocol` its thread's read buffer of its size in place of its own, on a selector loop only: that is
    the transport whose reads go from `recv_into` to `buffer_updated` without a pause (a proactor loop's overlapped
    reads keep the buffer while other connections read)."""
    own = getattr(protocol, "_ssl_buffer", None)
    if not isinstance(loop, selector_events.BaseSelectorEventLoop) or not isinstance(own, bytearray):
        return
    buffers: dict[int, tuple[bytearray, memoryview]] | None = getattr(_read_buffers, "by_size", None)
    if buffers is None:
        buffers = _read_buffers.by_size = {}
    size = len(own)
    shared = buffers.get(size)
    if shared is None:
        shared = buffers[size] = (own, memoryview(own))
    protocol._ssl_buffer, protocol._ssl_buffer_view = shared  # type: ignore[attr-defined]


def ca_certificates(ca: PathLike) -> list[x509.Certificate]:
    """The certificates of a CA bundle (a file, or a CA folder's `ca.pem`); TlsConfigError names the file."""
    path = _ca_file(ca)
    return _parse_certs(path, _read(path, "CA certificate"), "CA certificate")


def certificates_pem(certs: Iterable[x509.Certificate]) -> bytes:
    """Certificates as PEM, re-encoded one by one: whatever else their file held (a key) is never copied out."""
    return b"".join(cert.public_bytes(serialization.Encoding.PEM) for cert in certs)


def parse_certificates(data: bytes, source: str) -> list[x509.Certificate]:
    """The PEM certificates in `data` (received from `source`, which the error names)."""
    return _parse_certs(Path(source), data, "CA certificate")


def fingerprint(cert: x509.Certificate) -> str:
    """The SHA-256 fingerprint as `openssl x509 -noout -fingerprint -sha256` prints it."""
    return cert.fingerprint(hashes.SHA256()).hex(":").upper()


def issued_by_any(cert: x509.Certificate, cas: Iterable[x509.Certificate]) -> bool:
    """Whether one of `cas` is `cert` itself or signed it directly."""
    return any(cert == ca or _issued_by(cert, ca) for ca in cas)


def certificate_chain(cert: PathLike) -> list[x509.Certificate]:
    """The certificates of a node certificate file, leaf first; TlsConfigError names the file."""
    path = Path(cert)
    return _parse_certs(path, _read(path, "certificate"), "certificate")


def certificate_identity(cert: x509.Certificate) -> PeerIdentity | None:
    """The node identity a peer reads from this certificate in a session."""
    return _identity_from_der(cert.public_bytes(serialization.Encoding.DER))


def read_material(ca: PathLike, cert: PathLike, key: PathLike | None, *, node: str | None = None) -> TlsMaterial:
    """Read the node's TLS files once and check them as `server_context` does (readable, parseable, within their
    validity, the key matching the certificate and private to its owner, the chain issued by a CA of the bundle,
    OpenSSL taking all of it), and, given `node`, that the certificate names that node: peers refuse the sessions
    of one that names another. `key` None: the key is in the certificate file. TlsConfigError names the file."""
    ca_path = _ca_file(ca)
    ca_data = _read(ca_path, "CA certificate")
    cert_path = Path(cert)
    cert_data = _read(cert_path, "certificate")
    key_path = Path(key) if key is not None else cert_path
    key_data = _read(key_path, "key", private=True)
    cas, chain = _check_pems(ca_path, ca_data, cert_path, cert_data, key_path, key_data)
    if node is not None:
        identity = certificate_identity(chain[0])
        if identity is None or identity.name != node:
            named = repr(identity.name) if identity is not None else "no node name"
            raise TlsConfigError(
                f"{cert_path}: the certificate names {named}, not this node ({node!r}, node.name): peers would refuse"
                f" its sessions; issue one with `replicator certs node --name {node}`"
            )
    found = _PEM_KEY_RE.search(key_data)
    assert found is not None  # _check_pems parsed the key
    material = TlsMaterial(
        ca=certificates_pem(cas),
        cert=certificates_pem(chain),
        key=found.group(0),
        ca_path=str(ca_path),
        cert_path=str(cert_path),
        key_path=str(key_path),
    )
    contexts(material)  # what only OpenSSL rejects
    return material


def contexts(material: TlsMaterial) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """The node port's context and the dialling context, as `server_context` and `client_context` make them from
    files, made from `material`. A context holds what it was made with: a reload makes new ones, and the sessions
    made with the old ones go on with them."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED and check_hostname by default
    with _pem_file(material.cert + material.key) as path:
        for context in (server, client):
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            try:
                context.load_verify_locations(cadata=material.ca.decode("ascii", errors="replace"))
            except ssl.SSLError as exc:
                raise TlsConfigError(
                    f"{material.ca_path}: OpenSSL rejects the CA certificate: {exc.reason or exc}"
                ) from None
            try:
                context.load_cert_chain(path)
            except (ssl.SSLError, OSError) as exc:
                detail = getattr(exc, "reason", None) or exc.strerror or exc
                raise TlsConfigError(
                    f"{material.cert_path}: OpenSSL rejects the certificate or its key {material.key_path}: {detail}"
                ) from None
    server.verify_mode = ssl.CERT_OPTIONAL
    server.num_tickets = SESSION_TICKETS
    return server, client


@contextlib.contextmanager
def _pem_file(data: bytes) -> Iterator[str]:
    """A path OpenSSL can read `data` from, as it loads a certificate and its key from files only: an anonymous
    memory file (memfd), which no other process can open and which never reaches a disk; where there is none, a
    temporary file of mode 0600, removed at once."""
    fd = _memory_file()
    if fd is not None:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            yield f"/proc/self/fd/{fd}"
        finally:
            os.close(fd)
        return
    handle, name = tempfile.mkstemp(prefix=".replicator-tls-", suffix=".pem")
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
        yield name
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


def _memory_file() -> int | None:
    create = getattr(os, "memfd_create", None)
    if create is None or not os.path.isdir("/proc/self/fd"):
        return None
    try:
        return int(create("replicator-tls", getattr(os, "MFD_CLOEXEC", 0)))
    except OSError:
        return None


def _check_files(ca: PathLike, cert: PathLike | None, key: PathLike | None) -> str:
    """Read and cross-check the files up front, because OpenSSL's own errors name neither the file nor the
    cause; returns the CA bundle as text."""
    ca_path = _ca_file(ca)
    ca_data = _read(ca_path, "CA certificate")
    if cert is None:
        _check_bundle(ca_path, _parse_certs(ca_path, ca_data, "CA certificate"))
    else:
        cert_path = Path(cert)
        key_path = Path(key) if key is not None else cert_path
        _check_pems(
            ca_path,
            ca_data,
            cert_path,
            _read(cert_path, "certificate"),
            key_path,
            _read(key_path, "key", private=True),
        )
    return ca_data.decode("ascii", errors="replace")


def _check_bundle(ca_path: Path, cas: list[x509.Certificate]) -> list[x509.Certificate]:
    """The CAs of the bundle valid now. An expired CA left in a bundle during a rotation is harmless; a bundle with
    no valid CA is not."""
    valid_cas = [ca_cert for ca_cert in cas if _is_valid_now(ca_cert)]
    if not valid_cas:
        _check_validity(ca_path, cas[0], "CA certificate")
    return valid_cas


def _check_pems(
    ca_path: Path, ca_data: bytes, cert_path: Path, cert_data: bytes, key_path: Path, key_data: bytes
) -> tuple[list[x509.Certificate], list[x509.Certificate]]:
    """The checks of `_check_files` on the files' bytes; the CA bundle and the certificate chain."""
    cas = _parse_certs(ca_path, ca_data, "CA certificate")
    valid_cas = _check_bundle(ca_path, cas)
    chain = _parse_certs(cert_path, cert_data, "certificate")
    _check_validity(cert_path, chain[0], "certificate")
    private_key = _parse_key(key_path, key_data)
    if _public_der(private_key.public_key()) != _public_der(chain[0].public_key()):
        raise TlsConfigError(f"{key_path}: the key does not match the certificate {cert_path}")
    _check_issued(cert_path, chain, ca_path, valid_cas)
    return cas, chain


def _load_into(context: ssl.SSLContext, ca: PathLike, ca_pem: str, cert: PathLike | None, key: PathLike | None) -> None:
    # The checks above make these failures unlikely; they remain for what only OpenSSL rejects.
    try:
        context.load_verify_locations(cadata=ca_pem)
    except ssl.SSLError as exc:
        raise TlsConfigError(f"{_ca_file(ca)}: OpenSSL rejects the CA certificate: {exc.reason or exc}") from None
    if cert is None:
        return
    try:
        if key is None:
            context.load_cert_chain(cert)
        else:
            context.load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as exc:
        detail = getattr(exc, "reason", None) or exc.strerror or exc
        raise TlsConfigError(f"{cert}: OpenSSL rejects the certificate or its key {key}: {detail}") from None


def peer_identity(source: Any) -> PeerIdentity | None:
    """The identity in the peer's certificate, or None when there is none.

    `source` is what asyncio/aiohttp expose: the `ssl_object` extra info (an SSLObject or SSLSocket), the DER
    bytes of `getpeercert(binary_form=True)`, or the `peercert` dict. The name is the CN (the first DNS SAN
    when there is no CN) and must be a valid node name. The identity is only as trustworthy as the
    verification of the session it came from: an SSL object whose context verifies nothing yields None, and
    DER bytes are taken as verified.
    """
    if source is None:
        return None
    if isinstance(source, bytes | bytearray | memoryview):
        return _identity_from_der(bytes(source))
    if isinstance(source, Mapping):
        return _identity_from_peercert(source)
    getpeercert = getattr(source, "getpeercert", None)
    if getpeercert is None:
        raise TypeError(f"cannot read a peer certificate from {type(source).__name__}")
    context = getattr(source, "context", None)
    if isinstance(context, ssl.SSLContext) and context.verify_mode == ssl.CERT_NONE:
        return None
    try:
        der = getpeercert(binary_form=True)
    except ValueError:  # handshake not done yet
        return None
    return _identity_from_der(der) if der else None


@functools.lru_cache(maxsize=256)
def _identity_from_der(der: bytes) -> PeerIdentity | None:
    """The identity a DER certificate names. Cached by its bytes: a worker's link carries every database's stream
    with the same peer certificate, and each stream's handshake reads it (parsing it was 2 % of a worker's CPU in a
    restart with 500 databases). The answer depends on the bytes only, and PeerIdentity is frozen."""
    try:
        cert = x509.load_der_x509_certificate(der)
    except ValueError:
        return None
    common_names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if common_names:
        value = common_names[0].value
        name = value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value
    else:
        try:
            san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        except (x509.ExtensionNotFound, ValueError):
            return None
        dns_names = san.get_values_for_type(x509.DNSName)
        if not dns_names:
            return None
        name = dns_names[0]
    return _identity(name, cert.serial_number, cert.not_valid_before_utc.timestamp())


def _identity_from_peercert(peercert: Mapping[str, Any]) -> PeerIdentity | None:
    name = next(
        (value for rdn in peercert.get("subject", ()) for key, value in rdn if key == "commonName"),
        None,
    )
    if name is None:
        name = next((value for kind, value in peercert.get("subjectAltName", ()) if kind == "DNS"), None)
    serial = peercert.get("serialNumber")
    if name is None or not isinstance(serial, str):
        return None
    try:
        number = int(serial, 16)
        not_before = float(ssl.cert_time_to_seconds(peercert["notBefore"])) if "notBefore" in peercert else 0.0
    except (ValueError, TypeError):
        return None
    return _identity(name, number, not_before)


def _identity(name: str, serial: int, not_before: float = 0.0) -> PeerIdentity | None:
    # A name that cannot be a node name cannot be a peer (and must not reach log fields or metric labels).
    if not NAME_RE.match(name):
        return None
    return PeerIdentity(name=name, serial=format(serial, "x"), not_before=not_before)


def _load_ca(cert_path: Path, key_path: Path) -> tuple[x509.Certificate, CertificateIssuerPrivateKeyTypes]:
    cert = _parse_certs(cert_path, _read(cert_path, "CA certificate"), "CA certificate")[0]
    key = _parse_key(key_path, _read(key_path, "CA key"))
    if _public_der(key.public_key()) != _public_der(cert.public_key()):
        raise TlsConfigError(f"{key_path}: the CA key does not match the CA certificate {cert_path}")
    _check_validity(cert_path, cert, "CA certificate")
    try:
        constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        constraints = None
    if constraints is None or not constraints.ca:
        raise TlsConfigError(f"{cert_path}: not a CA certificate (basicConstraints CA:TRUE missing)")
    if not isinstance(key, _ISSUER_KEY_TYPES):
        raise TlsConfigError(f"{key_path}: a {type(key).__name__} cannot sign certificates")
    return cert, key


def key_mode_refused(mode: int, owner: int) -> bool:
    """Whether a private key file of this mode and owner (uid) is refused: open to group or others
    (`KEY_REFUSED_BITS`), except a root-owned key readable by its group (`ROOT_KEY_REFUSED_BITS`)."""
    return bool(mode & (ROOT_KEY_REFUSED_BITS if owner == 0 else KEY_REFUSED_BITS))


def _read(path: Path, what: str, *, private: bool = False) -> bytes:
    """The file's bytes. `private`: it holds a private key, refused when `key_mode_refused`; the mode checked is that
    of the file read (fstat of the open file, the target of a symbolic link), not of a name."""
    try:
        with path.open("rb") as file:
            if private:
                info = os.fstat(file.fileno())
                mode = stat.S_IMODE(info.st_mode)
                # Not a regular file (a directory): the read below says what is wrong with it.
                if stat.S_ISREG(info.st_mode) and key_mode_refused(mode, info.st_uid):
                    raise TlsConfigError(
                        f"{path}: the private key has mode {mode:04o}, open to group or others; a key must be readable"
                        f" by its owner only: chmod 600 {path}"
                    )
            data = file.read(MAX_PEM_BYTES + 1)
    except FileNotFoundError:
        raise TlsConfigError(f"{path}: {what} file not found") from None
    except IsADirectoryError:
        raise TlsConfigError(f"{path}: is a directory, expected the {what} file") from None
    except OSError as exc:
        raise TlsConfigError(f"{path}: cannot read the {what}: {exc.strerror}") from None
    if len(data) > MAX_PEM_BYTES:
        raise TlsConfigError(f"{path}: larger than {MAX_PEM_BYTES} bytes, not a {what} file")
    return data


def _parse_certs(path: Path, data: bytes, what: str) -> list[x509.Certificate]:
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError:
        raise TlsConfigError(f"{path}: not a PEM {what} (expected -----BEGIN CERTIFICATE-----)") from None
    if not certs:
        raise TlsConfigError(f"{path}: no certificate in the file")
    return certs


def _parse_key(path: Path, data: bytes) -> Any:
    match = _PEM_KEY_RE.search(data)
    if match is None:
        raise TlsConfigError(f"{path}: no PEM private key in the file (expected -----BEGIN ... PRIVATE KEY-----)")
    try:
        return serialization.load_pem_private_key(match.group(0), password=None)
    except TypeError:
        raise TlsConfigError(f"{path}: the private key is encrypted; an unencrypted key is required") from None
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise TlsConfigError(f"{path}: unreadable private key: {exc}") from None


def _is_valid_now(cert: x509.Certificate) -> bool:
    return cert.not_valid_before_utc <= dt.datetime.now(dt.UTC) <= cert.not_valid_after_utc


def _check_validity(path: Path, cert: x509.Certificate, what: str) -> None:
    now = dt.datetime.now(dt.UTC)
    if now > cert.not_valid_after_utc:
        raise TlsConfigError(f"{path}: the {what} expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC")
    if now < cert.not_valid_before_utc:
        raise TlsConfigError(
            f"{path}: the {what} is not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC"
            " (is the clock right?)"
        )


def _check_issued(cert_path: Path, chain: list[x509.Certificate], ca_path: Path, cas: list[x509.Certificate]) -> None:
    """The chain in the certificate file (leaf first, then any intermediates) ends at a CA of the bundle; a
    node certificate from another cluster's CA would otherwise only show up as handshake failures at peers."""
    for child, parent in itertools.pairwise(chain):
        if not _issued_by(child, parent):
            raise TlsConfigError(f"{cert_path}: the certificates in the file do not form a chain")
    last = chain[-1]
    if any(last == ca or _issued_by(last, ca) for ca in cas):
        return
    raise TlsConfigError(f"{cert_path}: not issued by the cluster CA in {ca_path}")


def _issued_by(child: x509.Certificate, parent: x509.Certificate) -> bool:
    try:
        child.verify_directly_issued_by(parent)
    except (ValueError, TypeError, InvalidSignature, UnsupportedAlgorithm):
        return False
    return True


def _ca_file(ca: PathLike) -> Path:
    path = Path(ca)
    return path / CA_CERT_FILE if path.is_dir() else path


def _public_der(public_key: Any) -> bytes:
    return public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _san_entries(hosts: Iterable[str]) -> list[x509.GeneralName]:
    entries: list[x509.GeneralName] = []
    for host in hosts:
        entry = host_san(host)
        if entry not in entries:
            entries.append(entry)
    return entries


def host_san(host: str) -> x509.GeneralName:
    """The SAN entry for a host: an IP address for an IP literal (brackets allowed), else a DNS name.

    Raises ValueError for anything that is neither.
    """
    text = host.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    try:
        return x509.IPAddress(ipaddress.ip_address(text))
    except ValueError:
        pass
    if len(text) > 253 or not _HOST_RE.match(text):
        raise ValueError(f"{host!r} is neither a host name nor an IP address")
    return x509.DNSName(text.lower().rstrip("."))


def _key_usage(
    *, digital_signature: bool = False, key_cert_sign: bool = False, crl_sign: bool = False
) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=digital_signature,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=key_cert_sign,
        crl_sign=crl_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _authority_key_identifier(ca_cert: x509.Certificate) -> x509.AuthorityKeyIdentifier:
    try:
        ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    except x509.ExtensionNotFound:
        return x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key())  # type: ignore[arg-type]
    return x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski)


def _signature_hash(key: Any) -> hashes.SHA256 | None:
    # EdDSA keys hash internally and refuse an explicit algorithm.
    if isinstance(key, ed25519.Ed25519PrivateKey | ed448.Ed448PrivateKey):
        return None
    return hashes.SHA256()


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _check_days(days: int) -> None:
    if days < 1:
        raise ValueError(f"validity must be at least 1 day, got {days}")


def _make_dir(path: PathLike) -> Path:
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out}: exists and is not a directory")
    # Only a directory created here gets 0700; an existing one is the operator's to manage.
    out.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    return out


def _refuse_existing_key(key_path: Path) -> None:
    if key_path.exists():
        raise FileExistsError(f"{key_path}: a key already exists; refusing to overwrite it (remove it first)")


def _same_file(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve()


def _write_file(path: Path, data: bytes, mode: int, *, replace: bool) -> None:
    """Write through a temporary file in the same folder, so a reader never sees a partial file.

    mkstemp creates the file 0600 with O_EXCL, so a key is never readable by others, not even empty. Without
    `replace`, the final name is taken with link(), which fails if it exists, closing the race between the
    existence check and the write.
    """
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as file:
            os.fchmod(file.fileno(), mode)
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            _link_new(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    _sync_dir(path.parent)


def _link_new(tmp: Path, path: Path) -> None:
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise FileExistsError(f"{path}: already exists; refusing to overwrite it (remove it first)") from None
    except OSError as exc:
        # Some filesystems have no hard links; fall back to a checked rename.
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS):
            raise
        if path.exists():
            raise FileExistsError(f"{path}: already exists; refusing to overwrite it (remove it first)") from None
        os.rename(tmp, path)


def _sync_dir(directory: Path) -> None:
    # Makes the rename durable; best effort, as not every platform lets a directory be opened.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)
