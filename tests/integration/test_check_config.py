"""`replicator check-config --config FILE`: 0 when `run` would start with the file, 2 with the loader's message."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from replicator.coordinator.certs_cmd import cmd_init
from replicator.shared.tls import create_ca

REPO = Path(__file__).resolve().parents[2]


def replicator(*args: str, env: dict[str, str] | None = None, stderr: int | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "replicator.coordinator.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE if stderr is None else stderr,
        text=True,
        timeout=60,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        check=False,
    )


@pytest.fixture
def node_config(tmp_path: Path) -> Path:
    create_ca(tmp_path / "ca")
    path = tmp_path / "node" / "a.toml"
    peers = ["b=wss://127.0.0.1:9935"]
    assert (
        cmd_init(
            "a", "wss://127.0.0.1:9925", 9925, 9926, str(tmp_path / "data"), str(tmp_path / "ca"), str(path), peers
        )
        == 0
    )
    return path


def test_a_good_file_is_ok(node_config: Path) -> None:
    result = replicator("check-config", "--config", str(node_config), env={"REPLICATOR_NODE_WORKERS": "3"})
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{node_config}: OK (node a, 3 workers, peers: b)\n" and result.stderr == ""
    result = replicator("check-config", "--config", str(node_config), "--json")
    document = json.loads(result.stdout)
    assert result.returncode == 0 and document["ok"] is True
    assert (document["config"], document["node"], document["peers"]) == (str(node_config), "a", ["b"])


@pytest.mark.parametrize(
    ("old", "new", "named"),
    [
        ("[node]\n", "[node]\nflavour = 1\n", "node.flavour"),
        ('name = "a"\n', "", "node.name"),
        ("port = 9925\n", "port = 99999\n", "listen.port"),
        ("[node]\n", "[log]\nlevel = 'loud'\n\n[node]\n", "log.level"),
    ],
    ids=["unknown-key", "missing-name", "bad-port", "bad-level"],
)
def test_a_bad_file_exits_2_naming_the_file_and_key(node_config: Path, old: str, new: str, named: str) -> None:
    text = node_config.read_text()
    assert old in text
    node_config.write_text(text.replace(old, new, 1))
    result = replicator("check-config", "--config", str(node_config))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(f"replicator: {node_config}: ") and named in result.stderr, result.stderr
    # `run` says the same about the same file.
    run = replicator("run", "--config", str(node_config))
    assert run.returncode == 2 and run.stderr == result.stderr


def test_a_level_in_any_case_is_taken(node_config: Path) -> None:
    result = replicator("check-config", "--config", str(node_config), env={"REPLICATOR_LOG_LEVEL": "WARN"})
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("variable", ["REPLICATOR_NODE_WORKRES", "REPLICATOR_WORKERS"])
def test_a_variable_that_names_no_key_exits_2_naming_it(node_config: Path, variable: str) -> None:
    result = replicator("check-config", "--config", str(node_config), env={variable: "2"})
    assert result.returncode == 2 and result.stderr.startswith(f"replicator: {variable}: "), result.stderr
    run = replicator("run", "--config", str(node_config), env={variable: "2"})
    assert run.returncode == 2 and run.stderr == result.stderr


def test_the_variables_the_cli_reads_are_not_config_errors(node_config: Path) -> None:
    env = {"REPLICATOR_ADMIN": "http://127.0.0.1:9926", "REPLICATOR_STRESS": "0"}
    assert replicator("check-config", "--config", str(node_config), env=env).returncode == 0


def test_the_certificate_files_are_checked(node_config: Path) -> None:
    (node_config.parent / "a.key").unlink()
    result = replicator("check-config", "--config", str(node_config))
    assert result.returncode == 2 and "tls" in result.stderr and "a.key" in result.stderr, result.stderr
    missing = replicator("check-config", "--config", str(node_config.parent / "nowhere.toml"))
    assert missing.returncode == 2 and "nowhere.toml: no such file" in missing.stderr


def test_a_token_every_user_can_read_is_a_warning_not_an_error(node_config: Path) -> None:
    node_config.chmod(0o644)
    result = replicator("check-config", "--config", str(node_config))
    assert result.returncode == 0
    assert result.stdout.startswith(f"{node_config}: OK (node a, ")
    assert result.stderr == (
        f"replicator: warning: {node_config}: holds data.token, listen.admin_token and is readable by every user"
        " of this host (mode 0644);"
        f" chmod 600 {node_config} (or 640 with the node's group)\n"
    )
    document = json.loads(replicator("check-config", "--config", str(node_config), "--json").stdout)
    assert document["ok"] is True and len(document["warnings"]) == 1
    assert document["warnings"][0].startswith(f"{node_config}: holds data.token, listen.admin_token and is")

    node_config.chmod(0o640)  # group-readable: how the units install it
    result = replicator("check-config", "--config", str(node_config), "--json")
    assert result.returncode == 0 and result.stderr == ""
    assert json.loads(result.stdout)["warnings"] == []


def test_a_key_others_can_read_exits_2_naming_it(node_config: Path) -> None:
    key = node_config.parent / "a.key"
    key.chmod(0o604)
    result = replicator("check-config", "--config", str(node_config))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (
        f"replicator: {node_config}: key 'tls': {key}: the private key has mode 0604, open to group or others; a key"
        f" must be readable by its owner only: chmod 600 {key}\n"
    )
    key.chmod(0o600)
    assert replicator("check-config", "--config", str(node_config)).returncode == 0


def test_on_the_journal_the_lines_carry_their_priority(node_config: Path, tmp_path: Path) -> None:
    # As under systemd, when ExecReload= runs it: stdout and stderr are the journal's stream.
    journal = tmp_path / "journal"
    with journal.open("w") as stream:
        stat = os.fstat(stream.fileno())
        env = {"JOURNAL_STREAM": f"{stat.st_dev}:{stat.st_ino}"}
        subprocess.run(
            [sys.executable, "-m", "replicator.coordinator.cli", "check-config", "--config", str(node_config)],
            stdout=stream,
            stderr=stream,
            cwd=REPO,
            env={**os.environ, **env},
            timeout=60,
            check=True,
        )
        node_config.write_text(node_config.read_text().replace("[node]\n", "[node]\nflavour = 1\n", 1))
        failed = subprocess.run(
            [sys.executable, "-m", "replicator.coordinator.cli", "check-config", "--config", str(node_config)],
            stdout=stream,
            stderr=stream,
            cwd=REPO,
            env={**os.environ, **env},
            timeout=60,
            check=False,
        )
    assert failed.returncode == 2
    lines = journal.read_text().splitlines()
    assert len(lines) == 2 and re.match(r"<6>.*: OK \(node a", lines[0]) and re.match(r"<3>replicator: ", lines[1])
