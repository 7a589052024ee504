"""What `replicator init` writes: absolute paths stay absolute, the CA certificate is copied beside the config (tls.ca
never points into the folder that holds ca.key), and --token / --token-file give every node of a cluster one data
token."""

from __future__ import annotations

import json
import secrets
import stat
import tomllib
from pathlib import Path
from typing import Any

import pytest

from replicator.coordinator.certs_cmd import cmd_init
from replicator.coordinator.local_cluster import LocalCluster
from replicator.shared.config import load, resolve_path
from replicator.shared.tls import create_ca


@pytest.fixture
def ca_dir(tmp_path: Path) -> Path:
    create_ca(tmp_path / "ca")
    return tmp_path / "ca"


def _init(ca_dir: Path, config: Path, data: str, name: str = "a", **options: Any) -> int:
    return cmd_init(name, "wss://127.0.0.1:9925", 9925, 9926, data, str(ca_dir), str(config), [], **options)


def _file(config: Path) -> dict[str, Any]:
    return tomllib.loads(config.read_text())


def test_an_absolute_data_directory_stays_absolute(
    ca_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    absolute = tmp_path / "var" / "lib" / "replicator" / "a"
    assert _init(ca_dir, tmp_path / "etc" / "a.toml", str(absolute)) == 0
    assert _file(tmp_path / "etc" / "a.toml")["node"]["data_dir"] == str(absolute)

    # A relative one is taken from the working directory and written relative to the config's folder.
    monkeypatch.chdir(tmp_path)
    assert _init(ca_dir, tmp_path / "etc" / "b.toml", "data/b", name="b") == 0
    config = load(tmp_path / "etc" / "b.toml", env={})
    assert config.node.data_dir == "../data/b"
    assert Path(resolve_path(config, config.node.data_dir)).resolve() == tmp_path / "data" / "b"


def test_the_ca_certificate_is_copied_beside_the_config(ca_dir: Path, tmp_path: Path) -> None:
    config = tmp_path / "etc" / "a.toml"
    assert _init(ca_dir, config, str(tmp_path / "data")) == 0

    assert _file(config)["tls"] == {"ca": "ca.pem", "cert": "a.pem", "key": "a.key"}
    assert (config.parent / "ca.pem").read_bytes() == (ca_dir / "ca.pem").read_bytes()
    assert not (config.parent / "ca.key").exists()
    # A second node's config in the same folder keeps the copy.
    assert _init(ca_dir, config.parent / "b.toml", str(tmp_path / "data-b"), name="b") == 0
    assert (config.parent / "ca.pem").read_bytes() == (ca_dir / "ca.pem").read_bytes()


def test_another_cas_certificate_beside_the_config_is_not_overwritten(
    ca_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "etc" / "ca.pem"
    other.parent.mkdir()
    other.write_text("another cluster's CA\n")

    assert _init(ca_dir, tmp_path / "etc" / "a.toml", str(tmp_path / "data")) == 1
    assert "exists and is not" in capsys.readouterr().err
    assert other.read_text() == "another cluster's CA\n"
    assert sorted(path.name for path in other.parent.iterdir()) == ["ca.pem"]  # nothing else written


def test_a_config_in_the_ca_folder_is_refused(ca_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _init(ca_dir, ca_dir / "a.toml", "data") == 2
    assert "holds the CA key (ca.key)" in capsys.readouterr().err
    assert sorted(path.name for path in ca_dir.iterdir()) == ["ca.key", "ca.pem"]


def test_one_token_file_gives_every_node_the_same_data_token(
    ca_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token_file = tmp_path / "cluster.token"
    assert _init(ca_dir, tmp_path / "a" / "a.toml", str(tmp_path / "data-a"), token_file=str(token_file)) == 0
    assert "wrote a new data token to" in capsys.readouterr().out
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token = token_file.read_text().strip()

    assert _init(ca_dir, tmp_path / "b" / "b.toml", str(tmp_path / "data-b"), "b", token_file=str(token_file)) == 0
    assert "data token from" in capsys.readouterr().out
    assert _file(tmp_path / "a" / "a.toml")["data"]["token"] == token
    assert _file(tmp_path / "b" / "b.toml")["data"]["token"] == token
    # Without either, each node gets a random token of its own.
    assert _init(ca_dir, tmp_path / "c" / "c.toml", str(tmp_path / "data-c"), "c") == 0
    assert _file(tmp_path / "c" / "c.toml")["data"]["token"] not in ("", token)


def test_no_random_token_starts_with_a_dash(ca_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A token starting with "-" given as `--token VALUE` is taken for an option: whatever the random draw, the
    tokens init makes (in the config and in a new token file) and LocalCluster's admin token do not."""
    monkeypatch.setattr(secrets, "token_urlsafe", lambda nbytes: "-" + "x" * nbytes)
    assert _init(ca_dir, tmp_path / "a" / "a.toml", str(tmp_path / "data-a")) == 0
    files = {"token_file": str(tmp_path / "data.token"), "admin_token_file": str(tmp_path / "admin.token")}
    assert _init(ca_dir, tmp_path / "b" / "b.toml", str(tmp_path / "data-b"), "b", **files) == 0
    a, b = _file(tmp_path / "a" / "a.toml"), _file(tmp_path / "b" / "b.toml")
    made = [
        config[section][key] for config in (a, b) for section, key in (("data", "token"), ("listen", "admin_token"))
    ]
    made += [(tmp_path / "data.token").read_text().strip(), (tmp_path / "admin.token").read_text().strip()]
    made.append(LocalCluster(tmp_path / "cluster", ["a"]).admin_token)
    assert len(made) == 7 and not any(token.startswith("-") for token in made), made
    assert all(token[1:] in ("-" + "x" * 32, "-" + "x" * 24) for token in made), made  # every random byte kept


def test_a_given_token_is_written_and_a_bad_one_refused(
    ca_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _init(ca_dir, tmp_path / "a" / "a.toml", str(tmp_path / "data"), token="s3cret-for-the-cluster") == 0
    assert _file(tmp_path / "a" / "a.toml")["data"]["token"] == "s3cret-for-the-cluster"

    for token, message in (("two words", "printable ASCII"), (" ", "empty")):
        assert _init(ca_dir, tmp_path / "b" / "b.toml", str(tmp_path / "data-b"), "b", token=token) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
    both = {"token": "x" * 20, "token_file": str(tmp_path / "t")}
    assert _init(ca_dir, tmp_path / "b" / "b.toml", str(tmp_path / "data-b"), "b", **both) == 2
    assert "not both" in capsys.readouterr().err


def test_json_says_what_was_written_and_not_the_token(
    ca_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    config = tmp_path / "etc" / "a.toml"
    token_file = tmp_path / "cluster.token"
    assert _init(ca_dir, config, str(tmp_path / "data"), token_file=str(token_file), as_json=True) == 0

    document = json.loads(capsys.readouterr().out)
    assert document == {
        "ok": True,
        "config": str(config),
        "node": "a",
        "url": "wss://127.0.0.1:9925",
        "listen": {"host": "127.0.0.1", "port": 9925, "admin_port": 9926},
        "data_dir": str(tmp_path / "data"),
        "cert": str(config.parent / "a.pem"),
        "key": str(config.parent / "a.key"),
        "ca": str(config.parent / "ca.pem"),
        "token": {"source": "--token-file", "file": str(token_file), "created": True},
        "admin_token": {"source": "random", "file": None, "created": False},
        "warnings": [],
    }
    assert token_file.read_text().strip() not in json.dumps(document)


def test_one_admin_token_file_gives_every_node_the_same_admin_token(
    ca_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One admin token for a cluster, so that `verify` and `diff` reach every node with it; never the data token."""
    admin_file = tmp_path / "admin.token"
    assert _init(ca_dir, tmp_path / "a" / "a.toml", str(tmp_path / "data-a"), admin_token_file=str(admin_file)) == 0
    assert "wrote a new admin token to" in capsys.readouterr().out
    assert stat.S_IMODE(admin_file.stat().st_mode) == 0o600
    assert (
        _init(ca_dir, tmp_path / "b" / "b.toml", str(tmp_path / "data-b"), "b", admin_token_file=str(admin_file)) == 0
    )
    assert "admin token from" in capsys.readouterr().out
    a, b = _file(tmp_path / "a" / "a.toml"), _file(tmp_path / "b" / "b.toml")
    assert a["listen"]["admin_token"] == b["listen"]["admin_token"] == admin_file.read_text().strip()
    assert a["data"]["token"] != b["data"]["token"]  # the data token is its own
    assert _init(ca_dir, tmp_path / "c" / "c.toml", str(tmp_path / "data-c"), "c", admin_token="admin-s3cret") == 0
    assert _file(tmp_path / "c" / "c.toml")["listen"]["admin_token"] == "admin-s3cret"
    # The two tokens never share a file, and an empty one is refused.
    same = {"token_file": str(tmp_path / "t"), "admin_token_file": str(tmp_path / "t")}
    assert _init(ca_dir, tmp_path / "d" / "d.toml", str(tmp_path / "data-d"), "d", **same) == 2
    assert "must not be the --token-file" in capsys.readouterr().err
    assert _init(ca_dir, tmp_path / "d" / "d.toml", str(tmp_path / "data-d"), "d", admin_token=" ") == 2
    assert "the admin token is empty" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize(
    ("url", "peers", "message"),
    [
        ("10.0.0.3:9925", [], "--url: expected a wss:// URL, got '10.0.0.3:9925': did you mean wss://10.0.0.3:9925?"),
        (
            "wss://127.0.0.1:9925",
            ["b=10.0.0.2:9925"],
            "--peer: expected a wss:// URL, got '10.0.0.2:9925': did you mean wss://10.0.0.2:9925?",
        ),
        # A URL with another scheme gets no guess: it may be an admin URL, whose port is not the node port.
        ("http://10.0.0.3:9926", [], "--url: expected a wss:// URL, got 'http://10.0.0.3:9926'\n"),
    ],
)
def test_a_node_url_without_a_scheme_says_the_url_meant(
    ca_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], url: str, peers: list[str], message: str
) -> None:
    config = tmp_path / "etc" / "a.toml"
    assert cmd_init("a", url, 9925, 9926, "data", str(ca_dir), str(config), peers) == 2

    assert f"replicator init: {message}" in capsys.readouterr().err
    assert not config.exists()
