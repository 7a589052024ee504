"""Signed membership: a node's own registry row is worth something only if that node signed it, at that version;
introductions never beat an own row; and a node refuses, and supersedes, records claiming its origin that it never
wrote."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from replicator.shared import membership, revocation
from replicator.shared.membership import INTRODUCTIONS, NODES, BadRow, Signer, Verifier, signed_entry
from replicator.shared.store import Database, NodeRow, Store
from replicator.shared.tls import PeerIdentity, create_ca, issue_node_cert, peer_identity
from replicator.shared.wire import Entry
from replicator.workers.antientropy import Round, local_transport

V = 1_700_000_000_000_000  # a version: microseconds since the epoch


@pytest.fixture
def ca(tmp_path: Path) -> Path:
    create_ca(tmp_path / "ca")
    return tmp_path / "ca"


def _signer(ca: Path, name: str, out: Path) -> Signer:
    cert, key = issue_node_cert(ca, name, ["127.0.0.1"], out / name)
    return Signer.load(name, cert, key)


@pytest.fixture
def signers(ca: Path, tmp_path: Path) -> dict[str, Signer]:
    return {name: _signer(ca, name, tmp_path) for name in ("a", "b", "mallet")}


@pytest.fixture
def verifier(ca: Path) -> Verifier:
    return Verifier(revocation.load_ca_cert(ca / "ca.pem"))


@pytest.fixture
def system(tmp_path: Path) -> Iterator[Database]:
    with Store(tmp_path / "data", "a") as store:
        yield store.database("system", create=True)


def _row(name: str, url: str = "", **fields: object) -> NodeRow:
    return NodeRow(name=name, url=url or f"wss://127.0.0.1:{9000 + len(name)}", **fields)  # type: ignore[arg-type]


def _reason(verifier: Verifier, entry: Entry) -> str:
    with pytest.raises(BadRow) as refused:
        verifier.verify(entry)
    return str(refused.value)


def test_a_row_counts_only_as_signed_by_its_node_at_its_version(
    verifier: Verifier, signers: dict[str, Signer], ca: Path, tmp_path: Path
) -> None:
    b, mallet = signers["b"], signers["mallet"]
    good = signed_entry(b, NODES, _row("b", holds=["main"]), V)
    assert verifier.verify(good).row.holds == ["main"]
    assert verifier.verify(good).signer.name == "b"

    # Another node's row, signed by the writer itself: the writer may not write b's own row.
    forged = Entry(NODES, "b", mallet.sign(NODES, _row("b", url="wss://127.0.0.1:1"), V), V, "mallet")
    assert "only 'b' may write its own row" in _reason(verifier, forged)
    # ... nor pretend to be b: the origin must be the certificate's name.
    assert "signed with the certificate of 'mallet'" in _reason(verifier, msgspec.structs.replace(forged, origin="b"))
    # A genuine row replayed at a newer version (to undo a later one) or moved under another id.
    assert "does not match" in _reason(verifier, msgspec.structs.replace(good, version=V + 1))
    assert "stored under" in _reason(verifier, msgspec.structs.replace(good, id="c"))
    # Its content changed after signing.
    signed = msgspec.msgpack.decode(good.value, type=membership.SignedRow)
    altered = msgspec.structs.replace(signed, row=_row("b", holds=["main", "evil"]))
    assert "does not match" in _reason(verifier, msgspec.structs.replace(good, value=msgspec.msgpack.encode(altered)))
    # Signed with a certificate another CA issued, under the right name.
    create_ca(tmp_path / "other")
    stranger = _signer(tmp_path / "other", "b", tmp_path / "other-certs")
    assert "not one the cluster CA issued" in _reason(verifier, signed_entry(stranger, NODES, _row("b"), V))
    # Rows from before signing, and junk.
    legacy = Entry(NODES, "b", msgspec.msgpack.encode(_row("b")), V, "b")
    assert "not a signed registry row" in _reason(verifier, legacy)
    assert membership.legacy_row(legacy) == _row("b")
    assert "not a signed registry row" in _reason(verifier, Entry(NODES, "b", b"\xc1", V, "b"))
    # Without the CA nothing verifies.
    assert "no CA certificate" in _reason(Verifier(None), good)


def test_a_batch_loses_only_its_bad_registry_rows(verifier: Verifier, signers: dict[str, Signer]) -> None:
    b, mallet = signers["b"], signers["mallet"]
    good = signed_entry(b, NODES, _row("b"), V)
    forged = Entry(NODES, "a", mallet.sign(NODES, _row("a"), V), V, "mallet")
    intro = signed_entry(mallet, INTRODUCTIONS, _row("zed"), V)
    removal = Entry(NODES, "b", b"", V + 5, "mallet", tombstone=True)
    other = Entry("revocations_not", "x", b"\xc0", V, "mallet")
    refused = verifier.refusals([good, forged, intro, removal, other])
    assert [(entry.id, "only 'a' may write its own row" in reason) for entry, reason in refused] == [("a", True)]


def test_the_registry_prefers_own_rows_and_drops_revoked_signers(
    verifier: Verifier, signers: dict[str, Signer], system: Database, ca: Path
) -> None:
    a, b, mallet = signers["a"], signers["b"], signers["mallet"]
    # a introduces c and b; b's own row is older than a's introduction of it, and still wins.
    system.apply_batch([signed_entry(b, NODES, _row("b", url="wss://127.0.0.1:2222", holds=["main"]), V)])
    version_c = membership.write(system, a, INTRODUCTIONS, _row("c", url="wss://127.0.0.1:3333"))
    membership.write(system, a, INTRODUCTIONS, _row("b", url="wss://127.0.0.1:1"))
    membership.write(system, a, NODES, _row("a", holds=["main"]))
    system.apply_batch([signed_entry(mallet, INTRODUCTIONS, _row("m2"), V)])
    with pytest.raises(ValueError, match="cannot write the own row"):
        membership.write(system, a, NODES, _row("b"))

    listing = verifier.listing(system)
    assert {name: (row.url, source) for name, (row, _, source) in listing.items()} == {
        "a": ("wss://127.0.0.1:9001", "own"),
        "b": ("wss://127.0.0.1:2222", "own"),
        "c": ("wss://127.0.0.1:3333", "introduced by a"),
        "m2": ("wss://127.0.0.1:9002", "introduced by mallet"),
    }
    rows, versions = verifier.read(system)
    assert rows["c"].url == "wss://127.0.0.1:3333"
    assert versions["c"] == version_c and versions["b"] == V
    assert verifier.own_row(system, "b") is not None and verifier.own_row(system, "c") is None

    # Revoking mallet's certificate (by name) takes out what it signed.
    signed = revocation.sign(ca, "mallet", now=2e9)

    def revoked(identity: PeerIdentity) -> str | None:
        return revocation.revoked_by([signed], identity)

    assert "m2" not in verifier.read(system, revoked)[0]
    assert peer_identity(mallet.cert_der) is not None

    assert membership.remove(system, "b")
    assert set(verifier.read(system)[0]) == {"a", "c", "m2"}
    assert not membership.remove(system, "b")


def test_reassert_supersedes_what_was_claimed_under_our_origin(system: Database) -> None:
    system.put("t", "live", b"\x01")
    system.put("t", "gone", b"\x02")
    system.delete("t", "gone")
    far = max(e.version for e in system.origin_entries("a", 0, 10)) + 10_000_000
    written = system.reassert("t", [("live", far), ("gone", far), ("absent", far)])
    assert written == 3
    live, gone, absent = (_held(system, "t", key) for key in ("live", "gone", "absent"))
    assert live[:3] == (b"\x01", "a", False) and live[3] > far
    assert gone[1:3] == ("a", True) and gone[3] > far
    assert absent[1:3] == ("a", True) and absent[3] > far
    assert system.reassert("t", []) == 0


def _held(db: Database, table: str, record_id: str) -> tuple[bytes, str, bool, int]:
    entry = next(e for e in db.fetch(table, [record_id])[0] if e.id == record_id)
    return entry.value, entry.origin, entry.tombstone, entry.version


async def test_antientropy_supersedes_records_forged_under_our_origin(tmp_path: Path) -> None:
    with Store(tmp_path / "a", "a") as ours, Store(tmp_path / "m", "mallet") as theirs:
        mine, peer = ours.database("d", create=True), theirs.database("d", create=True)
        mine.put("t", "k", msgspec.msgpack.encode("mine"))
        peer.apply_batch(mine.origin_entries("a", 0, 10))
        held = mine.origin_entries("a", 0, 10)[0]
        # The peer rewrites our record under our origin at a newer version, and at our very version.
        mine.put("t", "same", msgspec.msgpack.encode("mine"))
        same = mine.origin_entries("a", held.version, 10)[0]
        peer.apply_batch(
            [
                Entry("t", "k", msgspec.msgpack.encode("forged"), held.version + 5_000_000, "a"),
                Entry("t", "same", msgspec.msgpack.encode("forged, and a higher checksum"), same.version, "a"),
            ]
        )
        result = await Round(mine, local_transport(peer), rate=0).run()
        assert result.error == "" and result.foreign == 2 and result.reasserted == 2
        # Nothing forged was taken; ours was written again above the forgery, and goes back out.
        assert _held(mine, "t", "k")[0] == msgspec.msgpack.encode("mine")
        assert _held(mine, "t", "k")[3] > held.version + 5_000_000
        assert _held(mine, "t", "same")[0] == msgspec.msgpack.encode("mine")
        peer.apply_batch(mine.origin_entries("a", same.version, 10))
        assert mine.digest() == peer.digest()
        assert (await Round(mine, local_transport(peer), rate=0).run()).foreign == 0


async def test_antientropy_takes_back_records_of_ours_the_file_lost(tmp_path: Path) -> None:
    """A record under our origin that this node does not hold at all may be one its file lost: it comes back."""
    with Store(tmp_path / "a", "a") as ours, Store(tmp_path / "b", "b") as theirs:
        mine, peer = ours.database("d", create=True), theirs.database("d", create=True)
        mine.put("t", "k", msgspec.msgpack.encode("mine"))
        peer.apply_batch(mine.origin_entries("a", 0, 10))
        with mine._write() as conn:  # lost behind the node's back
            conn.execute("DELETE FROM records WHERE id = 'k'")
        result = await Round(mine, local_transport(peer), rate=0).run()
        assert result.foreign == 0 and result.repaired == 1
        assert _held(mine, "t", "k")[0] == msgspec.msgpack.encode("mine")
        assert mine.digest() == peer.digest()


async def test_a_newer_write_of_ours_that_the_file_lost_is_pulled_not_superseded(tmp_path: Path) -> None:
    """Our file lost its newest version of a record and took an older one from a stale peer: the audit log shows
    the newer version a peer holds under our origin is ours, so it comes back instead of being written over."""
    with Store(tmp_path / "a", "a") as ours, Store(tmp_path / "b", "b") as theirs:
        mine, peer = ours.database("d", create=True), theirs.database("d", create=True)
        mine.put("t", "k", msgspec.msgpack.encode("first"))
        old = mine.origin_entries("a", 0, 10)[0]
        mine.put("t", "k", msgspec.msgpack.encode("second"))
        peer.apply_batch(mine.origin_entries("a", 0, 10))
        with mine._write() as conn:  # lost behind the node's back ...
            conn.execute("DELETE FROM records WHERE id = 'k'")
        mine.apply_batch([old])  # ... and the older version came back from a peer that had not seen the newer
        result = await Round(mine, local_transport(peer), rate=0).run()
        assert result.foreign == 0 and result.reasserted == 0 and result.repaired == 1
        assert _held(mine, "t", "k")[0] == msgspec.msgpack.encode("second")
        assert mine.digest() == peer.digest()


def test_every_ca_of_a_bundle_counts_during_a_rotation(ca: Path, tmp_path: Path) -> None:
    create_ca(tmp_path / "new-ca")
    bundle = [revocation.load_ca_cert(ca / "ca.pem"), revocation.load_ca_cert(tmp_path / "new-ca" / "ca.pem")]
    old, new = _signer(ca, "b", tmp_path / "old"), _signer(tmp_path / "new-ca", "c", tmp_path / "new")
    verifier = Verifier(bundle)
    assert verifier.verify(signed_entry(old, NODES, _row("b"), V)).signer.name == "b"
    assert verifier.verify(signed_entry(new, NODES, _row("c"), V)).signer.name == "c"
    assert "not one the cluster CA issued" in _reason(Verifier(bundle[:1]), signed_entry(new, NODES, _row("c"), V))
    signed = revocation.sign(tmp_path / "new-ca", "b", now=2e9)
    assert revocation.verify(signed, bundle) == signed
    with pytest.raises(revocation.BadRevocation, match="not signed by the cluster CA"):
        revocation.verify(signed, bundle[:1])


def test_the_verifier_remembers_the_newest_version_of_each_row_only(
    verifier: Verifier, signers: dict[str, Signer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node's row gets a new version for each database it opens: remembering every version would hold the
    square of the databases' count in names. The newest is remembered; an older one seen again is checked again."""
    checked: list[int] = []
    real = Verifier._check

    def counted(self: Verifier, record: Entry) -> membership.Verified:
        checked.append(record.version)
        return real(self, record)

    monkeypatch.setattr(Verifier, "_check", counted)
    versions = [
        signed_entry(signers["b"], NODES, _row("b", holds=[f"db{i}" for i in range(n)]), V + n) for n in range(50)
    ]
    for entry in versions:
        verifier.verify(entry)
    assert len(verifier._cache) == 1
    assert verifier.verify(versions[-1]).row.holds == [f"db{i}" for i in range(49)]
    assert checked == [V + n for n in range(50)]  # the newest again: remembered
    assert verifier.verify(versions[3]).row.holds == ["db0", "db1", "db2"]  # an old one: checked again, still good
    assert checked[-1] == V + 3
    # A forged newer version is refused, and the genuine row still verifies.
    forged = msgspec.structs.replace(versions[-1], version=V + 99)
    assert "does not match" in _reason(verifier, forged)
    assert verifier.verify(versions[-1]).signer.name == "b"
    assert len(verifier._cache) == 1


