"""Revocations: only the cluster CA's signature counts, and a stored one can be neither removed nor replaced."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from replicator.shared import revocation
from replicator.shared.tls import PeerIdentity, TlsConfigError, create_ca
from replicator.shared.wire import Entry


@pytest.fixture
def ca(tmp_path: Path) -> Path:
    create_ca(tmp_path / "ca")
    return tmp_path / "ca"


def test_only_the_cluster_ca_signs_a_revocation(ca: Path, tmp_path: Path) -> None:
    cert = revocation.load_ca_cert(ca / "ca.pem")
    signed = revocation.sign(ca, "c", "AB12", now=1000.0)
    assert revocation.parse(msgspec.json.encode(signed), cert) == signed
    assert signed.serial == "ab12"
    create_ca(tmp_path / "other")
    forged = revocation.sign(tmp_path / "other", "c", now=1000.0)
    with pytest.raises(revocation.BadRevocation, match="not signed by the cluster CA"):
        revocation.verify(forged, cert)
    altered = msgspec.structs.replace(signed, serial="ab13")
    with pytest.raises(revocation.BadRevocation):
        revocation.verify(altered, cert)
    with pytest.raises(revocation.BadRevocation, match="not a revocation"):
        revocation.parse(b"{]", cert)


def test_what_a_revocation_covers(ca: Path) -> None:
    by_serial = revocation.sign(ca, "c", "ab", now=10_000.0)
    assert by_serial.revokes(PeerIdentity(name="c", serial="ab", not_before=99_999.0))
    assert not by_serial.revokes(PeerIdentity(name="c", serial="ac", not_before=0.0))
    assert not by_serial.revokes(PeerIdentity(name="d", serial="ab", not_before=0.0))
    by_name = revocation.sign(ca, "c", now=10_000.0)
    # Issued (validity start + the 5-minute backdate) before the revocation: revoked; after: admitted again.
    assert by_name.revokes(PeerIdentity(name="c", serial="1", not_before=10_000.0 - 301))
    assert not by_name.revokes(PeerIdentity(name="c", serial="2", not_before=10_000.0 - 299))


def test_a_stored_revocation_can_be_neither_removed_nor_replaced(ca: Path) -> None:
    cert = revocation.load_ca_cert(ca / "ca.pem")
    signed = revocation.sign(ca, "c", now=1000.0)
    good = Entry(revocation.TABLE, signed.record_id, revocation.encode(signed), 5, "a")
    assert revocation.refusal([good, Entry("nodes", "x", b"\xc0", 5, "a")], cert) is None
    removed = Entry(revocation.TABLE, signed.record_id, b"", 6, "evil", True)
    assert "never removed" in (revocation.refusal([removed], cert) or "")
    unsigned = msgspec.structs.replace(signed, signature="AAAA")
    replaced = Entry(revocation.TABLE, signed.record_id, revocation.encode(unsigned), 7, "evil")
    assert "not signed" in (revocation.refusal([replaced], cert) or "")
    moved = Entry(revocation.TABLE, "c.all.1", revocation.encode(signed), 8, "evil")
    assert "wrong id" in (revocation.refusal([moved], cert) or "")
    assert revocation.refusal([good], None) is not None


def test_a_revocation_signed_again_by_a_new_ca_keeps_its_id_and_passes_where_only_the_new_ca_is_trusted(
    ca: Path, tmp_path: Path
) -> None:
    """A CA rotation (`replicator certs resign`): signed again, a revocation is the same record, revokes the same
    certificates, and a node trusting the new CA alone takes it, as it refuses the one the old CA signed."""
    create_ca(tmp_path / "new")
    old, new = revocation.load_ca_cert(ca / "ca.pem"), revocation.signing_ca(tmp_path / "new")
    signed = revocation.sign(ca, "c", now=1000.25)
    again = revocation.sign_again(signed, tmp_path / "new")
    assert again.record_id == signed.record_id == "c.all.1000"
    assert (again.name, again.serial, again.issued_before) == ("c", "", 1000.25)
    assert revocation.signed_by(signed, [old, new]) == old and revocation.signed_by(again, [old, new]) == new
    assert revocation.signed_by(signed, new) is None

    def entry(found: revocation.Revocation) -> Entry:
        return Entry(revocation.TABLE, found.record_id, revocation.encode(found), 5, "a")

    assert "not signed" in (revocation.refusal([entry(signed)], new) or "")
    assert revocation.refusal([entry(again)], new) is None
    identity = PeerIdentity(name="c", serial="ab", not_before=0.0)
    assert signed.revokes(identity) and again.revokes(identity)
    with pytest.raises(TlsConfigError, match=r"ca\.key"):
        (tmp_path / "new" / "ca.key").unlink()
        revocation.signing_ca(tmp_path / "new")
