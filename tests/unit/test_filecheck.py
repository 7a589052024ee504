"""The boot check of database files and the store's write probe, on files made here (no node, no process)."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from replicator.coordinator.filecheck import DamagedFiles, check_databases, check_file, database_files, probe_write
from replicator.shared.store import Store

WALL = 1_700_000_000.0  # 2023-11-14T22:13:20Z


def make_database(directory: Path, name: str = "db", records: int = 2000) -> Path:
    with Store(directory, "a") as store:
        db = store.database(name, create=True)
        db.put_many("t", [(f"r{i:05d}", os.urandom(100)) for i in range(records)])
    return directory / f"{name}.sqlite"


def test_a_sound_file_and_an_empty_one_pass(tmp_path: Path) -> None:
    path = make_database(tmp_path)
    assert check_file(path) is None
    assert check_file(path, full=True) is None
    (tmp_path / "empty.sqlite").write_bytes(b"")
    assert check_file(tmp_path / "empty.sqlite") is None
    assert check_file(tmp_path / "gone.sqlite") is None


def test_each_kind_of_damage_is_named(tmp_path: Path) -> None:
    path = make_database(tmp_path)
    size = path.stat().st_size
    os.truncate(path, size // 2)
    assert check_file(path) == f"truncated: {size // 2} bytes, its header says {size}"
    os.truncate(path, 60)
    assert check_file(path) == "truncated: 60 bytes, shorter than a database header"
    path.write_bytes(b"x" * 4096)
    assert check_file(path) == "not a SQLite database: bad header"
    path.unlink()
    path.mkdir()
    assert check_file(path) == "a directory, not a database file"
    link = tmp_path / "link.sqlite"
    link.symlink_to(tmp_path / "nowhere")
    assert check_file(link) == "not a regular file"  # never followed (check_databases leaves links to the store)


def test_a_damaged_page_fails_quick_check(tmp_path: Path) -> None:
    path = make_database(tmp_path)
    page = sqlite3.connect(path).execute("PRAGMA page_size").fetchone()[0]
    with path.open("r+b") as file:
        file.seek(page * 5)
        file.write(b"\xff" * page)
    found = check_file(path)
    assert found is not None and found.startswith("quick_check"), found
    found = check_file(path, full=True)
    assert found is not None and found.startswith("integrity_check"), found


def test_only_names_the_store_would_open_are_checked(tmp_path: Path) -> None:
    make_database(tmp_path, "good")
    (tmp_path / "bad name.sqlite").write_bytes(b"junk")
    (tmp_path / ".hidden.sqlite").write_bytes(b"junk")
    (tmp_path / "notes.txt").write_bytes(b"junk")
    assert database_files(tmp_path) == [("good", tmp_path / "good.sqlite")]


def test_without_recover_every_damaged_file_is_named_and_nothing_moves(tmp_path: Path) -> None:
    make_database(tmp_path, "good")
    (tmp_path / "one.sqlite").write_bytes(b"x" * 200)
    (tmp_path / "two.sqlite").mkdir()
    with pytest.raises(DamagedFiles) as caught:
        check_databases(tmp_path, full=False, recover=False, wall=lambda: WALL)
    message = str(caught.value)
    assert f"database file {tmp_path / 'one.sqlite'} is damaged: not a SQLite database: bad header" in message
    assert f"database file {tmp_path / 'two.sqlite'} is damaged: a directory, not a database file" in message
    assert "recover_damaged" in message
    assert not (tmp_path / "damaged").exists()


def test_recover_moves_the_file_and_its_sidecars_aside(tmp_path: Path) -> None:
    make_database(tmp_path, "good")
    (tmp_path / "one.sqlite").write_bytes(b"x" * 200)
    (tmp_path / "one.sqlite-wal").write_bytes(b"wal")
    (tmp_path / "one.sqlite-shm").write_bytes(b"shm")
    checked, moved = check_databases(tmp_path, full=False, recover=True, wall=lambda: WALL)
    assert checked == 2
    target = tmp_path / "damaged" / "one.sqlite.20231114T221320Z"
    assert [(m.database, m.moved_to, m.reason) for m in moved] == [("one", target, "not a SQLite database: bad header")]
    assert target.read_bytes() == b"x" * 200
    assert Path(f"{target}-wal").read_bytes() == b"wal" and Path(f"{target}-shm").read_bytes() == b"shm"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["damaged", "good.sqlite"]
    # The same damage again within the second does not overwrite the first evidence.
    (tmp_path / "one.sqlite").mkdir()
    _, again = check_databases(tmp_path, full=False, recover=True, wall=lambda: WALL)
    assert again[0].moved_to == tmp_path / "damaged" / "one.sqlite.20231114T221320Z.1"
    assert target.read_bytes() == b"x" * 200


def test_the_write_probe_names_what_stops_a_write(tmp_path: Path) -> None:
    path = make_database(tmp_path, "system", records=1)
    assert probe_write(tmp_path, path) is None
    assert not (tmp_path / ".readyz-probe").exists()
    found = probe_write(tmp_path / "missing", path)
    assert found is not None and found.startswith("store cannot write: No such file or directory"), found
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        found = probe_write(tmp_path, path, busy_timeout=0.1)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert found is not None and "database is locked" in found, found


def test_the_check_reports_progress_within_a_file_and_after_each(tmp_path: Path) -> None:
    """What keeps systemd waiting for a long boot check (coordinator.sd_notify.StartExtension): steps come from
    inside SQLite's check of a file, not only between files."""
    make_database(tmp_path, "one", records=20_000)
    make_database(tmp_path, "two", records=10)
    (tmp_path / "empty.sqlite").write_bytes(b"")
    steps: list[int] = []
    checked, moved = check_databases(
        tmp_path, full=True, recover=False, wall=lambda: WALL, progress=lambda: steps.append(1)
    )
    assert (checked, moved) == (3, [])
    assert len(steps) > 3  # three files, and steps within the integrity_check of the large one
    within: list[int] = []
    check_file(tmp_path / "one.sqlite", full=True, progress=lambda: within.append(1))
    assert within  # one file alone: steps from inside the check
