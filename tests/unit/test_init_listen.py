"""`init` cannot make an unreachable node: the listen host comes from `--url` unless `--host` is given, and a
loopback listen address with a URL that other machines dial is warned about."""

from __future__ import annotations

from pathlib import Path

import pytest

from replicator.coordinator.certs_cmd import cmd_init
from replicator.coordinator.reachability import listen_host_for, unreachable_from_peers
from replicator.shared.config import load
from replicator.shared.tls import create_ca


@pytest.fixture
def ca_dir(tmp_path: Path) -> Path:
    create_ca(tmp_path / "ca")
    return tmp_path / "ca"


def _init(ca_dir: Path, tmp_path: Path, url: str, host: str | None = None) -> tuple[int, str]:
    config = tmp_path / "node" / "a.toml"
    code = cmd_init("a", url, 9925, 9926, str(tmp_path / "data"), str(ca_dir), str(config), [], host=host)
    return code, load(config, env={}).listen.host if code == 0 else ""


@pytest.mark.parametrize(
    ("url", "listen"),
    [
        ("wss://10.0.0.1:9925", "10.0.0.1"),
        ("wss://127.0.0.1:9925", "127.0.0.1"),
        ("wss://localhost:9925", "127.0.0.1"),
        ("wss://[fd00::1]:9925", "fd00::1"),
        ("wss://db.example:9925", "0.0.0.0"),
    ],
)
def test_the_listen_host_comes_from_the_url(
    ca_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], url: str, listen: str
) -> None:
    code, host = _init(ca_dir, tmp_path, url)

    assert (code, host) == (0, listen)
    errors = capsys.readouterr().err
    assert "warning" not in errors
    # A DNS name gives every interface, and says so.
    assert ("listens on every interface" in errors) == (listen == "0.0.0.0")


def test_host_overrides_the_url(ca_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _init(ca_dir, tmp_path, "wss://db.example:9925", host="10.0.0.7") == (0, "10.0.0.7")
    assert capsys.readouterr().err == ""


def test_a_loopback_host_with_a_url_other_machines_dial_is_a_warning(
    ca_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _init(ca_dir, tmp_path, "wss://10.0.0.1:9925", host="127.0.0.1") == (0, "127.0.0.1")

    errors = capsys.readouterr().err
    assert "warning: listen.host 127.0.0.1 is loopback but peers dial 10.0.0.1" in errors


@pytest.mark.parametrize(
    ("listen", "url", "unreachable"),
    [
        ("127.0.0.1", "wss://10.0.0.1:1", "10.0.0.1"),
        ("localhost", "wss://db.example:1", "db.example"),
        ("::1", "wss://[fd00::1]:1", "fd00::1"),
        ("127.0.0.1", "wss://127.0.0.1:1", None),
        ("127.0.0.1", "wss://localhost:1", None),
        ("0.0.0.0", "wss://10.0.0.1:1", None),
        ("10.0.0.1", "wss://10.0.0.1:1", None),
    ],
)
def test_unreachable_from_peers(listen: str, url: str, unreachable: str | None) -> None:
    assert unreachable_from_peers(listen, url) == unreachable


def test_listen_host_for_a_bracketed_address() -> None:
    assert listen_host_for("[::1]") == "::1"
