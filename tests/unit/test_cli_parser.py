"""The command line's own face: `--version`, help on every option with its default, an epilog with an example and
the exit codes on every command, REPLICATOR_ADMIN as the default admin URL, and completion scripts."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

import pytest

from replicator.coordinator import cli, inspect

EXIT_CODES = ["0 success", "1 failure", "2 usage or configuration error", "3 boot error"]


def _parsers(
    parser: argparse.ArgumentParser, path: str = "replicator"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


@pytest.fixture(autouse=True)
def _no_admin_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cli.ADMIN_ENV, raising=False)
    monkeypatch.delenv(cli.ADMIN_TOKEN_ENV, raising=False)


def test_version_prints_the_installed_version_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])

    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"replicator {cli.version()}"
    assert cli.version()[0].isdigit()


def test_every_option_of_every_command_has_help() -> None:
    missing = [
        f"{path} {'/'.join(action.option_strings) or action.dest}"
        for path, parser in _parsers(cli.build_parser())
        for action in parser._actions
        if not (action.help or "").strip()
    ]
    assert missing == []


def test_every_command_has_an_epilog_with_the_exit_codes_and_an_example() -> None:
    parsers = list(_parsers(cli.build_parser()))
    assert {"replicator status", "replicator verify", "replicator certs revoke", "replicator completion"} <= {
        path for path, _ in parsers
    }
    for path, parser in parsers:
        text = parser.format_help()  # also checks that every help string formats (a stray % would raise)
        assert all(code in text for code in EXIT_CODES), path
        # Every command but a group of subcommands written here has an example; one added without shows the codes.
        if parser.epilog != cli.EXIT_CODES:
            assert "example" in text and "  replicator " in text, path


def test_defaults_are_shown_in_the_help() -> None:
    helps = {path: " ".join(parser.format_help().split()) for path, parser in _parsers(cli.build_parser())}
    assert "(default: 2000)" in helps["replicator demo"]
    assert "(default: 3600.0)" in helps["replicator repair-blobs"]
    assert f"else {cli.DEFAULT_ADMIN})" in helps["replicator status"]
    assert "$REPLICATOR_ADMIN" in helps["replicator status"]
    # No "(default: None)", "(default: False)" or "(default: )" noise on options without a default.
    assert all(
        "(default: None)" not in text and "(default: False)" not in text and "(default: )" not in text
        for text in helps.values()
    )


def test_admin_defaults_to_replicator_admin(monkeypatch: pytest.MonkeyPatch) -> None:
    args = cli.build_parser().parse_args(["status"])
    assert cli._default_admin(args) is None and args.admin == cli.DEFAULT_ADMIN
    monkeypatch.setenv(cli.ADMIN_ENV, " http://10.0.0.1:9926 , http://10.0.0.2:9926,")
    parser = cli.build_parser()

    assert parser.parse_args(["status"]).admin == "http://10.0.0.1:9926"
    assert parser.parse_args(["status", "--admin", "http://x:1"]).admin == "http://x:1"
    assert parser.parse_args(["delete-database", "orders"]).admin == "http://10.0.0.1:9926"
    assert parser.parse_args(["repair-blobs", "orders"]).admin == "http://10.0.0.1:9926"
    assert parser.parse_args(["certs", "revoke", "--ca", "ca", "--name", "b"]).admin == "http://10.0.0.1:9926"
    assert parser.parse_args(["verify"]).admin is None  # main() takes every URL of the variable


def test_without_replicator_admin_the_admin_options_are_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["verify"])
    assert exit_info.value.code == 2
    assert "--admin" in capsys.readouterr().err
    for argv in (["delete-database", "orders"], ["repair-blobs", "orders"], ["node", "add", "c", "--url", "wss://c"]):
        assert cli.main(argv) == 2, argv
        assert "--admin URL is required" in capsys.readouterr().err
    assert cli.build_parser().parse_args(["certs", "revoke", "--ca", "ca", "--name", "b"]).admin is None


def test_main_passes_replicator_admin_to_verify_and_status(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, Any]] = []

    async def fake_verify(
        admins: list[str], *, repair: bool = False, as_json: bool = False, token: str = "", config: str | None = None
    ) -> int:
        calls.append(("verify", (admins, repair, as_json, token)))
        return 0

    async def fake_status(admin: str, as_json: bool, check: bool = False, token: str = "", **filters: Any) -> int:
        calls.append(("status", (admin, as_json, check, token)))
        return 1

    monkeypatch.setattr(inspect, "cmd_verify", fake_verify)
    monkeypatch.setattr(inspect, "cmd_status", fake_status)
    monkeypatch.setenv(cli.ADMIN_ENV, "http://a:1,http://b:2")

    assert cli.main(["verify", "--json"]) == 0
    assert cli.main(["verify", "--admin", "http://c:3", "--admin", "http://d:4"]) == 0
    assert cli.main(["status", "--check"]) == 1
    monkeypatch.setenv(cli.ADMIN_TOKEN_ENV, "t0ken")  # the admin token they send
    assert cli.main(["status"]) == 1
    assert calls == [
        ("verify", (["http://a:1", "http://b:2"], False, True, "")),
        ("verify", (["http://c:3", "http://d:4"], False, False, "")),
        ("status", ("http://a:1", False, True, "")),
        ("status", ("http://a:1", False, False, "t0ken")),
    ]


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_completion_script_names_the_commands_and_options(shell: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["completion", shell]) == 0
    script = capsys.readouterr().out
    assert "_shtab_replicator" in script
    for word in ("run", "status", "verify", "delete-database", "repair-blobs", "--check", "--admin"):
        assert word in script, word


def test_completion_refuses_an_unknown_shell(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["completion", "powershell"])
    assert exit_info.value.code == 2
