"""A backup folder's manifest (`DIR/manifest.json`) and the judgements made of it before a restore.

    DIR/manifest.json            written last, once every file below is complete and fsynced
    DIR/<database>.sqlite        a snapshot of each database (`coordinator.snapshots`), the system database included
    DIR/<database>.blobs/<hash>  the database's blob files, each named by the sha256 of its bytes

A folder without a manifest is not a backup (one cut short never gets one). The manifest names the node, when the
backup began on the node's clock (`time`: every snapshot is at least that recent, so the age judged is never less
than a snapshot's), the versions of the node and of the command, and per database its positions as read from the
snapshot and the size and sha256 of every file.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import msgspec

from replicator.coordinator.snapshots import Position

MANIFEST = "manifest.json"
FORMAT = 1
READ_CHUNK = 1024 * 1024


class FileEntry(msgspec.Struct, frozen=True):
    path: str  # relative to the backup folder
    size: int
    sha256: str


class DatabaseEntry(msgspec.Struct, frozen=True):
    database: str
    taken_at: float
    owner: str
    recovering: bool  # the node's file was itself recovering when it was copied
    positions: list[Position]
    file: FileEntry
    blobs: list[FileEntry] = []


class Manifest(msgspec.Struct, frozen=True):
    format: int
    node: str
    time: float  # the node's wall clock when the backup began, seconds since the epoch
    finished: float  # the command's wall clock when every file was in place
    node_version: str
    version: str  # of the command that wrote it
    databases: list[DatabaseEntry]


class BadBackup(Exception):
    """The folder is not a whole backup: no manifest, one that does not decode, or files that do not match it."""


def write(directory: Path, manifest: Manifest) -> None:
    """Write the manifest durably: to a temporary name, fsynced, renamed, the folder fsynced."""
    temporary = directory / f".{MANIFEST}.tmp"
    with open(temporary, "wb") as file:
        file.write(msgspec.json.format(msgspec.json.encode(manifest), indent=2) + b"\n")
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, directory / MANIFEST)
    sync_folder(directory)


def sync_folder(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read(directory: Path) -> Manifest:
    path = directory / MANIFEST
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise BadBackup(
            f"{directory} is not a backup: it has no {MANIFEST} (a backup cut short never gets one)"
        ) from None
    except OSError as exc:
        raise BadBackup(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        manifest = msgspec.json.decode(data, type=Manifest)
    except msgspec.DecodeError as exc:
        raise BadBackup(f"{path} is not a backup manifest: {exc}") from None
    if manifest.format != FORMAT:
        raise BadBackup(f"{path} has format {manifest.format}; this replicator reads format {FORMAT}")
    for entry in manifest.databases:
        for item in (entry.file, *entry.blobs):
            if Path(item.path).is_absolute() or ".." in Path(item.path).parts:
                raise BadBackup(f"{path} names a file outside the backup: {item.path[:200]!r}")
    return manifest


def file_sha256(path: Path) -> tuple[int, str]:
    hasher = hashlib.sha256()
    size = 0
    with open(path, "rb") as file:
        while chunk := file.read(READ_CHUNK):
            hasher.update(chunk)
            size += len(chunk)
    return size, hasher.hexdigest()


def damaged(directory: Path, manifest: Manifest) -> list[str]:
    """Every file of the manifest that is missing or whose size or sha256 differs, with what is wrong."""
    problems = []
    for entry in manifest.databases:
        for item in (entry.file, *entry.blobs):
            try:
                size, digest = file_sha256(directory / item.path)
            except FileNotFoundError:
                problems.append(f"{item.path}: missing")
                continue
            if size != item.size:
                problems.append(f"{item.path}: {size} bytes, the manifest says {item.size}")
            elif digest != item.sha256:
                problems.append(f"{item.path}: sha256 {digest}, the manifest says {item.sha256}")
    return problems


def too_old(manifest: Manifest, now: float, tombstone_retention: float, max_clock_skew: float) -> str | None:
    """Why restoring the backup now could bring deleted records back (None when it cannot).

    Peers purge a tombstone once it is older than tombstone_retention, by its version, which the deleting node's
    clock stamped up to max_clock_skew behind ours. A delete made after the backup began is not in it; restored,
    the record it deleted comes back unless a peer still holds the tombstone, which is sure only while the backup
    is younger than tombstone_retention less max_clock_skew. A backup from the future (beyond max_clock_skew) is
    refused too: its age cannot be judged."""
    age = now - manifest.time
    limit = tombstone_retention - max_clock_skew
    if age < -max_clock_skew:
        return (
            f"the backup was taken {-age:.0f} s in the future by this machine's clock (more than "
            f"replication.max_clock_skew {max_clock_skew:g} s): its age cannot be judged"
        )
    if age >= limit:
        return (
            f"the backup is {_duration(age)} old and replication.tombstone_retention is"
            f" {_duration(tombstone_retention)} (less max_clock_skew {max_clock_skew:g} s): peers may have purged"
            " the tombstones of records deleted"
            " since it was taken, and restored, those records would come back"
        )
    return None


def _duration(seconds: float) -> str:
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:.1f} days"
    if seconds >= 2 * 3600:
        return f"{seconds / 3600:.1f} hours"
    return f"{seconds:.0f} s"
