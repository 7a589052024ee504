"""Certificates made by hand for the tests of what a node refuses and accepts at a reload: shapes `replicator certs`
never makes (expired, without key identifiers), and the bad files an operator may install by mistake."""

from __future__ import annotations

import datetime as dt
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from replicator.shared.tls import KEY_MODE, host_san, issue_node_cert


def hand_made(
    ca_dir: Path,
    name: str,
    out: Path,
    *,
    hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
    valid_from: dt.timedelta = dt.timedelta(days=-1),
    valid_until: dt.timedelta = dt.timedelta(days=1),
    key_identifiers: bool = True,
) -> tuple[Path, Path]:
    """A node certificate signed by the CA in `ca_dir`, valid from now + `valid_from` to now + `valid_until`, with or
    without subject and authority key identifiers: `out`/NAME.pem and `out`/NAME.key (mode 0600)."""
    ca_cert = x509.load_pem_x509_certificate((ca_dir / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((ca_dir / "ca.key").read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now + valid_from)
        .not_valid_after(now + valid_until)
        .add_extension(x509.SubjectAlternativeName([host_san(h) for h in (name, *hosts)]), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
    )
    if key_identifiers:
        builder = builder.add_extension(
            x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
        ).add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),  # type: ignore[arg-type]
            critical=False,
        )
    cert = builder.sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    out.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = out / f"{name}.pem", out / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.unlink(missing_ok=True)
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, KEY_MODE)
    pkcs8 = serialization.PrivateFormat.PKCS8
    with os.fdopen(fd, "wb") as file:
        file.write(key.private_bytes(serialization.Encoding.PEM, pkcs8, serialization.NoEncryption()))
    return cert_path, key_path


def install(source: Path, target: Path, mode: int | None = None) -> None:
    """Put `source` in place of `target` in one rename, as an operator's `install` does: a reader sees the old file
    or the new one, never half of it."""
    staged = target.with_name(f".{target.name}.new")
    shutil.copyfile(source, staged)
    os.chmod(staged, mode if mode is not None else os.stat(target).st_mode & 0o777 if target.exists() else 0o644)
    os.replace(staged, target)


# What an operator may install by mistake over a node's files, each with the words the refusal names it by.
# Each breaker gets (the CA folder, the node's name, its certificate file, its key file, the CA bundle file, a scratch
# folder) and breaks one thing.
Breaker = Callable[[Path, str, Path, Path, Path, Path], None]


def _missing(ca: Path, name: str, cert: Path, key: Path, bundle: Path, scratch: Path) -> None:
    cert.unlink()


def _key_of_another(ca: Path, name: str, cert: Path, key: Path, bundle: Path, scratch: Path) -> None:
    _, other_key = issue_node_cert(ca, name, ["127.0.0.1"], scratch / "other")
    install(other_key, key, 0o600)


def _expired(ca: Path, name: str, cert: Path, key: Path, bundle: Path, scratch: Path) -> None:
    old_cert, old_key = hand_made(
        ca, name, scratch / "expired", valid_from=dt.timedelta(days=-30), valid_until=dt.timedelta(days=-1)
    )
    install(old_key, key, 0o600)
    install(old_cert, cert)


def _another_name(ca: Path, name: str, cert: Path, key: Path, bundle: Path, scratch: Path) -> None:
    other_cert, other_key = issue_node_cert(ca, "someone_else", ["127.0.0.1"], scratch / "named")
    install(other_key, key, 0o600)
    install(other_cert, cert)


def _not_pem(ca: Path, name: str, cert: Path, key: Path, bundle: Path, scratch: Path) -> None:
    (scratch / "garbage.pem").write_bytes(b"this is not a certificate\n")
    install(scratch / "garbage.pem", cert)


def _bundle_not_pem(ca: Path, name: str, cert: Path, key: Path, bundle: Path, scratch: Path) -> None:
    garbage = b"-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n"
    (scratch / "garbage-ca.pem").write_bytes(garbage)
    install(scratch / "garbage-ca.pem", bundle)


def _key_readable_by_others(ca: Path, name: str, cert: Path, key: Path, bundle: Path, scratch: Path) -> None:
    os.chmod(key, 0o644)


BAD_FILES: dict[str, tuple[Breaker, str]] = {
    "missing": (_missing, "certificate file not found"),
    "key of another certificate": (_key_of_another, "the key does not match the certificate"),
    "expired": (_expired, "the certificate expired on"),
    "another node's name": (_another_name, "the certificate names 'someone_else', not this node"),
    "not PEM": (_not_pem, "not a PEM certificate"),
    "CA bundle not PEM": (_bundle_not_pem, "not a PEM CA certificate"),
    "key readable by others": (_key_readable_by_others, "open to group or others"),
}