# -- introduction caps (issue 21: 3,000 introductions of nodes that do not exist stalled a coordinator) --------------


def _intro(name: str, origin: str, version: int = V, tombstone: bool = False) -> Entry:
    return Entry(INTRODUCTIONS, name, b"" if tombstone else b"\xc0", version, origin, tombstone)


def _own(name: str, version: int = V, tombstone: bool = False) -> Entry:
    return Entry(NODES, name, b"" if tombstone else b"\xc0", version, name, tombstone)


def test_pending_introductions_are_capped_per_introducer_and_in_all() -> None:
    caps = membership.IntroductionCaps({}, set())
    per = membership.MAX_PENDING_PER_INTRODUCER
    assert [caps.take(_intro(f"g{i}", "mallet")) for i in range(per)] == [None] * per
    refused = caps.take(_intro("g-over", "mallet"))
    assert refused is not None and refused.limit == membership.PER_INTRODUCER
    assert f"'mallet' has introduced {per} nodes" in refused.reason
    assert caps.pending("mallet") == per
    # Rewriting one of its own introductions takes no new place; an older version of it loses and counts nothing.
    assert caps.take(_intro("g5", "mallet", V + 1)) is None
    assert caps.take(_intro("g5", "mallet", V - 1)) is None
    assert caps.pending("mallet") == per
    # An own row ends an introduction's pending, and a removed introduction frees its place.
    assert caps.take(_own("g6")) is None
    assert caps.take(_intro("g-a", "mallet")) is None
    assert caps.take(_intro("g-b", "mallet")) is not None
    assert caps.take(_intro("g7", "mallet", V + 1, tombstone=True)) is None
    assert caps.take(_intro("g-b", "mallet")) is None
    # An introduction of a node with an own row is never refused: it shows nothing the own row does not.
    assert caps.take(_intro("g6", "mallet", V + 2)) is None
    # The own row removed, its introduction is pending again; a removal is never refused, even past the cap.
    assert caps.take(_own("g6", V + 3, tombstone=True)) is None
    assert caps.pending("mallet") == per + 1
    # Another node's introduction of one of mallet's moves the place from mallet to it.
    assert caps.take(_intro("g8", "b", V + 5)) is None
    assert (caps.pending("mallet"), caps.pending("b")) == (per, 1)
    # In all: every introducer may be within its own cap and the registry full.
    total = membership.MAX_PENDING_INTRODUCTIONS
    fill = [f"n{i}" for i in range(total - caps.total)]
    for index, name in enumerate(fill):
        assert caps.take(_intro(name, f"x{index // per}")) is None
    assert caps.total == total
    refused = caps.take(_intro("one-more", "newcomer"))
    assert refused is not None and refused.limit == membership.IN_ALL and f"({total})" in refused.reason


