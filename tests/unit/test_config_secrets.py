"""A config file that holds a secret and that every user of the host may read is found out (`readable_secrets`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from replicator.shared.config import SECRET_KEYS, readable_secrets, secrets_set

BASE = '[node]\nname = "a"\nurl = "wss://127.0.0.1:9925"\n'


def write(path: Path, text: str, mode: int) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def test_every_secret_key_set_is_found_and_an_empty_one_is_not() -> None:
    assert "data.token" in SECRET_KEYS
    assert secrets_set({"data": {"token": "s3cret"}}) == ("data.token",)
    assert secrets_set({"data": {"token": ""}}) == ()
    assert secrets_set({"data": {"max_databases": 5}}) == ()
    assert secrets_set({"data": "not a table"}) == ()
    assert secrets_set({}) == ()
    everything = {key.split(".")[0]: {} for key in SECRET_KEYS}
    for key in SECRET_KEYS:
        section, name = key.split(".")
        everything[section][name] = "x"
    assert secrets_set(everything) == SECRET_KEYS


@pytest.mark.parametrize("mode", [0o644, 0o604, 0o666, 0o755])
def test_a_world_readable_file_with_a_token_is_named_with_its_mode(tmp_path: Path, mode: int) -> None:
    path = write(tmp_path / "a.toml", BASE + '[data]\ntoken = "s3cret"\n', mode)
    found = readable_secrets(path)
    assert found is not None
    assert (found.path, found.mode, found.octal, found.keys) == (str(path), mode, f"{mode:04o}", ("data.token",))
    assert found.warning() == (
        f"{path}: holds data.token and is readable by every user of this host (mode {mode:04o}); chmod 600 {path}"
        " (or 640 with the node's group)"
    )
    assert "s3cret" not in found.warning()


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o660, 0o400])
def test_owner_or_group_readable_is_fine(tmp_path: Path, mode: int) -> None:
    assert readable_secrets(write(tmp_path / "a.toml", BASE + '[data]\ntoken = "s3cret"\n', mode)) is None


def test_a_file_without_a_secret_or_that_cannot_be_read_is_fine(tmp_path: Path) -> None:
    assert readable_secrets(write(tmp_path / "none.toml", BASE, 0o644)) is None
    assert readable_secrets(write(tmp_path / "empty.toml", BASE + '[data]\ntoken = ""\n', 0o644)) is None
    assert readable_secrets(write(tmp_path / "bad.toml", "[data\ntoken = 'x'\n", 0o644)) is None
    assert readable_secrets(tmp_path / "missing.toml") is None
