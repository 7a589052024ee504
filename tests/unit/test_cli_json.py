"""`--json` on every command: each command's parser takes it, a failure that printed nothing on stdout prints one
JSON object naming it, and the streams main() records are given back."""

from __future__ import annotations

import argparse
import json
import sys

import pytest

from replicator.coordinator import cli
from replicator.coordinator.node_cmd import render_list
from tests.unit.test_cli_parser import _parsers


@pytest.fixture(autouse=True)
def _no_admin_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cli.ADMIN_ENV, raising=False)
    monkeypatch.delenv(cli.ADMIN_TOKEN_ENV, raising=False)


def _commands() -> list[tuple[str, argparse.ArgumentParser]]:
    """Every command that runs (not a group of subcommands)."""
    return [
        (path, parser)
        for path, parser in _parsers(cli.build_parser())
        if path != "replicator"
        and not any(isinstance(action, argparse._SubParsersAction) for action in parser._actions)
    ]


def test_every_command_takes_json() -> None:
    commands = _commands()
    assert {"replicator node list", "replicator node remove", "replicator init", "replicator demo"} <= {
        path for path, _ in commands
    }
    missing = [path for path, parser in commands if "--json" not in parser._option_string_actions]
    assert missing == []


def test_a_failure_under_json_is_one_json_object(capsys: pytest.CaptureFixture[str]) -> None:
    stdout, stderr = sys.stdout, sys.stderr
    assert cli.main(["status", "--admin", "127.0.0.1:1", "--json"]) == 2

    captured = capsys.readouterr()
    assert json.loads(captured.out) == {
        "ok": False,
        "command": "status",
        "exit_code": 2,
        "error": "--admin '127.0.0.1:1' has no scheme: did you mean http://127.0.0.1:1?",
    }
    assert "did you mean http://127.0.0.1:1?" in captured.err  # the text stays on stderr
    assert (sys.stdout, sys.stderr) == (stdout, stderr)


def test_a_usage_error_under_json_is_one_json_object_too(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["node", "remove", "--json", "--bogus", "c", "--admin", "http://127.0.0.1:1"])
    assert exit_info.value.code == 2
    document = json.loads(capsys.readouterr().out)
    assert document["command"] == "node remove" and document["exit_code"] == 2
    assert "--bogus" in document["error"]

    assert cli.main(["node", "remove", "c", "--revoke", "--admin", "http://127.0.0.1:1", "--json"]) == 2
    document = json.loads(capsys.readouterr().out)
    assert document["error"] == "--revoke needs --ca DIR, the cluster CA folder whose ca.key signs the revocation"


def test_without_json_a_failure_prints_nothing_on_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["status", "--admin", "127.0.0.1:1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "has no scheme" in captured.err


def test_completion_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["completion", "bash", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["shell"] == "bash" and "_shtab_replicator" in document["script"]


def test_node_list_as_a_table() -> None:
    text = render_list(
        {
            "node": "a",
            "admin": "http://127.0.0.1:9926",
            "nodes": [
                {"name": "a", "url": "wss://a:1", "databases": ["*"], "source": "own", "self": True},
                {
                    "name": "b",
                    "url": "wss://b:1",
                    "databases": ["orders", "users"],
                    "source": "own",
                    "static": True,
                    "connected": True,
                    "pairs": 2,
                    "pairs_connected": 2,
                    "last_seen_s": 0.0,
                    "revocations": [],
                },
                {
                    "name": "c",
                    "url": "wss://c:1",
                    "databases": ["*"],
                    "source": "introduced by a",
                    "connected": False,
                    "pairs": 1,
                    "pairs_connected": 0,
                    "last_seen_s": 300.0,
                    "revoked": True,
                    "revocations": [{"id": "c.all.1", "serial": None, "issued_before": 1.0}],
                },
                {"name": "d", "url": "wss://d:1", "source": "config", "static": True, "last_seen_s": None},
            ],
        }
    )
    lines = text.splitlines()
    assert lines[0] == "registry of node a (http://127.0.0.1:9926): 4 nodes"
    rows = {line.split()[0]: line for line in lines[4:]}
    assert "(this node)" in rows["a"]
    assert "orders,users" in rows["b"] and "own, static" in rows["b"] and "yes, 2/2 pairs  now" in rows["b"]
    assert "NO, 0/1 pairs" in rows["c"] and "5m ago" in rows["c"] and rows["c"].endswith("REVOKED")
    assert "(config)" in rows["d"] and "never" in rows["d"]


@pytest.mark.parametrize(
    "args",
    [
        ["node", "remove", "c/../d"],
        ["node", "add", "c d", "--url", "wss://127.0.0.1:9443"],
    ],
)
def test_a_name_no_node_can_have_is_refused_before_any_request(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main([*args, "--admin", "http://127.0.0.1:1", "--json"]) == 2
    name = args[2]
    assert json.loads(capsys.readouterr().out)["error"] == (f"bad node name {name!r}: use 1 to 64 of A-Z a-z 0-9 _ -")