def test_a_batch_is_judged_against_the_database_and_its_own_rows(system: Database) -> None:
    per = membership.MAX_PENDING_PER_INTRODUCER
    system.apply_batch([_intro(f"g{i}", "mallet", V + i) for i in range(per)])
    assert membership.room_to_introduce(system, "mallet", "g-new") is not None
    assert membership.room_to_introduce(system, "mallet", "g3") is None  # rewriting one it holds
    assert membership.room_to_introduce(system, "a", "g-new") is None
    batch = [_intro("g-first", "mallet", V + 100), _own("g0", V + 101), _intro("g-second", "mallet", V + 102)]
    assert [(entry.id, cap.limit) for entry, cap in membership.capped(system, batch)] == [
        ("g-first", membership.PER_INTRODUCER)
    ]
    # A row that loses to a removal held here changes nothing: never refused, whatever the count.
    system.apply_batch([_intro("g1", "mallet", V + 200, tombstone=True), _intro("g-late", "mallet", V + 201)])
    assert membership.capped(system, [_intro("g1", "mallet", V + 150)]) == []
    assert [entry.id for entry, _ in membership.capped(system, [_intro("g1", "mallet", V + 250)])] == ["g1"]
    # A batch without introductions costs no read.
    assert membership.capped(system, [_own("zed")]) == []


