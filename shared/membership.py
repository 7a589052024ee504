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

An introduction of a node that has no own row is *pending*: the cluster dials a node nobody has seen. Pending
introductions are capped, per introducer and in all (`IntroductionCaps`): a row beyond a cap is refused like a row
that does not verify (`registry_row_refused`, with the cap as `limit`), by a replication session, anti-entropy and
`PUT /nodes` alike, and the registry as read never holds more of them than the caps (`Verifier.listing`). Unlike
a signature, a cap depends on what the receiver holds, so a row refused for it may be taken later, once an
introduction is removed or its node writes its own row.
"""

from __future__ import annotations

import functools
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator
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

# Pending introductions (of nodes with no own row) one introducer may have, and all of them together. 3,000 from one
# certificate holder stalled a coordinator for 221 s (issue 21): each is a node dialled, routed and shown. An operator
# introduces the nodes it is about to start, and each writes its own row once it runs, so a few are pending at a time;
# these leave room to bring up a large cluster through one node's admin port.
MAX_PENDING_PER_INTRODUCER = 64
MAX_PENDING_INTRODUCTIONS = 256
PER_INTRODUCER = "introductions_per_introducer"  # the caps, as `registry_row_refused` names them (`limit`)
IN_ALL = "introductions"
_NEWEST = 2**63 - 1  # the version of an introduction not written yet: it beats whatever is held


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

    @functools.cached_property
    def identity(self) -> PeerIdentity | None:
        """The identity peers read from this certificate (what a revocation is judged against), parsed once."""
        return peer_identity(self.cert_der)

    @classmethod
    def load(cls, name: str, cert_path: str | Path, key_path: str | Path) -> Signer:
        return cls.of(name, Path(cert_path).read_bytes(), Path(key_path).read_bytes())

    @classmethod
    def of(cls, name: str, cert_pem: bytes, key_pem: bytes) -> Signer:
        """The signer of a certificate chain and its key, as PEM (the first certificate is the node's)."""
        cert = x509.load_pem_x509_certificates(cert_pem)[0]
        key = serialization.load_pem_private_key(key_pem, password=None)
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


def resign(db: Database, signer: Signer, table: str = INTRODUCTIONS) -> list[str]:
    """Write again, signed with `signer`'s certificate, every row of `table` that its node wrote with another one
    (a renewed certificate, one from a new CA); the ids written. A row signed by a certificate of a CA that later
    leaves the bundle would verify nowhere. A node's own row is written again by its coordinator on its own."""
    written = []
    for entry in list(_live(db, table)):
        if entry.origin != signer.name or entry.tombstone:
            continue
        try:
            signed = _decoder.decode(entry.value)
        except msgspec.DecodeError:
            continue
        if signed.cert != signer.cert_der and signed.row.name == entry.id:
            write(db, signer, table, signed.row)
            written.append(entry.id)
    return written


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
        introducers: dict[str, str] = {}
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
                    if table == INTRODUCTIONS:
                        introducers[entry.id] = entry.origin
                if len(page) < _PAGE:
                    break
                after = page[-1].id
        pending = within_caps(
            [(version, name, introducers[name]) for name, (_, version, _) in introduced.items() if name not in own]
        )
        return {**{name: item for name, item in introduced.items() if name in pending}, **own}

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


def within_caps(pending: Iterable[tuple[int, str, str]]) -> set[str]:
    """Of the pending introductions (version, name, introducer), the names the caps admit, the oldest first: what
    the registry shows when a database holds more than the caps (rows written before them, or let in by sessions on
    two workers deciding at once). The same on every node that holds the same rows."""
    admitted: set[str] = set()
    per_introducer: Counter[str] = Counter()
    for _, name, introducer in sorted(pending):
        if len(admitted) >= MAX_PENDING_INTRODUCTIONS:
            break
        if per_introducer[introducer] < MAX_PENDING_PER_INTRODUCER:
            per_introducer[introducer] += 1
            admitted.add(name)
    return admitted


@dataclass(frozen=True)
class CapRefusal:
    limit: str  # PER_INTRODUCER or IN_ALL
    reason: str


class IntroductionCaps:
    """Which introductions a node may store: at most MAX_PENDING_PER_INTRODUCER pending ones (of nodes with no own
    row) per introducer and MAX_PENDING_INTRODUCTIONS in all. Built from what a system database holds (`of`), then
    given a batch's registry rows in order (`take`), so that what the batch itself adds, removes or gives an own
    row counts for the rows after it. A row the store would skip (it loses last-writer-wins to what is held) is
    never refused: refusing it would hold the sender's position below a row that changes nothing."""

    def __init__(self, introductions: dict[str, tuple[int, str, bool]], own: set[str]) -> None:
        # id -> (version, origin, tombstone) of the introductions held, and of the ids asked about
        self._rows = dict(introductions)
        self._own = set(own)
        self._pending: Counter[str] = Counter(
            origin for name, (_, origin, tombstone) in self._rows.items() if not tombstone and name not in self._own
        )
        self._total = sum(self._pending.values())

    @classmethod
    def of(cls, db: Database, names: Iterable[str] = ()) -> IntroductionCaps:
        """The caps as `db` stands, knowing the versions of `names` (the ids a batch introduces) even where only a
        tombstone is held."""
        rows: dict[str, tuple[int, str, bool]] = {}
        for entry in _live(db, INTRODUCTIONS):
            rows[entry.id] = (entry.version, entry.origin, False)
        asked = sorted({name for name in names if name not in rows})
        for start in range(0, len(asked), _PAGE):
            for entry in db.fetch(INTRODUCTIONS, asked[start : start + _PAGE])[0]:
                rows[entry.id] = (entry.version, entry.origin, entry.tombstone)
        return cls(rows, {entry.id for entry in _live(db, NODES)})

    def pending(self, introducer: str) -> int:
        return self._pending[introducer]

    @property
    def total(self) -> int:
        return self._total

    def take(self, entry: _Record) -> CapRefusal | None:
        """Why the registry row `entry` must not be stored, or None; a row that is stored counts from now on."""
        if entry.table == NODES:
            self._own_row(entry.id, present=not entry.tombstone)
            return None
        if entry.table != INTRODUCTIONS:
            return None
        held = self._rows.get(entry.id)
        if held is not None and (entry.version, entry.origin) <= held[:2]:
            return None
        was_pending = held is not None and not held[2] and entry.id not in self._own
        if not entry.tombstone and entry.id not in self._own:
            mine = self._pending[entry.origin] - (
                1 if was_pending and held is not None and held[1] == entry.origin else 0
            )
            total = self._total - (1 if was_pending else 0)
            if mine >= MAX_PENDING_PER_INTRODUCER:
                return CapRefusal(
                    PER_INTRODUCER,
                    f"{entry.origin!r} has introduced {mine} nodes that have no row of their own, the most one node"
                    f" may ({MAX_PENDING_PER_INTRODUCER})",
                )
            if total >= MAX_PENDING_INTRODUCTIONS:
                return CapRefusal(
                    IN_ALL,
                    f"the registry holds {total} introductions of nodes that have no row of their own, the most it"
                    f" takes ({MAX_PENDING_INTRODUCTIONS})",
                )
        if was_pending and held is not None:
            self._pending[held[1]] -= 1
            self._total -= 1
        self._rows[entry.id] = (entry.version, entry.origin, entry.tombstone)
        if not entry.tombstone and entry.id not in self._own:
            self._pending[entry.origin] += 1
            self._total += 1
        return None

    def _own_row(self, name: str, *, present: bool) -> None:
        if present == (name in self._own):
            return
        held = self._rows.get(name)
        introduced = held is not None and not held[2]
        if present:
            self._own.add(name)
        else:
            self._own.discard(name)
        if introduced and held is not None:
            step = -1 if present else 1
            self._pending[held[1]] += step
            self._total += step


def capped(db: Database, entries: Iterable[_Record]) -> list[tuple[_Record, CapRefusal]]:
    """The registry rows among `entries` (a batch for the system database, in order, the rows that do not verify
    left out) that the introduction caps refuse, with the cap and why."""
    rows = [entry for entry in entries if entry.table in TABLES]
    if not any(entry.table == INTRODUCTIONS and not entry.tombstone for entry in rows):
        return []
    caps = IntroductionCaps.of(db, [entry.id for entry in rows if entry.table == INTRODUCTIONS])
    refused: list[tuple[_Record, CapRefusal]] = []
    for entry in rows:
        found = caps.take(entry)
        if found is not None:
            refused.append((entry, found))
    return refused


def room_to_introduce(db: Database, introducer: str, name: str) -> CapRefusal | None:
    """Why `introducer` may not write an introduction of `name` now (`PUT /nodes/{name}`), or None."""
    proposed = Entry(INTRODUCTIONS, name, b"", _NEWEST, introducer)
    return IntroductionCaps.of(db, [name]).take(proposed)


def _live(db: Database, table: str) -> Iterator[Entry]:
    after: str | None = None
    while True:
        page = db.scan(table, after, _PAGE, skip_damaged=True)
        yield from page
        if len(page) < _PAGE:
            return
        after = page[-1].id


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
