"""Signed membership: who may write which registry row.

The registry lives in the system database and replicates like any record, so a row is only worth what proves
who wrote it. Every row carries the certificate of the node that wrote it (DER) and that node's signature over
the row's content, its table, its id, the version it was written at and its origin:

- `nodes/{name}`: a node's own row, written by the node itself (origin == name == the certificate's name). Only
  the node can change its URL, databases, flags and what it holds.
- `introductions/{name}`: an operator's `PUT /nodes/{name}` on some node X, signed by X (origin == the
  certificate's name == X). It lets the cluster admit and dial a node that has not written its own row yet. A
  node's own row always wins over an introduction of it, whatever their versions.

A row is accepted when its certificate was issued by the cluster CA, names its origin, and signed exactly this
row at exactly this version: a row replayed at another version, moved to another id, or rewritten by anyone
else is refused (`registry_row_refused`). Acceptance depends on the content alone, so every node decides the
same. Removing a row (a tombstone) needs no signature: a removed node's row is deleted by operators on any node,
and a live node writes its own row again at once (the coordinator does, whenever its row is missing or not its
own). Rows signed with a revoked certificate are ignored when the registry is read.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import msgspec
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization

from replicator.shared.config import NAME_RE
from replicator.shared.keys import normalize_url
from replicator.shared.revocation import CA, authorities, sign_data, verify_data
from replicator.shared.store import DamagedRecord, Database, NodeRow, check_name
from replicator.shared.tls import PeerIdentity, issued_by_any, peer_identity
from replicator.shared.wire import Entry

NODES = "nodes"
INTRODUCTIONS = "introductions"
TABLES = (NODES, INTRODUCTIONS)
_CACHE_SIZE = 4096
_PAGE = 1000


class SignedRow(msgspec.Struct, kw_only=True):
    """The stored value of a registry row: the row, the signer's certificate and its signature."""

    row: NodeRow
    cert: bytes  # DER of the signer's certificate
    signature: bytes


class BadRow(ValueError):
    """A registry row that does not decode, or is not signed by the node allowed to write it."""


class _Record(Protocol):
    table: str
    id: str
    value: bytes
    version: int
    origin: str
    tombstone: bool


_decoder = msgspec.msgpack.Decoder(SignedRow)


def payload(table: str, record_id: str, version: int, origin: str, row: NodeRow) -> bytes:
    """The bytes a signer signs: everything that decides what the row means, its place and its version."""
    return msgspec.msgpack.encode(
        (
            "replicator-registry-row",
            table,
            record_id,
            version,
            origin,
            row.name,
            row.url,
            list(row.databases),
            row.replicates,
            row.leader,
            sorted(row.holds),
        )
    )


@dataclass
class Signer:
    """This node's certificate and key, which sign the rows it writes."""

    name: str
    cert_der: bytes
    key: Any

    @classmethod
    def load(cls, name: str, cert_path: str | Path, key_path: str | Path) -> Signer:
        cert = x509.load_pem_x509_certificates(Path(cert_path).read_bytes())[0]
        key = serialization.load_pem_private_key(Path(key_path).read_bytes(), password=None)
        return cls(name=name, cert_der=cert.public_bytes(serialization.Encoding.DER), key=key)

    def sign(self, table: str, row: NodeRow, version: int) -> bytes:
        body = payload(table, row.name, version, self.name, row)
        return msgspec.msgpack.encode(SignedRow(row=row, cert=self.cert_der, signature=sign_data(self.key, body)))


def write(db: Database, signer: Signer, table: str, row: NodeRow) -> int:
    """Write a registry row signed by this node, at a version the signature covers; returns the version."""
    if table not in TABLES:
        raise ValueError(f"not a registry table: {table!r}")
    check_name(row.name, "node")
    if table == NODES and row.name != signer.name:
        raise ValueError(f"node {signer.name!r} cannot write the own row of {row.name!r}")
    return db.put_versioned(table, row.name, lambda version: signer.sign(table, row, version))


@dataclass
class Verified:
    row: NodeRow
    signer: PeerIdentity


