"""Certificate revocations signed by the cluster CA.

`replicator certs revoke` signs a revocation with the CA key; `PUT /nodes/{name}/revocations` stores it in the
registry (the `revocations` table of the system database), and it replicates like any record. Every process
verifies the CA's signature before honouring one, so no node can revoke another on its own, and a revocation is
never removed: a tombstone under its id, or a value that is not a revocation of that id the CA signed, is refused
when a peer sends it.

A revocation is signed again (`sign_again`, `replicator certs resign`) when the CA rotates: the same id, another
signature, so that it still counts, and a node trusting only the new CA takes it, once the old CA leaves the bundles.

A revocation names a node and either one certificate serial, or (no serial) every certificate of that name issued
before the revocation was signed: the node is re-admitted with a certificate issued afterwards. "Issued" is read
from the certificate's start of validity, which `replicator certs node` sets 5 minutes before it issues one (for
clocks that lag): a certificate whose validity starts more than 5 minutes before the revocation is revoked.
Certificate times have a precision of one second, so one issued within the revocation's second is revoked too.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, padding, rsa

from replicator.shared.config import NAME_RE
from replicator.shared.tls import PeerIdentity, _load_ca, ca_paths

TABLE = "revocations"
BACKDATE = 300.0  # seconds: how far before its issue a certificate of `replicator certs node` becomes valid


class Revocation(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    serial: str = (
        ""  # hex, as PeerIdentity has it; "" revokes every certificate of `name` issued before `issued_before`
    )
    issued_before: float  # seconds since the epoch: when the revocation was signed
    signature: str  # base64 of the CA's signature over `payload()`

    @property
    def record_id(self) -> str:
        return f"{self.name}.{self.serial or 'all'}.{int(self.issued_before)}"

    def payload(self) -> bytes:
        return msgspec.msgpack.encode(("replicator-revocation", self.name, self.serial, self.issued_before))

    def revokes(self, identity: PeerIdentity) -> bool:
        if identity.name != self.name:
            return False
        if self.serial:
            return identity.serial == self.serial
        # Certificates start their validity BACKDATE before they are issued (shared.tls): one issued after the
        # revocation starts less than that before it.
        return identity.not_before + BACKDATE < self.issued_before

    def describe(self) -> str:
        what = f"serial {self.serial}" if self.serial else "every certificate issued before the revocation"
        return f"{self.name}: {what}"


class BadRevocation(ValueError):
    """A revocation that does not parse, or whose signature is not the cluster CA's."""


_decoder = msgspec.json.Decoder(Revocation)
_msgpack_decoder = msgspec.msgpack.Decoder(Revocation)


def sign_data(key: Any, data: bytes) -> bytes:
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return key.sign(data, ec.ECDSA(hashes.SHA256()))
    if isinstance(key, rsa.RSAPrivateKey):
        return key.sign(data, padding.PKCS1v15(), hashes.SHA256())
    if isinstance(key, ed25519.Ed25519PrivateKey | ed448.Ed448PrivateKey):
        return key.sign(data)
    raise BadRevocation(f"a CA key of type {type(key).__name__} cannot sign revocations")


def verify_data(public: Any, signature: bytes, data: bytes) -> None:
    if isinstance(public, ec.EllipticCurvePublicKey):
        public.verify(signature, data, ec.ECDSA(hashes.SHA256()))
    elif isinstance(public, rsa.RSAPublicKey):
        public.verify(signature, data, padding.PKCS1v15(), hashes.SHA256())
    elif isinstance(public, ed25519.Ed25519PublicKey | ed448.Ed448PublicKey):
        public.verify(signature, data)
    else:
        raise InvalidSignature()


def sign(ca_dir: str | Path, name: str, serial: str = "", now: float | None = None) -> Revocation:
    """A revocation of `name` (one serial, or every certificate issued until now), signed with the CA key."""
    if not NAME_RE.match(name):
        raise BadRevocation(f"bad node name {name!r}")
    serial = serial.lower().removeprefix("0x")
    if serial and not all(c in "0123456789abcdef" for c in serial):
        raise BadRevocation(f"bad serial {serial!r}: hexadecimal digits expected")
    cert_path, key_path = ca_paths(ca_dir)
    _, key = _load_ca(cert_path, key_path)
    unsigned = Revocation(name=name, serial=serial, issued_before=now if now is not None else time.time(), signature="")
    return msgspec.structs.replace(unsigned, signature=base64.b64encode(sign_data(key, unsigned.payload())).decode())


CA = x509.Certificate | Sequence[x509.Certificate]  # the cluster CA: one, or every one of a bundle (a rotation)


