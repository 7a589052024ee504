"""`replicator restore --from DIR --config FILE`: put a backup (`replicator backup`) in place of a stopped node's data.

In this order, stopping at the first refusal with its reason, before anything is changed:

1. the config loads and names the node the backup is of (exit 2 otherwise);
2. the manifest is whole (exit 2 otherwise: not a backup, or one cut short);
3. the backup is young enough (`backup_manifest.too_old`: older than replication.tombstone_retention, deleted
   records would come back) unless `--force` (exit 2 otherwise);
   every file matches its size and sha256 (exit 1 otherwise: a damaged backup);
4. no node runs on node.data_dir (`shared.data_lock`, held until the restore ends; exit 2 otherwise).

Then whatever the data directory holds is moved aside to `<data_dir>.before-restore-<time>` beside it (an operator's
data is never deleted), and each database file is copied in under a temporary name, marked restored
(`shared.store.mark_restored`), fsynced and renamed into place, its blobs beside it. The node judges the marked files
when it opens them (`shared.own_writes.restore`): its own writes count complete only as far as the backup held them,
peers serve back everything newer, and anti-entropy never reasserts an older value of its own over a newer one.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from replicator.coordinator import backup_manifest
from replicator.coordinator.backup_manifest import BadBackup
from replicator.shared import config as config_module
from replicator.shared.config import ConfigError, load
from replicator.shared.data_lock import LOCK_FILE, DataDirInUse, DataLock
from replicator.shared.store import mark_restored

EXIT_FAILED = 1
EXIT_USAGE = 2


class Refused(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def cmd_restore(
    source: str, config_path: str, *, force: bool = False, as_json: bool = False, wall: Callable[[], float] = time.time
) -> int:
    try:
        summary = restore(Path(source), config_path, force=force, wall=wall)
    except Refused as exc:
        print(f"replicator restore: {exc}", file=sys.stderr)
        return exc.code
    if as_json:
        print(json.dumps(summary, indent=2, sort_keys=True))
    else:
        moved = f"; what was there is in {summary['moved_aside']}" if summary["moved_aside"] else ""
        print(
            f"restored {len(summary['databases'])} databases of node {summary['node']} into {summary['data_dir']}"
            f" (backup of {summary['backup_time_iso']}){moved}. Start the node: it takes what is newer back from its"
            " peers."
        )
    return 0


def restore(source: Path, config_path: str, *, force: bool, wall: Callable[[], float]) -> dict[str, Any]:
    try:
        config = load(config_path)
    except ConfigError as exc:
        raise Refused(str(exc), EXIT_USAGE) from None
    try:
        manifest = backup_manifest.read(source)
    except BadBackup as exc:
        raise Refused(str(exc), EXIT_USAGE) from None
    if manifest.node != config.node.name:
        raise Refused(
            f"{source} is a backup of node {manifest.node!r}; {config_path} is node {config.node.name!r}"
            " (a node is restored only from its own backups; a new node copies from a running one: replicator clone)",
            EXIT_USAGE,
        )
    now = wall()
    replication = config.replication
    reason = backup_manifest.too_old(manifest, now, replication.tombstone_retention, replication.max_clock_skew)
    if reason is not None and not force:
        raise Refused(
            f"refused: {reason}. Take a newer backup, or restore this one with --force and delete those records"
            " again afterwards",
            EXIT_USAGE,
        )
    problems = backup_manifest.damaged(source, manifest)
    if problems:
        listed = "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
        raise Refused(f"{source} is damaged: {listed}", EXIT_FAILED)
    data_dir = config_module.data_dir(config)
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        lock = DataLock.take(data_dir)
    except DataDirInUse as exc:
        raise Refused(f"{exc}: stop it first (a restore replaces the files it has open)", EXIT_USAGE) from None
    except OSError as exc:
        raise Refused(f"cannot use the data directory {data_dir}: {exc.strerror or exc}", EXIT_FAILED) from None
    with lock:
        try:
            aside = _move_aside(data_dir, now)
            for entry in manifest.databases:
                _put_in_place(source, data_dir, entry.file.path, f"{entry.database}.sqlite", manifest.time)
                for blob in entry.blobs:
                    _copy(source / blob.path, data_dir / blob.path)
                if entry.blobs:
                    backup_manifest.sync_folder((data_dir / entry.blobs[0].path).parent)
            backup_manifest.sync_folder(data_dir)
        except OSError as exc:
            raise Refused(f"the restore into {data_dir} failed: {exc}", EXIT_FAILED) from None
    return {
        "node": manifest.node,
        "data_dir": str(data_dir),
        "backup_time": manifest.time,
        "backup_time_iso": _iso(manifest.time),
        "forced": reason is not None,
        "refusal_overridden": reason,
        "moved_aside": str(aside) if aside is not None else None,
        "databases": [entry.database for entry in manifest.databases],
    }


def _move_aside(data_dir: Path, now: float) -> Path | None:
    """Move everything the data directory holds (but its lock) into a new folder beside it; the folder, or None
    when there was nothing."""
    entries = [entry for entry in data_dir.iterdir() if entry.name != LOCK_FILE]
    if not entries:
        return None
    stamp = datetime.fromtimestamp(now, UTC).strftime("%Y%m%dT%H%M%SZ")
    aside = data_dir.with_name(f"{data_dir.name}.before-restore-{stamp}")
    suffix = 0
    while aside.exists():
        suffix += 1
        aside = data_dir.with_name(f"{data_dir.name}.before-restore-{stamp}.{suffix}")
    aside.mkdir()
    for entry in entries:
        os.rename(entry, aside / entry.name)
    backup_manifest.sync_folder(aside)
    backup_manifest.sync_folder(data_dir)
    return aside


def _put_in_place(source: Path, data_dir: Path, relative: str, name: str, taken_at: float) -> None:
    temporary = data_dir / f".{name}.restoring"
    _copy(source / relative, temporary)
    mark_restored(temporary, taken_at)
    os.replace(temporary, data_dir / name)


def _copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(source, "rb") as reading, open(target, "wb") as writing:
        shutil.copyfileobj(reading, writing, 1024 * 1024)
        writing.flush()
        os.fsync(writing.fileno())


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds")
