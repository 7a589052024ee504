"""What the clients of a data-plane test were told, and the check every such test ends with.

A `Ledger` writes through the data API and remembers every acknowledged write and delete with its version. The
check then asks every node for every record: an acknowledged write must be there at its version with its value, or
superseded by a higher version; an acknowledged delete must have left the record absent, or superseded by a higher
version (a later write). Nothing acknowledged may be lost, and no delete undone. A ledger that sees `every_write`
takes a higher version for a write again, which must hold what the acknowledged operation left: an older value
reasserted above it is a lost write, a record live above its delete a delete undone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from replicator.coordinator.local_cluster import LocalCluster


@dataclass
class Acknowledged:
    version: int
    value: Any  # None for a delete


@dataclass
class Ledger:
    cluster: LocalCluster
    database: str
    table: str = "t"
    # Per record id, the newest acknowledged operation (a later one supersedes an earlier one on the same record).
    acked: dict[str, Acknowledged] = field(default_factory=dict)
    # Every write to the database goes through this ledger (or `note`): a version above the newest acknowledged one
    # is then one a node wrote again (`own_writes.this_life`, `Database.reassert`), and must hold what that
    # operation left (its value; a delete stays deleted). Without it, a higher version is taken for a later write.
    every_write: bool = False

    async def put(self, node: str, record_id: str, value: Any) -> int:
        status, body = await self.cluster.data(node, "PUT", f"/data/{self.database}/{self.table}/{record_id}", value)
        assert status == 200, (node, record_id, status, body)
        self._note(record_id, Acknowledged(body["version"], value))
        return int(body["version"])

    async def delete(self, node: str, record_id: str) -> int:
        status, body = await self.cluster.data(node, "DELETE", f"/data/{self.database}/{self.table}/{record_id}")
        assert status == 200, (node, record_id, status, body)
        self._note(record_id, Acknowledged(body["version"], None))
        return int(body["version"])

    def note(self, record_id: str, version: int, value: Any) -> None:
        """A write acknowledged by a request the test made itself (`value` None for a delete)."""
        self._note(record_id, Acknowledged(version, value))

    def _note(self, record_id: str, ack: Acknowledged) -> None:
        held = self.acked.get(record_id)
        if held is None or ack.version > held.version:
            self.acked[record_id] = ack

    async def problems(self, names: list[str] | None = None) -> list[str]:
        """Every acknowledged operation some node does not reflect, described; [] when all hold."""
        found = []
        for name in names or list(self.cluster.nodes):
            for record_id, ack in sorted(self.acked.items()):
                path = f"/data/{self.database}/{self.table}/{record_id}"
                status, body = await self.cluster.data(name, "GET", path)
                if status == 404:
                    if ack.value is not None:
                        found.append(f"{name}: {record_id} acknowledged at {ack.version} is missing")
                    continue
                if status != 200:
                    found.append(f"{name}: {record_id}: HTTP {status} {body}")
                elif body["version"] < ack.version:
                    what = "deleted" if ack.value is None else f"written {ack.value!r}"
                    found.append(
                        f"{name}: {record_id} {what} at {ack.version} but holds {body['value']!r} at {body['version']}"
                    )
                elif body["version"] == ack.version and body["value"] != ack.value:
                    found.append(f"{name}: {record_id} at {ack.version} holds {body['value']!r}, not {ack.value!r}")
                elif self.every_write and body["version"] > ack.version and body["value"] != ack.value:
                    what = "deleted" if ack.value is None else f"written {ack.value!r}"
                    found.append(
                        f"{name}: {record_id} {what} at {ack.version}, written again as {body['value']!r} at"
                        f" {body['version']} (no client wrote it)"
                    )
        return found

    async def check(self, names: list[str] | None = None) -> None:
        problems = await self.problems(names)
        assert problems == [], "\n".join(problems)
