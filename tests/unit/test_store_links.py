"""Database files that are symbolic links: refused by the store, never followed, never changed (no node, no process)."""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest

from replicator.coordinator.filecheck import check_databases
from replicator.shared import store as store_module
from replicator.shared.logs import EventLog
from replicator.shared.store import SIDECARS, RefusedFile, Store, UnknownDatabase, refusal

WALL = 1_700_000_000.0


def make_database(directory: Path, name: str, records: int = 50) -> Path:
    with Store(directory, "a") as store:
        store.database(name, create=True).put_many("t", [(f"r{i:03d}", b"v%d" % i) for i in range(records)])
    return directory / f"{name}.sqlite"


def listing(directory: Path) -> dict[str, str]:
    """Every entry of `directory` with what it is: a link's target, a file's sha256."""
    return {
        path.name: f"-> {os.readlink(path)}" if path.is_symlink() else hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.iterdir())
    }


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> io.StringIO:
    stream = io.StringIO()
    monkeypatch.setattr(store_module, "log", EventLog(stream))
    return stream


def refusals(stream: io.StringIO) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in stream.getvalue().splitlines()]
    return [record for record in records if record["event"] == "database_file_refused"]


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A database file outside the data directory, which a link in the data directory points at."""
    return make_database(tmp_path / "outside", "theirs")


def test_a_link_to_a_database_outside_is_refused_naming_it_and_nothing_changes(
    tmp_path: Path, outside: Path, captured: io.StringIO
) -> None:
    data = tmp_path / "data"
    make_database(data, "good")
    link = data / "linked.sqlite"
    link.symlink_to(outside)
    before_outside, before_data = listing(outside.parent), listing(data)

    with Store(data, "a") as store:
        assert store.names() == ["good"]
        for create in (False, True):
            with pytest.raises(RefusedFile) as caught:
                store.database("linked", create=create)
            assert isinstance(caught.value, UnknownDatabase)  # to every caller a database this node does not have
            assert str(caught.value).startswith(f"database file {link} is a symbolic link (to {outside}); refused")
            assert caught.value.path == link
        assert store.database("good").get("t", "r007") is not None  # everything else is served

    assert listing(outside.parent) == before_outside  # no -wal or -shm beside the target: it was never opened
    assert listing(data) == before_data
    assert [(e["database"], e["path"]) for e in refusals(captured)] == [("linked", str(link))]


def test_a_link_to_nothing_is_refused_and_not_created_through(tmp_path: Path, captured: io.StringIO) -> None:
    data = tmp_path / "data"
    data.mkdir()
    link = data / "ghost.sqlite"
    link.symlink_to(tmp_path / "elsewhere.sqlite")
    with Store(data, "a") as store:
        with pytest.raises(RefusedFile, match=r"ghost\.sqlite is a symbolic link"):
            store.database("ghost", create=True)
        assert store.names() == []
    assert not (tmp_path / "elsewhere.sqlite").exists()
    assert link.is_symlink() and sorted(p.name for p in data.iterdir()) == ["ghost.sqlite"]


@pytest.mark.parametrize("suffix", SIDECARS)
def test_a_sidecar_that_is_a_link_refuses_its_database(tmp_path: Path, suffix: str, captured: io.StringIO) -> None:
    data = tmp_path / "data"
    path = make_database(data, "walled")
    target = tmp_path / "victim"
    target.write_bytes(b"not the node's")
    Path(f"{path}{suffix}").symlink_to(target)
    with Store(data, "a") as store:
        assert store.names() == []
        with pytest.raises(RefusedFile, match=rf"walled\.sqlite: its walled\.sqlite{suffix} is a symbolic link"):
            store.database("walled")
    assert target.read_bytes() == b"not the node's"


def test_each_refused_file_is_logged_once_per_store_until_it_is_fixed(
    tmp_path: Path, outside: Path, captured: io.StringIO
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    link = data / "linked.sqlite"
    link.symlink_to(outside)
    with Store(data, "a") as store:
        for _ in range(20):
            store.names()
            with pytest.raises(RefusedFile):
                store.database("linked")
        assert len(refusals(captured)) == 1
        # The operator puts the file itself in place of the link: it opens, and a link again is logged again.
        link.unlink()
        link.write_bytes(outside.read_bytes())
        assert store.names() == ["linked"]
        assert store.database("linked").get("t", "r001") is not None
        store.forget("linked")
        link.unlink()
        link.symlink_to(outside)
        with pytest.raises(RefusedFile):
            store.database("linked")
        assert len(refusals(captured)) == 2


def test_remove_refuses_a_link_and_deletes_nothing(tmp_path: Path, outside: Path, captured: io.StringIO) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "linked.sqlite").symlink_to(outside)
    before = listing(outside.parent)
    with Store(data, "a") as store:
        store.block("linked")
        with pytest.raises(RefusedFile):
            store.remove("linked")
    assert (data / "linked.sqlite").is_symlink()
    assert listing(outside.parent) == before


def test_the_boot_check_leaves_refused_files_to_the_store(tmp_path: Path, outside: Path) -> None:
    data = tmp_path / "data"
    make_database(data, "good")
    (data / "linked.sqlite").symlink_to(outside)
    (data / "ghost.sqlite").symlink_to(tmp_path / "nowhere")
    before = listing(data)
    # Not damaged, so not moved aside even with recover_damaged; not checked, so not counted.
    checked, moved = check_databases(data, full=True, recover=True, wall=lambda: WALL)
    assert (checked, moved) == (1, [])
    assert listing(data) == before and not (data / "damaged").exists()


def test_refusal_is_none_for_a_regular_file_and_a_missing_one(tmp_path: Path) -> None:
    path = make_database(tmp_path, "plain")
    assert refusal(path) is None
    assert refusal(tmp_path / "absent.sqlite") is None
