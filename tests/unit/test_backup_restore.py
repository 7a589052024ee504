"""Backup and restore without a running node: a snapshot of a file being written (`coordinator.snapshots`), how a
restored file is judged when it is opened (`shared.own_writes.restore`), the manifest's refusals
(`coordinator.backup_manifest`) and the data directory's lock (`shared.data_lock`)."""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import sqlite3
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import pytest

from replicator.coordinator import backup_manifest, restore, snapshots
from replicator.coordinator.backup_manifest import DatabaseEntry, FileEntry, Manifest
from replicator.shared.data_lock import DataDirInUse, DataLock
from replicator.shared.store import SYSTEM, Database, Store, mark_restored
from tests.unit.test_store import FakeClock, meta, rec

SKEW = 60.0
DAY = 86400.0


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def node(tmp_path: Path, clock: FakeClock) -> Iterator[Store]:
    with Store(tmp_path / "a", "a", clock=clock, clock_lead=SKEW, holdings=True) as store:
        yield store


def _intact_system(store: Store) -> Database:
    system = store.database(SYSTEM, create=True)
    system.finish_recovery()
    return system


def _snapshot(db: Database, target: Path) -> snapshots.Snapshot:
    return snapshots.take(db.path, target, db.name)


def _restored(store: Store, name: str, copy: Path, taken_at: float) -> Database:
    """Put `copy` in place of database `name` as `replicator restore` does, and open it."""
    store.forget(name)
    for suffix in ("", "-wal", "-shm"):
        Path(f"{store.path(name)}{suffix}").unlink(missing_ok=True)
    mark_restored(copy, taken_at)
    shutil.copyfile(copy, store.path(name))
    return store.database(name)


def test_a_snapshot_holds_one_commit_and_its_positions(node: Store, tmp_path: Path) -> None:
    _intact_system(node)
    db = node.database("d", create=True)
    first = db.put("t", "k1", b"1")
    db.apply_batch([rec("p1", 5, "b")], {"b": 5})
    taken = _snapshot(db, tmp_path / "copy.snapshot")
    db.put("t", "k2", b"2")  # after the snapshot: not in it
    with closing(sqlite3.connect(taken.path)) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
        assert sorted(row[0] for row in conn.execute("SELECT id FROM records")) == ["k1", "p1"]
    assert {p.origin: p.top for p in taken.positions} == {"a": first, "b": 5}
    assert taken.owner == "a" and not taken.recovering
    assert (taken.size, taken.sha256) == backup_manifest.file_sha256(Path(taken.path))


def test_a_restored_file_counts_its_own_writes_only_as_far_as_the_backup_held_them(
    node: Store, clock: FakeClock, tmp_path: Path
) -> None:
    _intact_system(node)
    db = node.database("d", create=True)
    kept = db.put("t", "k1", b"old")
    taken = _snapshot(db, tmp_path / "copy.snapshot")
    clock.advance(5)
    newer = db.put("t", "k1", b"new")  # an update the backup lacks
    lost = db.put("t", "k2", b"2")  # a record the backup lacks
    clock.advance(5)
    restored = _restored(node, "d", Path(taken.path), taken_at=1.0)
    history = restored.own_history()
    # A lost file that kept its data: recovering, complete as far as the backup held, the floor above every write
    # the node can have made (the wall clock plus max_clock_skew), the mark gone.
    assert history.recovering and not history.unknown
    assert history.complete == kept and history.top == kept
    assert history.floor == clock.us + int(SKEW * 1e6) - 1 and history.asks == history.floor
    assert meta(restored, "restored") is None and meta(restored, "born") is None
    # A peer's newer own versions are ones the node may have written: pulled, never reasserted over.
    assert restored.may_have_written("t", [("k1", newer), ("k2", lost)]) == [("k1", newer), ("k2", lost)]
    # A peer claiming the node complete past the backup is no regression: the floor covers it already.
    assert not restored.regress(lost)
    # New writes are above the floor, so peers counting the node complete up to `lost` take them.
    assert restored.put("t", "k3", b"3") > history.floor
    # Opened again (another process, a restart), it is judged once only.
    before = restored.own_history()
    node.forget("d")
    clock.advance(100)
    assert node.database("d").own_history() == before