@dataclass
class Verifier:
    """Checks registry rows against the cluster CA, remembering what it decided for the newest version of each row.

    Only the newest version of a row is remembered: a node's row lists its databases, so it gets a new version for
    each database the node opens, and remembering every version would hold the square of the databases' count in
    names (tens of MB on a node of a thousand databases). An older version seen again is checked again.
    """

    ca: CA | None  # the cluster CA, or every CA of its bundle
    # (table, id) -> ((version, origin, value), what was decided), least recently used first
    _cache: OrderedDict[tuple[str, str], tuple[tuple[int, str, bytes], Verified | BadRow]] = field(
        default_factory=OrderedDict
    )

    def verify(self, record: _Record) -> Verified:
        """The row and who signed it, or BadRow naming what is wrong."""
        slot = (record.table, record.id)
        stamp = (record.version, record.origin, record.value)
        cached = self._cache.get(slot)
        if cached is not None and cached[0] == stamp:
            found = cached[1]
            self._cache.move_to_end(slot)
        else:
            try:
                found = self._check(record)
            except BadRow as exc:
                found = exc
            if cached is None or record.version >= cached[0][0]:
                self._cache[slot] = (stamp, found)
                self._cache.move_to_end(slot)
                if len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
        if isinstance(found, BadRow):
            raise found
        return found

    def _check(self, record: _Record) -> Verified:
        if self.ca is None:
            raise BadRow("no CA certificate to verify registry rows with")
        if not NAME_RE.match(record.id):
            raise BadRow("the id is not a node name")
        try:
            signed = _decoder.decode(record.value)
        except msgspec.DecodeError as exc:
            raise BadRow(f"not a signed registry row: {exc}") from None
        row = signed.row
        if row.name != record.id:
            raise BadRow(f"the row names {row.name[:70]!r} but is stored under {record.id!r}")
        try:
            normalize_url(row.url)
        except ValueError as exc:
            raise BadRow(f"bad url: {exc}") from None
        try:
            cert = x509.load_der_x509_certificate(signed.cert)
        except ValueError:
            raise BadRow("the signer's certificate does not parse") from None
        if not issued_by_any(cert, authorities(self.ca)):
            raise BadRow("the signer's certificate is not one the cluster CA issued")
        signer = peer_identity(signed.cert)
        if signer is None or signer.name != record.origin:
            named = signer.name if signer else "no node name"
            raise BadRow(f"written as {record.origin!r} but signed with the certificate of {named!r}")
        if record.table == NODES and record.origin != row.name:
            raise BadRow(f"only {row.name!r} may write its own row; {record.origin!r} did")
        body = payload(record.table, record.id, record.version, record.origin, row)
        try:
            verify_data(cert.public_key(), signed.signature, body)
        except (InvalidSignature, ValueError, TypeError):
            raise BadRow(f"the signature of {record.origin!r} does not match this row at this version") from None
        return Verified(row=row, signer=signer)

    def refusals(self, entries: Iterable[_Record]) -> list[tuple[_Record, str]]:
        """The registry entries of a batch for the system database that must not be applied, with why. Removing a
        row needs no signature; every other entry of a registry table must verify."""
        refused: list[tuple[_Record, str]] = []
        for entry in entries:
            if entry.table not in TABLES or entry.tombstone:
                continue
            try:
                self.verify(entry)
            except BadRow as exc:
                refused.append((entry, str(exc)))
        return refused

    def read(
        self, db: Database, revoked: Callable[[PeerIdentity], str | None] | None = None
    ) -> tuple[dict[str, NodeRow], dict[str, int]]:
        """The registry: each node's own row, or an introduction of it when it has none; and the row versions.
        Rows that do not verify, or whose signer's certificate is revoked, are left out."""
        found = self.listing(db, revoked)
        return {name: item[0] for name, item in found.items()}, {name: item[1] for name, item in found.items()}

    def listing(
        self, db: Database, revoked: Callable[[PeerIdentity], str | None] | None = None
    ) -> dict[str, tuple[NodeRow, int, str]]:
        """`read`, with where each row comes from: the node's own row, or an introduction (and by whom)."""
        own: dict[str, tuple[NodeRow, int, str]] = {}
        introduced: dict[str, tuple[NodeRow, int, str]] = {}
        for table, found in ((NODES, own), (INTRODUCTIONS, introduced)):
            after: str | None = None
            while True:
                page = db.scan(table, after, _PAGE, skip_damaged=True)
                for entry in page:
                    try:
                        verified = self.verify(entry)
                    except BadRow:
                        continue
                    if revoked is not None and revoked(verified.signer) is not None:
                        continue
                    source = "own" if table == NODES else f"introduced by {entry.origin}"
                    found[entry.id] = (verified.row, entry.version, source)
                if len(page) < _PAGE:
                    break
                after = page[-1].id
        return {**introduced, **own}

    def own_row(self, db: Database, name: str) -> tuple[NodeRow, bytes] | None:
        """`name`'s own row and the DER certificate that signed it, when the row is there and verifies."""
        try:
            entry = db.get(NODES, name)
        except DamagedRecord:
            return None
        if entry is None:
            return None
        try:
            self.verify(entry)
        except BadRow:
            return None
        signed = _decoder.decode(entry.value)
        return signed.row, signed.cert


def remove(db: Database, name: str) -> bool:
    """Delete `name`'s own row and any introduction of it; False when there was neither."""
    check_name(name, "node")
    removed = [db.delete(table, name) for table in TABLES]
    return any(version is not None for version in removed)


_legacy_decoder = msgspec.msgpack.Decoder(NodeRow)


def legacy_row(record: _Record) -> NodeRow | None:
    """A row written before registry rows were signed (a bare NodeRow), or None."""
    try:
        row = _legacy_decoder.decode(record.value)
    except msgspec.DecodeError:
        return None
    return row if row.name == record.id and NAME_RE.match(row.name) else None


def signed_entry(signer: Signer, table: str, row: NodeRow, version: int) -> Entry:
    """The record a node writes for `row` at `version`, as it travels (tests and tools build peers' rows)."""
    return Entry(table, row.name, signer.sign(table, row, version), version, signer.name)