def sign_again(found: Revocation, ca_dir: str | Path) -> Revocation:
    """`found` signed with another CA key (a CA rotation): the same node, serial and time, so the same id; stored, it
    replaces the one signed by the CA that leaves the bundles, and revokes exactly what that one did."""
    return sign(ca_dir, found.name, found.serial, now=found.issued_before)


def signing_ca(ca_dir: str | Path) -> x509.Certificate:
    """The CA certificate of a CA folder whose key can sign revocations (TlsConfigError naming the file otherwise)."""
    cert, _ = _load_ca(*ca_paths(ca_dir))
    return cert


def signed_by(found: Revocation, ca: CA) -> x509.Certificate | None:
    """The CA of the bundle whose key signed `found`, or None."""
    for authority in authorities(ca):
        try:
            verify(found, authority)
        except BadRevocation:
            continue
        return authority
    return None


def authorities(ca: CA) -> list[x509.Certificate]:
    return [ca] if isinstance(ca, x509.Certificate) else list(ca)


def verify(revocation: Revocation, ca: CA) -> Revocation:
    """The revocation itself if the cluster CA (any CA of the bundle) signed it; BadRevocation otherwise."""
    if not NAME_RE.match(revocation.name):
        raise BadRevocation(f"bad node name {revocation.name[:70]!r}")
    try:
        signature = base64.b64decode(revocation.signature, validate=True)
    except ValueError:
        raise BadRevocation(f"revocation of {revocation.name}: the signature is not base64") from None
    for authority in authorities(ca):
        try:
            verify_data(authority.public_key(), signature, revocation.payload())
        except (InvalidSignature, ValueError):
            continue
        return revocation
    raise BadRevocation(f"revocation of {revocation.name}: not signed by the cluster CA")


def parse(data: bytes, ca: CA) -> Revocation:
    """A revocation from its JSON document (what `certs revoke` prints), verified."""
    try:
        revocation = _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise BadRevocation(f"not a revocation document: {exc}") from None
    return verify(revocation, ca)


def encode(revocation: Revocation) -> bytes:
    """The record value stored in the registry."""
    return msgspec.msgpack.encode(revocation)


def from_record(record_id: str, value: bytes, ca: CA) -> Revocation:
    """A stored revocation, verified, and checked against the id it is stored under."""
    try:
        revocation = _msgpack_decoder.decode(value)
    except msgspec.DecodeError as exc:
        raise BadRevocation(f"revocation {record_id[:80]!r} does not decode: {exc}") from None
    verify(revocation, ca)
    if revocation.record_id != record_id:
        raise BadRevocation(f"revocation {record_id[:80]!r} is stored under the wrong id")
    return revocation


def refusal(entries: list[Any], ca: CA | None) -> str | None:
    """Why a peer's entries for the system database must be refused, if they touch a revocation: none may be
    removed, and each must be one the cluster CA signed, under its own id."""
    for entry in entries:
        if entry.table != TABLE:
            continue
        if entry.tombstone:
            return f"revocation {entry.id[:80]!r}: a revocation is never removed"
        if ca is None:
            return "revocations are not accepted here: no CA certificate to verify them"
        try:
            from_record(entry.id, entry.value, ca)
        except BadRevocation as exc:
            return str(exc)
    return None


def load_ca_cert(path: str | Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(Path(path).read_bytes())


def load_ca_certs(path: str | Path) -> list[x509.Certificate]:
    """Every certificate of the CA bundle at `path` (during a CA rotation, the old and the new)."""
    return x509.load_pem_x509_certificates(Path(path).read_bytes())


def stored(db: Any, ca: CA, on_bad: Any = None) -> list[Revocation]:
    """Every revocation the system database `db` holds that the cluster CA signed; `on_bad(reason)` hears of the
    others (which were refused when a peer sent them, so only a hand-edited file holds any)."""
    found: list[Revocation] = []
    after: str | None = None
    while True:
        page = db.scan(TABLE, after, 1000, skip_damaged=True)
        for entry in page:
            try:
                found.append(from_record(entry.id, entry.value, ca))
            except BadRevocation as exc:
                if on_bad is not None:
                    on_bad(str(exc))
        if len(page) < 1000:
            return found
        after = page[-1].id


def revoked_by(revocations: list[Revocation], identity: PeerIdentity) -> str | None:
    """Why `identity`'s certificate may not be used, if one of `revocations` revokes it."""
    for found in revocations:
        if found.revokes(identity):
            return f"certificate of {identity.name} (serial {identity.serial}) is revoked: {found.describe()}"
    return None
