"""The TLS material the node presents and trusts: what it loaded at boot or at its latest reload, not the files.

    boot, SIGHUP -> read_material (every check, in the coordinator) -> Credentials, generation n
                 -> ReloadTls(n) to every worker; a worker spawned later starts from generation n (WorkerBoot)
                 <- TlsLoaded(worker, n, serial): what each worker presents now

A reload whose files fail a check changes nothing: the node and every worker keep the generation they have. The
expiry metric, `GET /ca`, revocations and registry signatures all read the loaded generation, so an alert on the
certificate clears when the node presents the new one, not when a file is replaced.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cryptography import x509

from replicator.shared import config as config_module
from replicator.shared import membership, messages
from replicator.shared.config import Config
from replicator.shared.tls import TlsMaterial, certificate_identity, fingerprint, issued_by_any, read_material


def read(config: Config) -> TlsMaterial:
    """The node's TLS files as `config` names them, checked (`read_material`); TlsConfigError names what is wrong."""
    tls = config.tls
    return read_material(
        config_module.resolve_path(config, tls.ca),
        config_module.resolve_path(config, tls.cert),
        config_module.resolve_path(config, tls.key),
        node=config.node.name,
    )


@dataclass
class Credentials:
    """One load of the node's TLS files, parsed once: generation 1 at boot, one more for each reload that changed
    what the files hold."""

    material: TlsMaterial
    generation: int
    loaded_at: float  # wall clock, seconds since the epoch
    chain: list[x509.Certificate] = field(init=False)
    cas: list[x509.Certificate] = field(init=False)

    def __post_init__(self) -> None:
        self.chain = self.material.chain()
        self.cas = self.material.authorities()

    @property
    def certificate(self) -> x509.Certificate:
        return self.chain[0]

    @property
    def serial(self) -> str:
        return format(self.certificate.serial_number, "x")

    def issuers(self) -> list[x509.Certificate]:
        """The CAs of the bundle that issued the node's chain (a CA re-issued with the same key signs the same)."""
        return [ca for ca in self.cas if any(issued_by_any(cert, [ca]) for cert in self.chain)]

    def signer(self, name: str) -> membership.Signer:
        """What signs this node's registry rows: its certificate and key."""
        return membership.Signer.of(name, self.material.cert, self.material.key)

    def boot(self, config: bytes) -> bytes:
        """A worker's start (`messages.WorkerBoot`) with this material."""
        return messages.encode_boot(
            messages.WorkerBoot(config=config, tls=self.material, tls_generation=self.generation)
        )

    def changes(self, previous: Credentials) -> list[str]:
        """Which of the files' contents differ from `previous`: "ca", "cert", "key"."""
        old, new = previous.material, self.material
        return [part for part in ("ca", "cert", "key") if getattr(old, part) != getattr(new, part)]

    def describe(self, workers: dict[int, messages.TlsLoaded]) -> dict[str, Any]:
        """`/status` "tls": the certificate the node presents, the CAs it trusts, and what each worker presents."""
        cert = self.certificate
        identity = certificate_identity(cert)
        return {
            "generation": self.generation,
            "loaded_at": self.loaded_at,
            "certificate": {
                "name": identity.name if identity is not None else None,
                "serial": self.serial,
                "issuer": cert.issuer.rfc4514_string(),
                "not_after": cert.not_valid_after_utc.timestamp(),
                "fingerprint": fingerprint(cert),
                "file": self.material.cert_path,
            },
            "cas": [
                {
                    "subject": ca.subject.rfc4514_string(),
                    "not_after": ca.not_valid_after_utc.timestamp(),
                    "fingerprint": fingerprint(ca),
                }
                for ca in self.cas
            ],
            "ca_file": self.material.ca_path,
            "workers": {
                str(slot): {"generation": report.generation, "serial": report.serial, "error": report.error or None}
                for slot, report in sorted(workers.items())
            },
        }