def test_the_registry_as_read_never_holds_more_introductions_than_the_caps(
    verifier: Verifier, signers: dict[str, Signer], system: Database
) -> None:
    """Rows written before the caps (or let in by two workers deciding at once) are not taken: the oldest are."""
    mallet, b = signers["mallet"], signers["b"]
    per = membership.MAX_PENDING_PER_INTRODUCER
    rows = [signed_entry(mallet, INTRODUCTIONS, _row(f"g{i:03d}"), V + 1000 - i) for i in range(per + 10)]
    rows.append(signed_entry(mallet, INTRODUCTIONS, _row("b"), V))  # b has its own row: not pending
    rows.append(signed_entry(b, NODES, _row("b"), V))
    system.apply_batch(rows)
    listing = verifier.listing(system)
    introduced = sorted(name for name, (_, _, source) in listing.items() if source == "introduced by mallet")
    # The oldest versions are the highest indexes.
    assert introduced == sorted(f"g{i:03d}" for i in range(10, per + 10))
    assert listing["b"][2] == "own"
    assert membership.within_caps([(V, "x", "i1"), (V - 1, "y", "i1")]) == {"x", "y"}


def test_a_session_refuses_introductions_past_the_caps_holds_its_position_and_logs_a_few_lines(
    verifier: Verifier, signers: dict[str, Signer], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import io
    import json
    from types import SimpleNamespace

    from replicator.shared.logs import EventLog
    from replicator.workers import session
    from replicator.workers.counters import Counters

    stream = io.StringIO()
    monkeypatch.setattr(session, "log", EventLog(stream, burst=5, window=10.0))
    mallet = signers["mallet"]
    per = membership.MAX_PENDING_PER_INTRODUCER
    with Store(tmp_path / "node", "a") as store:
        store.database("system", create=True)
        ctx = SimpleNamespace(verifier=verifier, counters=Counters(), store=store)
        entries = [signed_entry(mallet, INTRODUCTIONS, _row(f"ghost{i}"), V + i) for i in range(per + 300)]
        entries.append(signed_entry(mallet, NODES, _row("mallet"), V + 5000))
        marks = {"mallet": V + 5000}
        refused_below: dict[str, int] = {}
        kept, held = session.refuse_registry_rows(ctx, "mallet", entries, marks, refused_below)  # type: ignore[arg-type]
        assert [entry.id for entry in kept] == [f"ghost{i}" for i in range(per)] + ["mallet"]
        # Not past the first refused row: the next session is served from below it again.
        assert held == {"mallet": V + per - 1} and refused_below == {"mallet": V + per - 1}
        lines = [json.loads(line) for line in stream.getvalue().splitlines()]
        assert [line["event"] for line in lines] == ["registry_row_refused"] * 5
        assert {line["limit"] for line in lines} == {membership.PER_INTRODUCER}
        (delta,) = ctx.counters.drain()
        assert delta.value == 300


def test_a_new_certificate_signs_again_the_introductions_its_node_wrote(
    signers: dict[str, Signer], system: Database, ca: Path, tmp_path: Path
) -> None:
    """After a reload with a renewed certificate (or one of a new CA), the node's introductions are written again with
    it (the coordinator's `_take_credentials`): one left signed by a certificate of a CA that leaves the bundle would
    verify nowhere. The node's own row is left to its coordinator; other nodes' rows are not its to sign."""
    a, b = signers["a"], signers["b"]
    membership.write(system, a, INTRODUCTIONS, _row("c", url="wss://127.0.0.1:3333"))
    membership.write(system, a, NODES, _row("a"))
    system.apply_batch([signed_entry(b, INTRODUCTIONS, _row("d"), V)])
    assert membership.resign(system, a) == []  # the same certificate: nothing to do
    create_ca(tmp_path / "new-ca")
    renewed = _signer(tmp_path / "new-ca", "a", tmp_path / "renewed")
    before = {entry.id: entry.version for entry in system.scan(INTRODUCTIONS, None, 100)}
    assert membership.resign(system, renewed) == ["c"]
    both = Verifier([revocation.load_ca_cert(ca / "ca.pem"), revocation.load_ca_cert(tmp_path / "new-ca" / "ca.pem")])
    new_only = Verifier(revocation.load_ca_cert(tmp_path / "new-ca" / "ca.pem"))
    c = system.get(INTRODUCTIONS, "c")
    assert c is not None and c.version > before["c"]
    assert new_only.verify(c).row.url == "wss://127.0.0.1:3333"  # signed by the new certificate
    d = system.get(INTRODUCTIONS, "d")
    assert d is not None and d.version == before["d"] and both.verify(d).signer.name == "b"
    own = system.get(NODES, "a")
    assert own is not None and "not one the cluster CA issued" in _reason(new_only, own)
    assert membership.resign(system, renewed) == []
