"""`--json` on every command: each command's parser takes it, a failure that printed nothing on stdout prints one
JSON object naming it, and the streams main() records are given back."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import pytest

from replicator.coordinator import cli
from replicator.coordinator.node_cmd import render_list
from tests.unit.test_cli_parser import _parsers

README = Path(__file__).resolve().parents[2] / "README.md"


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


def _readme_json_rows() -> dict[str, str]:
    """The rows of the README's table "JSON output of the commands": command -> what it prints."""
    text = README.read_text()
    section = text.split("### JSON output of the commands", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `([a-z -]+)` \| (.*) \|$", section, re.MULTILINE)
    return dict(rows)


def test_every_command_has_a_row_in_the_readme_json_table() -> None:
    rows = _readme_json_rows()
    commands = {path.removeprefix("replicator ") for path, _ in _commands()}
    assert sorted(commands - rows.keys()) == []  # a command without its JSON shape documented
    assert sorted(rows.keys() - commands) == []  # a row of a command that is gone


def test_the_keys_json_help_names_are_in_the_readme_row() -> None:
    rows = _readme_json_rows()
    for path, parser in _commands():
        shape = parser._option_string_actions["--json"].help or ""
        row = rows[path.removeprefix("replicator ")]
        missing = [key for key in re.findall(r'"([a-z_]+)"', shape) if f'"{key}"' not in row]
        assert missing == [], path


def test_node_add_and_remove_say_what_through_is() -> None:
    helps = {path: " ".join(parser.format_help().split()) for path, parser in _commands()}
    assert '"through": the admin URL asked' in helps["replicator node add"]
    assert '"through": the name of the node asked, not its admin URL' in helps["replicator node remove"]
    assert "the name of the node to remove" in helps["replicator node remove"]
    rows = _readme_json_rows()
    assert "`through`: the admin URL asked" in rows["node add"]
    assert "`through`: the name of the node asked" in rows["node remove"]


@pytest.mark.parametrize(
    "args",
    [["status"], ["verify"], ["node", "list"], ["node", "remove", "c"], ["certs", "resign", "--ca", "ca"]],
)
def test_a_bad_admin_url_from_replicator_admin_is_named_as_the_variable(
    args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(cli.ADMIN_ENV, "10.0.0.1:9926")
    assert cli.main([*args, "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"] == (
        "REPLICATOR_ADMIN='10.0.0.1:9926' has no scheme: did you mean http://10.0.0.1:9926?"
    )
    # The same value given as --admin is named as the option.
    assert cli.main([*args, "--admin", "10.0.0.1:9926"]) == 2
    assert (
        "replicator "
        + " ".join(args[:2] if args[0] in ("node", "certs") else args[:1])
        + (": --admin '10.0.0.1:9926' has no scheme: did you mean http://10.0.0.1:9926?")
        in capsys.readouterr().err
    )


def test_a_node_url_from_replicator_admin_is_named_as_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(cli.ADMIN_ENV, "http://127.0.0.1:9926,wss://10.0.0.2:9925")
    assert cli.main(["verify"]) == 2
    assert capsys.readouterr().err.startswith(
        "replicator verify: REPLICATOR_ADMIN='wss://10.0.0.2:9925' is a node URL (node.url: replication over TLS)"
    )


@pytest.mark.parametrize(
    ("url", "hint"),
    [("10.0.0.3:9925", ": did you mean wss://10.0.0.3:9925?"), ("http://10.0.0.3:9925", "")],
)
def test_node_add_with_a_url_without_a_scheme_says_the_url_meant(
    url: str, hint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["node", "add", "c", "--url", url, "--admin", "http://127.0.0.1:1", "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"] == (
        f"--url: expected the node's wss:// URL (its node.url), got {url!r}{hint}"
    )