def test_a_backup_of_a_recovering_file_counts_only_what_peers_confirmed(
    node: Store, clock: FakeClock, tmp_path: Path
) -> None:
    db = node.database("d", create=True)  # the system database is new: an unknown file, recovering
    db.put("t", "k", b"v")
    assert db.own_history().unknown
    taken = _snapshot(db, tmp_path / "copy.snapshot")
    assert taken.recovering
    restored = _restored(node, "d", Path(taken.path), taken_at=1.0)
    history = restored.own_history()
    # No longer unknown (its birth is dropped: its writes are never written again over newer ones), and complete
    # only as far as peers had confirmed: nothing.
    assert history.recovering and not history.unknown and history.born == 0 and history.complete == 0


def test_a_restored_system_database_makes_a_database_absent_from_the_backup_unknown(
    node: Store, tmp_path: Path
) -> None:
    system = _intact_system(node)
    taken = _snapshot(system, tmp_path / "system.snapshot")
    node.database("later", create=True)  # created after the backup
    restored = _restored(node, SYSTEM, Path(taken.path), taken_at=1.0)
    assert restored.own_history().recovering
    # Its own writes coming back from peers are not forgeries of a new name: what the node held is not known.
    assert node.held("later") is None


def _manifest(time: float) -> Manifest:
    return Manifest(
        format=backup_manifest.FORMAT,
        node="a",
        time=time,
        finished=time + 1,
        node_version="1",
        version="1",
        databases=[
            DatabaseEntry(
                database="d",
                taken_at=time,
                owner="a",
                recovering=False,
                positions=[],
                file=FileEntry("d.sqlite", 3, "x"),
            )
        ],
    )


def test_a_backup_older_than_tombstone_retention_less_the_skew_is_too_old() -> None:
    now = 100 * DAY
    assert backup_manifest.too_old(_manifest(now - 7 * DAY + SKEW + 1), now, 7 * DAY, SKEW) is None
    reason = backup_manifest.too_old(_manifest(now - 7 * DAY + SKEW), now, 7 * DAY, SKEW)
    assert reason is not None and "tombstone_retention" in reason and "come back" in reason
    future = backup_manifest.too_old(_manifest(now + SKEW + 1), now, 7 * DAY, SKEW)
    assert future is not None and "future" in future


def test_the_manifest_is_read_back_and_a_damaged_file_named(tmp_path: Path) -> None:
    (tmp_path / "d.sqlite").write_bytes(b"abc")
    size, digest = backup_manifest.file_sha256(tmp_path / "d.sqlite")
    entry = DatabaseEntry("d", 1.0, "a", False, [], FileEntry("d.sqlite", size, digest))
    whole = Manifest(1, "a", 1.0, 2.0, "1", "1", [entry])
    backup_manifest.write(tmp_path, whole)
    assert backup_manifest.read(tmp_path) == whole
    assert backup_manifest.damaged(tmp_path, whole) == []
    (tmp_path / "d.sqlite").write_bytes(b"abd")
    assert backup_manifest.damaged(tmp_path, whole) == [f"d.sqlite: sha256 {_sha(b'abd')}, the manifest says {digest}"]
    with pytest.raises(backup_manifest.BadBackup, match=r"no manifest\.json"):
        backup_manifest.read(tmp_path / "elsewhere")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_the_data_directory_lock_is_held_once(tmp_path: Path) -> None:
    with DataLock.take(tmp_path), pytest.raises(DataDirInUse, match="a node runs on the data directory"):
        DataLock.take(tmp_path)
    DataLock.take(tmp_path).release()  # released: free again


