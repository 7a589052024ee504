"""Certificate revocations signed by the cluster CA.

`replicator certs revoke` signs a revocation with the CA key; `PUT /nodes/{name}/revocations` stores it in the
registry (the `revocations` table of the system database), and it replicates like any record. Every process
verifies the CA's signature before honouring one, so no node can revoke another on its own, and a revocation is
never removed or replaced: a tombstone or a different value under its id is refused when a peer sends it.

A revocation names a node and either one certificate serial, or (no serial) every certificate of that name issued
before the revocation was signed: the node is re-admitted with a certificate issued afterwards. "Issued" is read
from the certificate's start of validity, which `replicator certs node` sets 5 minutes before it issues one (for
clocks that lag): a certificate whose validity starts more than 5 minutes before the revocation is revoked.
Certificate times have a precision of one second, so one issued within the revocation's second is revoked too.
"""

from __future__ import annotations

import base64
import time
from pathlib import Path
from typing import Any

import msgspec
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, padding, rsa

from shared.config import NAME_RE
from shared.tls import PeerIdentity, _load_ca, ca_paths

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


def _sign(key: Any, data: bytes) -> bytes:
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return key.sign(data, ec.ECDSA(hashes.SHA256()))
    if isinstance(key, rsa.RSAPrivateKey):
        return key.sign(data, padding.PKCS1v15(), hashes.SHA256())
    if isinstance(key, ed25519.Ed25519PrivateKey | ed448.Ed448PrivateKey):
        return key.sign(data)
    raise BadRevocation(f"a CA key of type {type(key).__name__} cannot sign revocations")


def _verify(public: Any, signature: bytes, data: bytes) -> None:
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
    return msgspec.structs.replace(unsigned, signature=base64.b64encode(_sign(key, unsigned.payload())).decode())


def verify(revocation: Revocation, ca: x509.Certificate) -> Revocation:
    """The revocation itself if the cluster CA signed it; BadRevocation otherwise."""
    if not NAME_RE.match(revocation.name):
        raise BadRevocation(f"bad node name {revocation.name[:70]!r}")
    try:
        signature = base64.b64decode(revocation.signature, validate=True)
        _verify(ca.public_key(), signature, revocation.payload())
    except (InvalidSignature, ValueError):
        raise BadRevocation(f"revocation of {revocation.name}: not signed by the cluster CA") from None
    return revocation


def parse(data: bytes, ca: x509.Certificate) -> Revocation:
    """A revocation from its JSON document (what `certs revoke` prints), verified."""
    try:
        revocation = _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise BadRevocation(f"not a revocation document: {exc}") from None
    return verify(revocation, ca)


def encode(revocation: Revocation) -> bytes:
    """The record value stored in the registry."""
    return msgspec.msgpack.encode(revocation)


def from_record(record_id: str, value: bytes, ca: x509.Certificate) -> Revocation:
    """A stored revocation, verified, and checked against the id it is stored under."""
    try:
        revocation = _msgpack_decoder.decode(value)
    except msgspec.DecodeError as exc:
        raise BadRevocation(f"revocation {record_id[:80]!r} does not decode: {exc}") from None
    verify(revocation, ca)
    if revocation.record_id != record_id:
        raise BadRevocation(f"revocation {record_id[:80]!r} is stored under the wrong id")
    return revocation


def refusal(entries: list[Any], ca: x509.Certificate | None) -> str | None:
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