def _config(tmp_path: Path, retention: float) -> Path:
    path = tmp_path / "a.toml"
    path.write_text(
        f"""[node]
name = "a"
url = "wss://127.0.0.1:9925"
data_dir = "{tmp_path / "data"}"
[tls]
ca = "ca.pem"
cert = "a.pem"
key = "a.key"
[replication]
tombstone_retention = {retention}
"""
    )
    return path


def _backup_of(tmp_path: Path, clock: FakeClock, time: float) -> Path:
    """A backup folder of node a holding database d, taken at `time`."""
    with Store(tmp_path / "source", "a", clock=clock, clock_lead=SKEW, holdings=True) as store:
        db = store.database("d", create=True)
        db.put("t", "k", b"v")
        folder = tmp_path / "backup"
        folder.mkdir()
        taken = _snapshot(db, folder / "d.sqlite")
    entry = DatabaseEntry(
        "d", time, "a", taken.recovering, taken.positions, FileEntry("d.sqlite", taken.size, taken.sha256)
    )
    backup_manifest.write(folder, Manifest(1, "a", time, time, "1", "1", [entry]))
    return folder


def test_restore_refuses_a_too_old_backup_with_the_reason_unless_forced(
    tmp_path: Path, clock: FakeClock, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _backup_of(tmp_path, clock, time=1000.0)
    config = _config(tmp_path, retention=3600.0)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "operator-notes.txt").write_text("keep me")
    assert restore.cmd_restore(str(folder), str(config), wall=lambda: 1000.0 + 7200) == restore.EXIT_USAGE
    err = capsys.readouterr().err
    assert "tombstone_retention" in err and "--force" in err
    assert not (tmp_path / "data" / "d.sqlite").exists()  # refused before anything changed
    assert restore.cmd_restore(str(folder), str(config), force=True, wall=lambda: 1000.0 + 7200) == 0
    assert (tmp_path / "data" / "d.sqlite").exists()
    aside = list(tmp_path.glob("data.before-restore-*"))
    assert len(aside) == 1 and (aside[0] / "operator-notes.txt").read_text() == "keep me"
    with closing(sqlite3.connect(tmp_path / "data" / "d.sqlite")) as conn:
        assert conn.execute("SELECT value FROM meta WHERE key = 'restored'").fetchone() == (1000.0,)


def test_restore_refuses_a_running_node_a_damaged_backup_and_another_nodes_backup(
    tmp_path: Path, clock: FakeClock, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _backup_of(tmp_path, clock, time=1000.0)
    config = _config(tmp_path, retention=DAY)
    (tmp_path / "data").mkdir()
    with DataLock.take(tmp_path / "data"):
        assert restore.cmd_restore(str(folder), str(config), wall=lambda: 1001.0) == restore.EXIT_USAGE
        assert "a node runs on the data directory" in capsys.readouterr().err
    other = tmp_path / "b.toml"
    other.write_text(config.read_text().replace('name = "a"', 'name = "b"'))
    assert restore.cmd_restore(str(folder), str(other), wall=lambda: 1001.0) == restore.EXIT_USAGE
    assert "a backup of node 'a'" in capsys.readouterr().err
    with open(folder / "d.sqlite", "r+b") as file:
        file.seek(100)
        file.write(b"\xff")
    assert restore.cmd_restore(str(folder), str(config), wall=lambda: 1001.0) == restore.EXIT_FAILED
    assert "is damaged: d.sqlite: sha256" in capsys.readouterr().err


def test_at_most_max_snapshots_at_once_and_none_left_behind(node: Store, tmp_path: Path) -> None:
    db = node.database("d", create=True)
    db.put("t", "k", b"v")
    taker = snapshots.Snapshots(tmp_path / "a", limit=1)

    async def run() -> None:
        async with taker.taken(db.path, "d") as taken:
            assert taken.size > 0
            with pytest.raises(snapshots.Busy):
                async with taker.taken(db.path, "d"):
                    pass
        assert taker.active == 0 and list(taker.directory.iterdir()) == []

    asyncio.run(run())
